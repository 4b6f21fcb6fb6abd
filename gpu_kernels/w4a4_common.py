"""What the W4A4 GEMMs for Hopper (and sm_89) share: the fp16 operand they multiply, the NVFP4
weight decoded to that operand in registers, and the main loop over K (w4a4_dense.py's dense kernel,
w4a4_experts.py's grouped one; the Gluon kernel takes the decode's PTX). With them the autotuning
tables' configurations and the check of an operand's global scale, which the Blackwell kernels use
too.

Hopper has no FP4 tensor cores and `tl.dot_scaled` does not compile for sm_90, so the weight is
decoded in registers. An E2M1 code c put in an E4M3 byte as (c & 7) << 2 | (c & 8) << 4 *is* c's
value times 2^-6, and the hardware E4M3 -> fp16 conversion times the block scale s gives

    W_tile = value * s * 2^-6                        exact in fp16 (<= 6 significant bits)
    X_tile = (DQ(x_q) + DQ(r_q)) / g_x * 2^-6        the quantizer's operand
                                                     (W4A16: x / g_x * 2^-6)
    y      = (W_tile @ X_tile.T) * 2^12 * g_x * g_w  fp32 accumulation; scales in the epilogue

A weight byte holds elements 2i and 2i+1, so K is consumed as an even and an odd half: two products
per K step, no shuffles. The operand (written by w4a4_quantize.py, or the prefill's decoded weight)
is laid out the same way: two fp16 planes (2, rows, K/2) of the even and the odd columns.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.expert_layout import EXPERT_ROW_BLOCK

OPERAND_SHIFT = 2.0**-6  # the Hopper kernels' fp16 operands hold value * block_scale * 2^-6
EPILOGUE = tl.constexpr(OPERAND_SHIFT**-2)  # 2^12: undoes the two operands' 2^-6
EXPERT_ROWS = tl.constexpr(EXPERT_ROW_BLOCK)

# Packed E2M1 codes -> fp16 x 2^-6 (even and odd nibbles), 4 bytes an invocation: shared by the
# Triton and the Gluon kernels (_e2m1_pairs_to_fp16 says how it works).
E2M1_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t;
.reg .b16 l0, l1, h0, h1;
and.b32 t, $4, 0x08080808;
shl.b32 t, t, 4;
and.b32 lo, $4, 0x07070707;
shl.b32 lo, lo, 2;
or.b32 lo, lo, t;
shr.b32 hi, $4, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $4, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")


def empty_planes(rows, half_k, device):
    """An fp16 operand buffer (2, rows, K/2), the planes a multiple of 64 elements apart
    (16-byte aligned)."""
    plane = triton.cdiv(rows * half_k, 64) * 64
    planes = torch.empty((2, plane), dtype=torch.float16, device=device)
    return planes[:, : rows * half_k].view(2, rows, half_k)


def x_scale_is_per_row(x_global_scale, rows, name):
    """Is an operand's global scale one per row ((rows,) fp32), not one for all (() or (1,))? One
    row's one scale is both: the kernels then read the same value either way."""
    if x_global_scale.numel() not in (1, rows):
        raise ValueError(
            f"{name}: x_global_scale must be one scale or one per operand row ({rows},), got shape "
            f"{tuple(x_global_scale.shape)}"
        )
    return x_global_scale.numel() > 1


# ------------------------------------------------------------------ GEMM building blocks
@triton.jit
def _e4m3_to_fp16(byte, GPU: tl.constexpr):
    """E4M3 bytes (uint8) -> fp16, exact. The GPU decodes 0x7F as NaN; the interpreter as 480."""
    value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    if not GPU:
        value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)
    return value


