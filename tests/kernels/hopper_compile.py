"""Compile every Triton kernel config for Hopper (sm_90) ahead of time; print JSON results.

    python tests/kernels/hopper_compile.py     # no GPU needed: triton's wheel carries ptxas

Run in a process without TRITON_INTERPRET (test_triton_compile.py starts it so): the
interpreter wraps kernels and triton.language at import, and only compiled-mode objects
go through Triton's compiler. Arguments are specialized as the JIT does at run time:
pointers and the strides the launchers pass (multiples of 16 elements) are 16-divisible.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ATTENTION_POINTERS = {
    "partial_out_ptr": "*fp32",
    "partial_max_ptr": "*fp32",
    "partial_sum_ptr": "*fp32",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
}
# (dtype, num_tokens, num_seqs, num_kv_heads, gqa ratio, head_dim, max_context, block_size):
# every (decode-only, head_dim) row of the config table, split-K on and off, all dtypes.
ATTENTION_CASES = {
    "decode_bf16_d128_bs16": (torch.bfloat16, 64, 64, 8, 4, 128, 1024, 16),
    "decode_split_bf16_d128_bs16": (torch.bfloat16, 16, 16, 8, 4, 128, 4096, 16),
    "decode_bf16_d64_bs1_gqa8": (torch.bfloat16, 64, 64, 8, 8, 64, 1024, 1),
    "decode_fp16_d128_bs128_gqa1": (torch.float16, 64, 64, 8, 1, 128, 1024, 128),
    "decode_fp32_d128_bs16": (torch.float32, 64, 64, 8, 4, 128, 1024, 16),
    "prefill_bf16_d128_bs16": (torch.bfloat16, 512, 4, 8, 4, 128, 1024, 16),
    "prefill_bf16_d64_bs32_gqa3": (torch.bfloat16, 512, 4, 2, 3, 64, 1024, 32),
    "prefill_fp16_d128_bs1_gqa8": (torch.float16, 512, 4, 1, 8, 128, 1024, 1),
    # head_dim 256 (Gemma 3: 4 query heads on 1 KV head).
    "decode_bf16_d256_bs16_gqa4": (torch.bfloat16, 64, 64, 1, 4, 256, 1024, 16),
    "decode_split_bf16_d256_bs16_gqa4": (torch.bfloat16, 4, 4, 1, 4, 256, 4096, 16),
    "prefill_bf16_d256_bs16_gqa4": (torch.bfloat16, 512, 4, 1, 4, 256, 1024, 16),
}
# Weight-only GEMMs: (kernel, dtype, M, N, K, group size or None): the decode (split-K) and
# prefill launch shapes of Llama-3-8B's layers; W8A16 in fp32 too (ieee dots); W4A16 with
# GPTQ's group_size -1 (a group of all K = 14336 inputs of down_proj).
GEMM_CASES = {
    "w8a16_decode_bf16": ("w8a16", torch.bfloat16, 1, 4096, 14336, None),
    "w8a16_prefill_bf16": ("w8a16", torch.bfloat16, 512, 128256, 4096, None),
    "w8a16_decode_fp32": ("w8a16", torch.float32, 4, 4096, 4096, None),
    "w4a16_decode_bf16_group_all": ("w4a16", torch.bfloat16, 1, 4096, 14336, 14336),
}


def compile_kernel(kernel, dtype: str, constexprs: dict, pointer_types: dict, num_warps: int = 4):
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*" + dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        elif name.startswith("stride"):
            signature[name] = "i64"
            if name != "stride_table_seq":  # do_not_specialize: the table's width changes every step
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps})


def _summary(compiled, **extra) -> dict:
    return dict(
        ok=bool(compiled.asm["cubin"]),
        shared=compiled.metadata.shared,
        async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
        **extra,
    )


def main() -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the compiler needs compiled-mode kernels")
    from kernels.triton_attention import _merge_splits_kernel, _paged_attention_kernel, choose_config
    from kernels.triton_cache import _reshape_and_cache_kernel

    results: dict[str, dict] = {}

    def attempt(name, build):
        try:
            results[name] = build()
        except Exception as e:  # reported per case by the test
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000])

    for name, (dtype, tokens, seqs, kv_heads, ratio, head_dim, max_context, block_size) in ATTENTION_CASES.items():
        config = choose_config(tokens, seqs, kv_heads, ratio, head_dim, max_context)
        constexprs = dict(
            NUM_QUERIES_PER_KV=ratio, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=config.block_m,
            BLOCK_Q=config.block_m // ratio, TILE_N=config.tile_n, NUM_SPLITS=config.num_splits,
            USE_SPLIT_K=config.num_splits > 1, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        )
        attempt(name, lambda: _summary(
            compile_kernel(_paged_attention_kernel, TRITON_TYPES[dtype], constexprs, ATTENTION_POINTERS,
                           config.num_warps),
            decode=tokens == seqs, dtype=TRITON_TYPES[dtype], num_splits=config.num_splits,
        ))
    from kernels.triton_w4a16 import _w4a16_config, _w4a16_kernel
    from kernels.triton_w8a16 import _w8a16_kernel

    for name, (kind, dtype, m, n, k, group) in GEMM_CASES.items():
        config = _w4a16_config(m, n, k, 132)  # W8A16 launches with W4A16's shapes; an H200 has 132 SMs
        split = config["SPLIT_K"]
        constexprs = dict(HAS_BIAS=False, SPLIT_K=split, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                          **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")})
        pointers = {"out_ptr": "*fp32" if split > 1 else "*" + TRITON_TYPES[dtype]}
        if kind == "w8a16":
            kernel, pointers["qweight_ptr"] = _w8a16_kernel, "*i8"
        else:
            kernel, pointers["qweight_ptr"], pointers["zeros_ptr"] = _w4a16_kernel, "*i32", "*u8"
            constexprs.update(GROUP_SIZE=group, HAS_ZEROS=True)
        attempt(name, lambda: _summary(
            compile_kernel(kernel, TRITON_TYPES[dtype], constexprs, pointers, config["num_warps"]),
            split_k=split,
        ))
    for splits in (2, 16):
        attempt(f"merge_{splits}", lambda: _summary(compile_kernel(
            _merge_splits_kernel, "bf16", dict(HEAD_DIM=128, NUM_SPLITS=splits),
            {k: "*fp32" for k in ("partial_out_ptr", "partial_max_ptr", "partial_sum_ptr")},
        )))
    for dtype in TRITON_TYPES.values():
        attempt(f"cache_{dtype}", lambda: _summary(compile_kernel(
            _reshape_and_cache_kernel, dtype, dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_HEADS=8),
            {"slot_mapping_ptr": "*i64"},
        )))
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
