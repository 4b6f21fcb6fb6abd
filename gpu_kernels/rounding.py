"""BF16 rounding by integer arithmetic on fp32 bit patterns, for kernels that round as torch does.

A cast will not do, for two reasons: the Triton interpreter's own fp32 -> bf16 cast truncates where
torch's rounds to nearest even, and on the GPU the compiler may fuse a product and a sum across a
rounding it does not see. Integer arithmetic rounds the same on both, and stays visible:

    bits  = the fp32 bit pattern of x
    bf16  = (bits + 0x7FFF + (bit 16 of bits)) >> 16       nearest, ties to the even pattern

round_to keeps the rounded value in fp32 (what a BF16 op hands on to the next); to_bf16_bits gives
the 16-bit pattern, stored through an int16 view of a bf16 tensor. A NaN stays a NaN. Users:
norm.py and routing.py (round_to), nvfp4_quantize.py and gemm_common.py's stores (to_bf16_bits).
"""

import torch
import triton
import triton.language as tl

ROUNDED_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes whose roundings round_to makes
_BF16_ROUND_BIAS = tl.constexpr((1 << 15) - 1)  # 0x7FFF: just under half of the dropped 16 bits
_BF16_NAN = tl.constexpr(0x7FC0)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 -> the nearest BF16 (ties to even), kept in fp32; fp32 unchanged. By integer arithmetic:
    the interpreter's own cast truncates, and the compiler cannot fuse a rounding it does not see
    (FP16 is left out for that reason: NVPTX contracted a cast-rounded product and sum into one
    fp16 FMA, so the fused RoPE was no longer torch's, seen on the H200)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x


@triton.jit
def to_bf16_bits(value):
    """fp32 -> bf16 bit pattern (int32, low 16 bits), nearest-even, by integer arithmetic: the CPU
    interpreter's own fp32->bf16 cast truncates; on the GPU this equals torch's .to(bfloat16)."""
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + _BF16_ROUND_BIAS + ((bits >> 16) & 1)) >> 16
    return tl.where(value == value, bits, _BF16_NAN) & 0xFFFF  # keep NaN a NaN
