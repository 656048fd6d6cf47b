"""The engine with a quantized KV cache (`kv_cache_dtype="int8"`, kernels/kv_quant.py) on the
C++ CPU kernels, bf16, on a tiny random Llama (head dim 64):

- the same `--kv-cache-memory` holds 1.94x the blocks (66 bytes a row instead of 128);
- what moves whole blocks moves the scales with them: a request's tokens and logprobs are
  the same bits alone, beside others, from the prefix cache, prefilled in chunks, as sample 0
  of n = 4 (its last block shared copy-on-write), recomputed after a preemption and with
  speculative decoding (an int8 cache is always read on the invariant route);
- the fused decode call and the per-op forward read the int8 rows alike;
- the prompt logprobs are within bf16 noise of the torch backend's, whose reference ops
  quantize and dequantize the rows in torch (a gross check: a misread scale or code would
  be far off; the kernels' exactness is tests/kernels/test_cpu_kv_int8.py's);
- FP8 is refused on the C++ kernels with a message naming the alternatives, and runs on the
  torch backend;
- in float32 the int8 rows are read through the reference attention (said at start-up),
  with the torch backend's tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.llm import LLM
from engine.models.llama import ModelArgs
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels
from tests.tiny_models import make_model_folder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_kernels.int8_cache_runs(torch.bfloat16, 64),
                       reason="the C++ int8 KV attention needs AVX512-BF16"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=2)


def result(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("tiny-llama-kv8"), "llama")


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, 512, (24,), generator=g).tolist()
    return (motif * 8)[:180]  # repetitive: speculation's proposals get accepted


def engine(folder, **args) -> LLM:
    return LLM(str(folder), kv_cache_memory=0.02, max_model_len=256,
               **({"dtype": "bfloat16", "kv_cache_dtype": "int8", "enable_prefix_caching": False} | args))


def test_the_same_memory_holds_1_94x_the_tokens(folder, default_model_path):
    int8, bf16 = engine(folder), engine(folder, kv_cache_dtype="auto")
    ratio = int8.engine_core.worker.num_blocks / bf16.engine_core.worker.num_blocks
    assert ratio == pytest.approx(128 / 66, abs=0.01)  # 1.94, up to whole blocks
    # The bundled model's arithmetic (30 layers x 3 KV heads x 64): 23040 -> 11880 bytes a token.
    from engine.loader import load_hf_config

    args = ModelArgs.from_hf_config(load_hf_config(default_model_path))
    specs = [KVCacheSpec.from_model(args, torch.bfloat16, 16, kind) for kind in ("auto", "int8")]
    assert [s.bytes_per_token for s in specs] == [23040, 11880]
    assert specs[1].arithmetic() == "2 x 30 layers x 3 KV heads x (64 x 1 byte + a 2-byte scale)"
    for llm in (int8, bf16):
        llm.shutdown()


def test_a_request_is_the_same_bits_whatever_runs_beside_it(folder, target, record_schedules):
    llm = engine(folder)
    ref = {k: result(llm.generate([target], p)[0]) for k, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    g = torch.Generator().manual_seed(9)
    others = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 49, (9,), generator=g)]
    varied = [SamplingParams(max_tokens=4 + 7 * i % 17, temperature=0.7 if i % 3 else 0.0, seed=i, ignore_eos=True)
              for i in range(9)]
    outs = llm.generate([target] + others + [target], [GREEDY] + varied + [SEEDED])
    assert result(outs[0]) == ref["greedy"] and result(outs[-1]) == ref["seeded"]
    # n = 4: the samples share the prompt's blocks, the last one copied on write.
    out = llm.generate([target], replace(SEEDED, n=4))[0]
    assert len(out.outputs) == 4 and result(out) == ref["seeded"]
    # From the prefix cache.
    cached = engine(folder, enable_prefix_caching=True)
    assert result(cached.generate([target], GREEDY)[0]) == ref["greedy"]
    hit = cached.generate([target], GREEDY)[0]
    assert hit.num_cached_tokens > 0 and result(hit) == ref["greedy"]
    # In chunks of 16 tokens.
    chunked = engine(folder, long_prefill_token_threshold=16, max_num_batched_tokens=64)
    steps = record_schedules(chunked.engine_core)
    assert result(chunked.generate([target], GREEDY)[0]) == ref["greedy"]
    assert any(partial for _, partial in steps)
    # With speculative decoding (verification chunks of 1 + k rows).
    spec = engine(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                              "prompt_lookup_min": 2, "disable_by_batch_size": None})
    drafts = []
    spec.engine_core.on_step = lambda stats: drafts.append(stats.spec_num_draft_tokens)
    long = replace(GREEDY, max_tokens=64)
    assert result(spec.generate([target], long)[0]) == result(llm.generate([target], long)[0])
    assert sum(drafts) > 0
    # Preempted (the newest request, the target) and recomputed.
    small = engine(folder, num_gpu_blocks_override=-(-len(target) // 16) + 7)
    steps = record_schedules(small.engine_core)
    batch = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True) for i in range(6)]
    outs = small.generate(batch + [target], params + [GREEDY])
    assert result(outs[-1]) == ref["greedy"]
    assert f"{outs[-1].request_id}-0" in {r.request_id for out, _ in steps for r in out.preempted}
    for e in (llm, cached, chunked, spec, small):
        assert e.engine_core.block_manager.num_used_blocks == 0
        e.shutdown()


def test_the_fused_decode_call_reads_the_int8_rows_as_the_per_op_forward(folder, target, monkeypatch):
    llm = engine(folder)
    fused = llm.engine_core.worker.model.fused_decode
    assert fused is not None
    with_fused = result(llm.generate([target, target[:50]], GREEDY)[0])
    monkeypatch.setattr(type(fused), "runs", lambda self, *a: False)
    assert result(llm.generate([target, target[:50]], GREEDY)[0]) == with_fused
    llm.shutdown()


def test_prompt_logprobs_are_within_bf16_noise_of_the_torch_reference_ops(folder, target):
    """The C++ write + attention against the torch backend's reference ops (quantize, then
    dequantize what is gathered) over a 120-token prompt. bf16 rounding alone moves this
    sharp tiny model's logprobs by up to ~0.07 between the two backends with a bf16 cache
    (mean ~0.02); with int8 rows they stay as close. Reading codes without their scales, or
    another row's scale, moves them by whole nats."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(**args):
        llm = engine(folder, **args)
        out = llm.generate([target[:120]], params)[0]
        llm.shutdown()
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    diff = (prompt_logprobs() - prompt_logprobs(kernel_backend="torch")).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.3, (diff.mean(), diff.max())


