"""Compile every Triton kernel config for Hopper (sm_90) ahead of time; print JSON results.

    python tests/kernels/hopper_compile.py     # no GPU needed: triton's wheel carries ptxas

Run in a process without TRITON_INTERPRET (test_triton_compile.py starts it so): the
interpreter wraps kernels and triton.language at import, and only compiled-mode objects
go through Triton's compiler. Arguments are specialized as the JIT does at run time:
pointers and the strides the launchers pass (multiples of 16 elements) are 16-divisible,
except a quantized KV cache's (rows of head_dim + 2 bytes), specialized by their values.
"""

from __future__ import annotations

import json
import os
import re
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
# A quantized KV cache (kernels/kv_quant.py): (kind, then the fields above). int8 and fp8
# rows read by bf16 queries on every config table path (decode, split-K decode, prefill) at
# head_dim 128, and by fp16 / fp32 queries and at head_dims 64 and 256 on one path each.
QUANT_ATTENTION_CASES = {
    "decode_int8_bf16_d128_bs16": ("int8", torch.bfloat16, 64, 64, 8, 4, 128, 1024, 16),
    "decode_split_int8_bf16_d128_bs16": ("int8", torch.bfloat16, 16, 16, 8, 4, 128, 4096, 16),
    "prefill_int8_bf16_d128_bs16": ("int8", torch.bfloat16, 512, 4, 8, 4, 128, 1024, 16),
    "decode_fp8_bf16_d128_bs16": ("fp8", torch.bfloat16, 64, 64, 8, 4, 128, 1024, 16),
    "decode_split_fp8_bf16_d128_bs16": ("fp8", torch.bfloat16, 16, 16, 8, 4, 128, 4096, 16),
    "prefill_fp8_bf16_d128_bs16": ("fp8", torch.bfloat16, 512, 4, 8, 4, 128, 1024, 16),
    "decode_int8_fp16_d64_bs1_gqa8": ("int8", torch.float16, 64, 64, 8, 8, 64, 1024, 1),
    "prefill_fp8_fp16_d64_bs32_gqa3": ("fp8", torch.float16, 512, 4, 2, 3, 64, 1024, 32),
    "decode_fp8_fp32_d128_bs16": ("fp8", torch.float32, 64, 64, 8, 4, 128, 1024, 16),
    "decode_int8_bf16_d256_bs16_gqa4": ("int8", torch.bfloat16, 64, 64, 1, 4, 256, 1024, 16),
    "prefill_fp8_bf16_d256_bs16_gqa4": ("fp8", torch.bfloat16, 512, 4, 1, 4, 256, 1024, 16),
}
# The quantizing cache write: (kind, K/V dtype), head_dim 128 and 8 KV heads.
QUANT_CACHE_CASES = {
    f"cache_{kind}_{TRITON_TYPES[dtype]}": (kind, dtype)
    for kind in ("int8", "fp8")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
}
QUANT_POINTER_TYPES = {"int8": "*i8", "fp8": "*u8"}
# Weight-only GEMMs: (kernel, dtype, M, N, K, group size or None): the decode (split-K) and
# prefill launch shapes of Llama-3-8B's layers; W8A16 in fp32 too (ieee dots); W4A16 with
# GPTQ's group_size -1 (a group of all K = 14336 inputs of down_proj).
GEMM_CASES = {
    "w8a16_decode_bf16": ("w8a16", torch.bfloat16, 1, 4096, 14336, None),
    "w8a16_prefill_bf16": ("w8a16", torch.bfloat16, 512, 128256, 4096, None),
    "w8a16_decode_fp32": ("w8a16", torch.float32, 4, 4096, 4096, None),
    "w4a16_decode_bf16_group_all": ("w4a16", torch.bfloat16, 1, 4096, 14336, 14336),
}


def compile_kernel(
    kernel, dtype: str, constexprs: dict, pointer_types: dict, num_warps: int = 4, strides: dict | None = None
):
    """`strides`: values of the stride arguments that are not multiples of 16 in every launch
    (a quantized cache's rows are head_dim + 2 bytes); the JIT specializes only the multiples."""
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
            # do_not_specialize: the table's width changes every step
            if name != "stride_table_seq" and (strides or {}).get(name, 16) % 16 == 0:
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