@triton.jit
def _e2m1_pairs_to_fp16(packed, GPU: tl.constexpr):
    """Packed bytes -> (even, odd) fp16 tensors of the same shape: the low and the high nibble's
    E2M1 value times 2^-6, via the code's E4M3 byte ((c & 7) << 2 | (c & 8) << 4). On the GPU the
    bit arithmetic runs on 32-bit words (4 codes per instruction) and cvt.rn.f16x2.e4m3x2 converts
    two bytes per instruction; elementwise, so however Triton groups 4 bytes the result is the
    same."""
    if GPU:
        even, odd = tl.inline_asm_elementwise(
            asm=E2M1_PAIRS_PTX,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        even_byte = ((packed & 7) << 2) | ((packed & 8) << 4)
        odd_byte = ((packed >> 2) & 0x1C) | (packed & 0x80)
        even = even_byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = odd_byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def weight_tile(
    data_ptr,
    scale_ptr,
    rows,
    row_mask,
    k0,
    K,
    stride_data,
    stride_scale,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GPU: tl.constexpr,
    CHUNK: tl.constexpr = 0,
    stride_chunk=0,
    stride_scale_chunk=0,
):
    """Columns k0..k0+BLOCK_K of NVFP4 rows as (ROWS, BLOCK_K/2) fp16 even and odd tiles holding
    value * block_scale * 2^-6 exactly, for the tensor cores: each row's BLOCK_K/2 bytes load as one
    run (16-byte loads). CHUNK: the rows are in the experts' layout of CHUNK-element chunks (a step
    within one chunk; stride_data / _scale step a block of EXPERT_ROWS rows)."""
    packed, scale_byte = _weight_bytes(
        data_ptr,
        scale_ptr,
        rows,
        row_mask,
        k0,
        K,
        stride_data,
        stride_scale,
        BLOCK_K,
        EVEN_K,
        CHUNK,
        stride_chunk,
        stride_scale_chunk,
    )
    return _decoded_tile(packed, scale_byte, ROWS, BLOCK_K, GPU)


@triton.jit
def _weight_bytes(
    data_ptr,
    scale_ptr,
    rows,
    row_mask,
    k0,
    K,
    stride_data,
    stride_scale,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    CHUNK: tl.constexpr,
    stride_chunk,
    stride_scale_chunk,
):
    """weight_tile's codes (ROWS, BLOCK_K/2) and E4M3 scale bytes (ROWS, BLOCK_K/16), as loaded."""
    GB: tl.constexpr = BLOCK_K // 16
    blocks = k0 // 16 + tl.arange(0, GB)  # (GB,)
    byte_cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]  # (1, BLOCK_K/2)
    if CHUNK:
        block, row = rows // EXPERT_ROWS, rows % EXPERT_ROWS
        chunk, within = k0 // CHUNK, k0 % CHUNK  # within: a multiple of BLOCK_K (wide loads)
        step = tl.multiple_of(chunk * stride_chunk + within // 2, BLOCK_K // 2)
        data_ptrs = (
            data_ptr
            + (block * stride_data + row * (CHUNK // 2))[:, None]
            + (step + tl.arange(0, BLOCK_K // 2))[None, :]
        )
    else:
        data_ptrs = data_ptr + rows[:, None] * stride_data + byte_cols
    data_mask = row_mask[:, None] & (byte_cols < K // 2)
    if CHUNK:
        step = tl.multiple_of(chunk * stride_scale_chunk + within // 16, GB)
        scale_ptrs = (
            scale_ptr
            + (block * stride_scale + row * (CHUNK // 16))[:, None]
            + (step + tl.arange(0, GB))[None, :]
        )
    else:
        scale_ptrs = scale_ptr + rows[:, None] * stride_scale + blocks[None, :]
    if EVEN_K:  # masks constant along K: wide loads
        packed = tl.load(data_ptrs, mask=data_mask, other=0)
        scale_byte = tl.load(scale_ptrs, mask=row_mask[:, None], other=0)  # (ROWS, GB)
    else:
        packed = tl.load(data_ptrs, mask=data_mask, other=0)
        scale_byte = tl.load(
            scale_ptrs, mask=row_mask[:, None] & (blocks < K // 16)[None, :], other=0
        )
    return packed, scale_byte


@triton.jit
def _decoded_tile(packed, scale_byte, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, GPU: tl.constexpr):
    """_weight_bytes' codes and scale bytes -> weight_tile's even and odd fp16 tiles."""
    GB: tl.constexpr = BLOCK_K // 16
    block_scale = _e4m3_to_fp16(scale_byte, GPU)[:, :, None]  # (ROWS, GB, 1)
    even, odd = _e2m1_pairs_to_fp16(packed, GPU)
    even = tl.reshape(tl.reshape(even, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))
    odd = tl.reshape(tl.reshape(odd, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))
    return even, odd


@triton.jit
def _operand_tile(
    x_ptr,
    rows,
    row_mask,
    k0,
    K,
    stride_row,
    plane_size,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Columns k0..k0+BLOCK_K of fp16 operand planes (2, rows, K/2) as (rows, BLOCK_K/2) even and
    odd tiles."""
    cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_row + cols
    mask = row_mask[:, None] & (cols < K // 2)
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + plane_size, mask=mask, other=0.0)


@triton.jit
def mainloop(
    x_ptr,
    row0,
    M,
    stride_x,
    x_plane,
    w_ptr,
    w_scale_ptr,
    cols,
    col_mask,
    stride_w,
    stride_ws,
    w_plane,
    K,
    k_begin,
    k_end,
    W_FP16: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    x_rows,
    X_FIRST: tl.constexpr,
    CHUNK: tl.constexpr = 0,
    stride_wc=0,
    stride_sc=0,
):
    """acc (BLOCK_N, BLOCK_M) = W[cols] @ X[x_rows].T over columns k_begin..k_end, in fp32, without
    the global scales and 2^12. X: fp16 operand planes; W: NVFP4 codes, or fp16 operand planes
    (W_FP16). X_FIRST: X is the MMA's left operand (M side) and the weight its right one, whose
    staged codes Triton decodes straight into mma.sync's operand registers; fewer instructions per
    weight element than the weight on the left, whose wgmma register layout makes Triton read the
    codes two bytes at a time (seen in the SASS). CHUNK: W in ExpertWeights' layout
    (weight_tile)."""
    row_mask = (row0 + tl.arange(0, BLOCK_M)) < M
    if X_FIRST:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if W_FP16:
            w_even, w_odd = _operand_tile(
                w_ptr, cols, col_mask, k0, K, stride_w, w_plane, BLOCK_K, EVEN_K
            )
        else:
            w_even, w_odd = weight_tile(
                w_ptr,
                w_scale_ptr,
                cols,
                col_mask,
                k0,
                K,
                stride_w,
                stride_ws,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
                GPU,
                CHUNK,
                stride_wc,
                stride_sc,
            )
        x_even, x_odd = _operand_tile(
            x_ptr, x_rows, row_mask, k0, K, stride_x, x_plane, BLOCK_K, EVEN_K
        )
        if X_FIRST:
            acc = tl.dot(x_even, tl.trans(w_even), acc)
            acc = tl.dot(x_odd, tl.trans(w_odd), acc)
        else:
            acc = tl.dot(w_even, tl.trans(x_even), acc)
            acc = tl.dot(w_odd, tl.trans(x_odd), acc)
    if X_FIRST:
        acc = tl.trans(acc)  # (BLOCK_N, BLOCK_M)
    return acc


# ------------------------------------------------------------------ autotuning
# A table row: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K[, X_FIRST[, maxnreg]]), per M
# bucket; maxnreg caps the registers a thread (more programs an SM, at the price of spills). Under
# the interpreter one small configuration per bucket, splitting K in the decode buckets so tests run
# the split epilogue, and X_FIRST in two buckets so tests run both operand orders of the experts'
# kernel. Its buckets are those of w4a4_dense.DENSE_CONFIGS and w4a4_experts.GROUPED_CONFIGS.
INTERPRETER_CONFIGS = {
    bucket: [(16, 32, 64, 4, 1, 2 if bucket <= 64 else 1, bucket in (16, 256))]
    for bucket in (16, 64, 256, 4096)
}


def autotune_configs(table, x_first=True):
    """The autotuner's configurations of a table; x_first False: without the X_FIRST key
    (the dense kernel)."""
    configs = []
    for bucket, entries in (INTERPRETER_CONFIGS if INTERPRET else table).items():
        if bucket not in table:
            continue
        for bm, bn, bk, warps, stages, split_k, *rest in entries:  # rest: X_FIRST, maxnreg
            kwargs = {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "SPLIT_K": split_k,
                "BUCKET": bucket,
            }
            if x_first:
                kwargs["X_FIRST"] = bool(rest and rest[0])
            configs.append(
                triton.Config(
                    kwargs,
                    num_warps=warps,
                    num_stages=stages,
                    maxnreg=rest[1] if len(rest) > 1 else None,
                )
            )
    return configs