def test_fp8_is_refused_on_the_cpu_kernels_and_runs_on_the_torch_backend(folder, target):
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 on CPU"):
        engine(folder, kv_cache_dtype="fp8")
    llm = engine(folder, kv_cache_dtype="fp8", kernel_backend="torch")
    assert llm.engine_core.worker.kv_caches[0][0].dtype == torch.uint8
    out = llm.generate([target[:40]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 16
    llm.shutdown()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        engine(folder, kv_cache_dtype="int4")


def test_float32_reads_the_int8_cache_through_the_reference_and_says_so(folder, target):
    """float32 queries: the C++ kernel reads int8 rows with bf16 queries only, so the C++
    backend writes the rows (bit for bit the reference's quantization) and attends through
    the reference, which dequantizes what it gathers: the torch backend's tokens, and its
    logprobs within float32 rounding (the two backends' norm and RoPE ops round apart), and
    the start-up facts name the slower path."""
    cpp = engine(folder, dtype="float32")
    assert "through the torch reference attention" in cpp.engine_core.worker.facts()["kv_cache"]
    ref = engine(folder, dtype="float32", kernel_backend="torch")
    prompt = target[:60]
    (got_tokens, got_lps), (want_tokens, want_lps) = (result(e.generate([prompt], GREEDY)[0]) for e in (cpp, ref))
    assert got_tokens == want_tokens
    for got, want in zip(got_lps, want_lps):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got, want))
    for llm in (cpp, ref):
        llm.shutdown()