def _quant_attention_summary(compiled, **extra) -> dict:
    """An attention kernel's summary on a quantized cache, with its global loads by width:
    the codes' rows are 2-byte aligned, so 16-bit loads (b16) are the widest they allow."""
    ptx = compiled.asm["ptx"]
    byte_loads = len(re.findall(r"ld\.global(?:\.\w+)*\.[usb]8\b", ptx))
    return _summary(compiled, byte_loads=byte_loads, b16_loads=ptx.count("ld.global.b16"), **extra)


def _write_summary(compiled, kind: str) -> dict:
    """A quantizing write's summary, and the instructions its bit-exactness rests on: the
    divisions correctly rounded (div.rn, not div.full/approx), the INT8 round-half-even's
    constant (1.5 * 2**23 = 0f4B400000) not folded away, FP8 by cvt.rn.satfinite."""
    ptx = compiled.asm["ptx"]
    return _summary(
        compiled,
        div_rn=ptx.count("div.rn.f32"),
        div_approx=ptx.count("div.full.f32") + ptx.count("div.approx"),
        rint_constant="0f4B400000" in ptx,
        fp8_rne="cvt.rn.satfinite.e4m3x2.f32" in ptx,
        kv_quant=kind,
    )


def _quant_cache_strides(block_size: int, kv_heads: int, head_dim: int) -> dict:
    """The cache strides of a quantized cache [blocks, block_size, kv_heads, head_dim + 2] of bytes."""
    row = head_dim + 2
    return dict(
        stride_cache_head=row, stride_cache_token=kv_heads * row, stride_cache_block=block_size * kv_heads * row
    )


def main() -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the compiler needs compiled-mode kernels")
    from kernels.triton_attention import _merge_splits_kernel, _paged_attention_kernel, choose_config
    from kernels.triton_cache import KV_QUANT_FP8, KV_QUANT_INT8, _reshape_and_cache_kernel

    KV_QUANT = {"int8": KV_QUANT_INT8, "fp8": KV_QUANT_FP8}

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
            KV_QUANT=0,
        )
        attempt(name, lambda: _summary(
            compile_kernel(_paged_attention_kernel, TRITON_TYPES[dtype], constexprs, ATTENTION_POINTERS,
                           config.num_warps),
            decode=tokens == seqs, dtype=TRITON_TYPES[dtype], num_splits=config.num_splits,
        ))
    for name, (kind, dtype, tokens, seqs, kv_heads, ratio, head_dim, max_context, block_size) in (
        QUANT_ATTENTION_CASES.items()
    ):
        config = choose_config(tokens, seqs, kv_heads, ratio, head_dim, max_context)
        constexprs = dict(
            NUM_QUERIES_PER_KV=ratio, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=config.block_m,
            BLOCK_Q=config.block_m // ratio, TILE_N=config.tile_n, NUM_SPLITS=config.num_splits,
            USE_SPLIT_K=config.num_splits > 1, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
            KV_QUANT=KV_QUANT[kind],
        )
        pointers = dict(ATTENTION_POINTERS, key_cache_ptr=QUANT_POINTER_TYPES[kind],
                        value_cache_ptr=QUANT_POINTER_TYPES[kind])
        attempt(name, lambda: _quant_attention_summary(
            compile_kernel(_paged_attention_kernel, TRITON_TYPES[dtype], constexprs, pointers, config.num_warps,
                           _quant_cache_strides(block_size, kv_heads, head_dim)),
            decode=tokens == seqs, dtype=TRITON_TYPES[dtype], num_splits=config.num_splits, kv_quant=kind,
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
            _reshape_and_cache_kernel, dtype, dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_HEADS=8, KV_QUANT=0),
            {"slot_mapping_ptr": "*i64"},
        )))
    for name, (kind, dtype) in QUANT_CACHE_CASES.items():
        pointers = {"slot_mapping_ptr": "*i64", "key_cache_ptr": QUANT_POINTER_TYPES[kind],
                    "value_cache_ptr": QUANT_POINTER_TYPES[kind]}
        attempt(name, lambda: _write_summary(compile_kernel(
            _reshape_and_cache_kernel, TRITON_TYPES[dtype],
            dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_HEADS=8, KV_QUANT=KV_QUANT[kind]), pointers, 4,
            _quant_cache_strides(16, 8, 128),
        ), kind))
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
