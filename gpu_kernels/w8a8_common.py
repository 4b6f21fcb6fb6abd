"""What the FP8 W8A8 GEMMs share (w8a8_dense.py's dense kernel, w8a8_experts.py's grouped one):
the main loop over K on the E4M3 codes, the activation tile it reads (stored codes, or x quantized
in registers), the autotuner's configurations built from a kernel's table, and the one-line input
checks of their launchers (the weight, x's scales, the output dtype; check and check_rows, which
the quantizer needs too, live in w8a8_quantize.py, which this module imports). The references
they equal are fp8.linear_reference and fp8.grouped_linear_reference, up to fp32 accumulation
order.

Why the GEMM never dequantizes. A row of x (M, K) and a row of W (N, K) each carry one fp32 scale:

    x[m, k] ~ xc[m, k] * sx[m]   sx[m] = amax |x[m, :]| / 448 (1 for a zero row); xc = e4m3(x / sx)
    W[n, k] ~ wc[n, k] * sw[n]   the same per weight row (fp8.quantize_weight, once per weight sync)

    y[m, n] = sum_k xc[m, k] sx[m] * wc[n, k] sw[n] = sx[m] * sw[n] * sum_k xc[m, k] wc[n, k]

The scales leave the sum, so the K loop multiplies E4M3 codes as they are stored: the tensor cores
form each product exactly (two 4-bit significands) and add in fp32; the epilogue multiplies the fp32
tile by sw (per weight row) and sx (per token row) once and rounds to BF16. Hopper's FP8 MMA adds
its products with fewer bits than fp32: every PROMOTE_K elements the partial sum joins the fp32
accumulator (tl.dot's max_num_imprecise_acc), as CUTLASS promotes, so the result stays within fp32
accumulation-order differences of the reference.

The weight rows are the MMA's left operand, its wide side (its M: 64 a warpgroup), the token rows
its narrow one (16 and up). Tile sizes are autotuned per bucket of rows (CUDA-graph timing,
gpu_kernels/gemm_common.py), as for the W4A4 kernels; each kernel file keeps its own table.

Shape letters: M rows, N output columns (weight rows), K reduction dim, E experts.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.gemm_common import m_bucket
from gpu_kernels.w8a8_quantize import FLOATS, check, quantize_tile

# K elements the FP8 MMA sums in its own precision before they join the fp32 accumulator
PROMOTE_K = 128
_PROMOTE_K = tl.constexpr(PROMOTE_K)


# ------------------------------------------------------------------ the GEMMs' main loop
@triton.jit
def x_tile(
    x_ptr,
    x_rows,
    row_mask,
    stride_x,
    x_scale,
    cols,
    K,
    FUSED: tl.constexpr,
    GPU: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Columns `cols` of x's rows as an E4M3 (rows, BLOCK_K) tile: the stored codes, or (FUSED) x
    itself quantized here with its rows' scales x_scale, bit for bit what the quantizer stores."""
    ptrs = x_ptr + x_rows[:, None] * stride_x + cols[None, :]
    mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K)[None, :]
    if FUSED:
        tile = quantize_tile(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), x_scale, GPU)
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def mainloop(
    x_ptr,
    x_rows,
    row_mask,
    stride_x,
    x_scale,
    w_ptr,
    w_rows,
    w_mask,
    stride_w,
    k_begin,
    k_end,
    K,
    FUSED: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    W_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """acc (W_ROWS, BLOCK_M) = Wc[w_rows] @ xc[x_rows].T over columns k_begin..k_end, on the codes
    (no scales): the weight rows are the MMA's left operand, its wide side. Each weight row's
    BLOCK_K bytes are one contiguous run; with EVEN_K the masks are constant along K and the loads
    16 bytes wide."""
    PROMOTE: tl.constexpr = BLOCK_K if BLOCK_K < _PROMOTE_K else _PROMOTE_K
    acc = tl.zeros((W_ROWS, BLOCK_M), dtype=tl.float32)
    w_ptrs = w_ptr + w_rows[:, None] * stride_w
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = w_mask[:, None] if EVEN_K else w_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptrs + cols[None, :], mask=mask, other=0.0)
        x = x_tile(x_ptr, x_rows, row_mask, stride_x, x_scale, cols, K, FUSED, GPU, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
    return acc


# ------------------------------------------------------------------ autotuning
# Under the interpreter one small configuration per bucket (of the dense table's; the experts'
# buckets map onto them), splitting K in the decode buckets so that tests run the split-K epilogue.
INTERPRETER_CONFIGS = {
    bucket: [(16, 32, 64, 4, 1, 2 if bucket <= 64 else 1)] for bucket in (16, 64, 256, 4096)
}


def autotune_configs(table, has_split_k):
    """The autotuner's configurations of a table (the interpreter's own under
    TRITON_INTERPRET=1). has_split_k: the kernel takes SPLIT_K, its table's rows end with it (the
    dense kernel's)."""
    configs = []
    for bucket, entries in table.items():
        if INTERPRET:
            entries = INTERPRETER_CONFIGS[m_bucket(bucket, INTERPRETER_CONFIGS)][:1]
        for bm, bn, bk, warps, stages, *split_k in entries:
            kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BUCKET": bucket}
            if has_split_k:
                kwargs["SPLIT_K"] = split_k[0]
            configs.append(triton.Config(kwargs, num_warps=warps, num_stages=stages))
    return configs


# ------------------------------------------------------------------ input checks (one line each)
def described(t):
    """What a bad argument was, for its error message: (dtype, shape) of a tensor, else its type."""
    return (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t)


def check_weight(w_codes, w_scale, K, device, experts=False):
    shape = "(E, N, K)" if experts else "(N, K)"
    check(
        isinstance(w_codes, torch.Tensor)
        and w_codes.dtype == torch.float8_e4m3fn
        and w_codes.dim() == 2 + experts
        and w_codes.is_contiguous(),
        f"w8a8: w_codes must be a contiguous {shape} float8_e4m3fn tensor, got "
        f"{described(w_codes)}",
    )
    check(w_codes.shape[-1] == K, f"w8a8: w_codes has K={w_codes.shape[-1]}, the activation K={K}")
    check(
        isinstance(w_scale, torch.Tensor)
        and w_scale.dtype == torch.float32
        and tuple(w_scale.shape) == tuple(w_codes.shape[:-1])
        and w_scale.is_contiguous(),
        f"w8a8: w_scale must be contiguous fp32 of shape {tuple(w_codes.shape[:-1])}, got "
        f"{described(w_scale)}",
    )
    check(
        w_codes.device == device and w_scale.device == device,
        f"w8a8: the weight is on {w_codes.device}, its scales on {w_scale.device}, "
        f"the activation on {device}",
    )


def check_scale(x_scale, M, device):
    check(
        isinstance(x_scale, torch.Tensor)
        and x_scale.dtype == torch.float32
        and x_scale.numel() == M
        and x_scale.is_contiguous()
        and x_scale.device == device,
        f"w8a8: x_scale must be {M} contiguous fp32 row scales on {device}, got "
        f"{described(x_scale)}",
    )


def check_out_dtype(out_dtype):
    check(out_dtype in FLOATS, f"w8a8: out_dtype must be bfloat16/float16/float32, got {out_dtype}")
