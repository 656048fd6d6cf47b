"""Fixtures for every test folder, and the `slow` tier.

`make test` runs everything; `make test-fast` (`pytest -m "not slow"`) leaves out the tests
marked `slow`: every test that runs the real default model (it requests `default_model_path`,
directly or through a fixture such as a started server), the tests marked by hand
(`@pytest.mark.slow`), and those in SLOW_TESTS below, which take seconds each on the tiny
model or none.
"""

import os

# As `pagoda` runs (engine/__init__.py `prefer_passive_openmp`): torch's idle OpenMP threads sleep
# instead of spinning on the cores the C++ kernels' work pool needs. Set here, before anything
# imports torch, for the in-process engines of the tests (the servers they start set it
# themselves).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402

SLOW_TESTS = {
    # node id (a module, a test function, or one parametrized case): why it is slow
    "tests/kernels/test_triton_attention.py::test_full_prefill": "Triton interpreter: long prompts",
    "tests/kernels/test_triton_attention.py::test_mixed_decode_and_prefill_batch": "Triton interpreter: 36 batches",
    "tests/kernels/test_triton_attention.py::test_forced_split_k": "Triton interpreter: every split",
    "tests/kernels/test_triton_cache.py::test_writes_exactly_the_mapped_slots": "Triton interpreter: 144 cases",
    "tests/kernels/test_kernel_dispatch.py::test_import_is_cheap_and_the_interpreter_can_be_switched_on_late":
        "fresh interpreters",
    "tests/engine/test_tensor_parallel.py::test_tp2_equals_tp1_for_other_architectures": "spawns a worker rank per case",
    "tests/engine/test_spec_decode.py::test_tensor_parallel_ranks_run_the_verification_chunks": "spawns a worker rank",
    "tests/engine/test_cuda_graphs.py::test_padded_decode_equals_hf_with_preemption_chunked_prefill_and_shrinking_batches":
        "long generations, on the Triton interpreter too",
    "tests/quantization/test_quantize.py::test_cli_writes_a_folder_and_rejects_bad_combinations": "`pagoda quantize` twice",
    "tests/loadtest/test_bench_linear.py": "a benchmark run",
    "tests/loadtest/test_bench_structured.py::test_quick_run_prints_the_table_and_checks_its_outputs": "a benchmark run",
    "tests/loadtest/test_bench_engine_gpu.py::test_bench_imports_without_the_server_packages": "a fresh interpreter",
    "tests/ops/test_configs.py::test_pagoda_serve_h200_preset_gets_as_far_as_the_model_folder": "`pagoda serve` starts",
    "tests/gguf/test_gguf_models.py::test_float_gguf_gives_the_original_models_greedy_tokens":
        "tiny GGUF models through LLM and transformers generate",
    "tests/gguf/test_gguf_models.py::test_quantized_gguf_dequantized_gives_transformers_greedy_tokens":
        "tiny GGUF models through LLM and transformers' GGUF loader",
    "tests/gguf/test_gemma3_gguf.py": "the real Gemma 3 270M GGUF (opt-in: make test-gguf-gemma)",
    "tests/gguf/test_gguf_models.py::test_quantized_gguf_keeps_integers_and_stays_close[Q4_0]":
        "a tiny GGUF file per type (Q4_1 stays in the fast tier)",
    "tests/gguf/test_gguf_models.py::test_quantized_gguf_keeps_integers_and_stays_close[Q8_0]":
        "a tiny GGUF file per type (Q4_1 stays in the fast tier)",
}


def _listed_slow(nodeid: str) -> str | None:
    for key in SLOW_TESTS:
        if nodeid == key or nodeid.startswith((key + "::", key + "[")):
            return key
    return None


def _stale_slow_tests(config, nodeids) -> str | None:
    """The complaint when the whole suite was collected and SLOW_TESTS names a test it lacks."""
    stale = sorted(set(SLOW_TESTS) - {_listed_slow(nodeid) for nodeid in nodeids})
    if stale and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return f"tests/conftest.py SLOW_TESTS names tests that do not exist: {stale}"
    return None


FIRST_FOLDERS = ("tests/server/", "tests/ops/")
"""Collected first: their modules start servers and run longest (10-70 s each). pytest-xdist
hands whole modules to its workers in collection order, so the long ones go out first and the
short ones last, and the two workers finish together instead of one running a long module
while the other waits."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST_FOLDERS))  # stable: in-module order kept
    for item in items:
        if _listed_slow(item.nodeid) is not None or "default_model_path" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    # Under pytest-xdist (`make test` runs two workers) the controller checks, below: an error
    # raised in a worker's collection reaches the terminal as an INTERNALERROR without its text.
    if not hasattr(config, "workerinput") and (complaint := _stale_slow_tests(config, [i.nodeid for i in items])):
        raise pytest.UsageError(complaint)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The SLOW_TESTS check under pytest-xdist, on the node ids a worker collected. Those are
    what is left after `-m` deselected (`make test-fast`: the slow tests are all missing), so
    the check runs only on an unfiltered run (`make test`)."""
    if node.config.option.markexpr:
        return
    if complaint := _stale_slow_tests(node.config, ids):
        pytest.exit(complaint, returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def default_model_files():
    """The bundled SmolLM2 folder (converted once by `make setup`, or here on first use), for
    its files: the tiny model takes its tokenizer. Not marked slow: nothing runs the model."""
    from engine.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_path(default_model_files):
    """The bundled SmolLM2 folder, for tests that run it: they are marked `slow`."""
    return default_model_files


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_model_files):
    """A 2-layer random-weight Llama with the default model's tokenizer: fast engine tests."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_files / name).exists():
            shutil.copy(default_model_files / name, path / name)
    return path


@pytest.fixture(scope="session")
def thinking_model_path(tmp_path_factory, default_model_files):
    """A tiny Qwen3 with Qwen3's chat template and think tokens that follows THINKING_SCRIPT
    (tests/tiny_models.py `make_thinking_model_folder`)."""
    from tiny_models import THINKING_SCRIPT, make_thinking_model_folder

    return make_thinking_model_folder(tmp_path_factory.mktemp("tiny-thinking-qwen3"), default_model_files,
                                      THINKING_SCRIPT)


@pytest.fixture
def record_schedules():
    """`record(core)` wraps the core's Scheduler.schedule for this test and returns the list
    it fills: per step, (SchedulerOutput, ids of requests given a prefill chunk that leaves
    tokens uncomputed) - the second judged at schedule time, before the step runs."""
    wrapped = []

    def record(core):
        steps = []
        original = core.scheduler.schedule

        def recording():
            out = original()
            partial = [r.request_id for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                       if r.num_computed_tokens + n < r.num_tokens]
            steps.append((out, partial))
            return out

        core.scheduler.schedule = recording
        wrapped.append((core.scheduler, original))
        return steps

    yield record
    for scheduler, original in wrapped:
        scheduler.schedule = original
