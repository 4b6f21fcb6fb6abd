"""The FP8 W8A8 kernels for GPUs with FP8 tensor cores (sm_89 / sm_90): row-wise E4M3 quantization
of the activation and the dense and grouped (experts) GEMMs on the codes. They equal
fp8.linear_reference (dequantize both operands, multiply in fp32, round to BF16;
fp8.grouped_linear_reference for the experts) up to fp32 accumulation order; the quantizer equals
fp8.quantize_rowwise bit for bit.

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

The kernels:
  - the quantizer, x (M, K) -> codes (M, K) E4M3, scales (M, 1) fp32: a program reduces its rows'
    amax, then divides by the scale (IEEE division, as torch does) and rounds to nearest even.
  - the dense GEMM, y.T = W @ x.T: the weight rows on the MMA's wide side (its M: 64 a warpgroup),
    the few token rows of a decode step on its narrow side (16 and up). Decode streams the weight
    once: split-K gives the stream enough programs, and the last of a tile's SPLIT_K programs to
    arrive sums their partial tiles in a fixed order (deterministic). FUSED: the GEMM takes x itself
    and quantizes each tile in registers (a program first reduces its rows' amax over all of K): no
    quantizer launch, but every N tile's program redoes the division; FUSE_MAX_ROWS says up to how
    many rows the layers take it.
  - the experts' grouped GEMM, one launch over (expert, row tile, N tile) with
    gpu_kernels/gemm_common.py's grouped scheduling (as gpu_kernels/w4a4_experts.py's): a program
    finds its expert from the per-expert counts on the device (no host sync), the gate/up GEMM
    gathers token rows and applies SwiGLU in its epilogue, the down GEMM scales each row by its
    router weight.
Tile sizes are autotuned per bucket of rows (CUDA-graph timing), as for the W4A4 kernels.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.gemm_common import (
    EVEN_K_HEURISTICS,
    as_int16,
    bench_in_graph,
    expert_tile,
    expert_weight_rows,
    grouped_output,
    grouped_store,
    m_bucket,
    prune_to_bucket,
    store_tile,
    tile_rows,
)

E4M3_MAX = 448.0
# K elements the FP8 MMA sums in its own precision before they join the fp32 accumulator
PROMOTE_K = 128
# the layers' dense GEMM quantizes x itself up to this many rows (one launch, not two)
FUSE_MAX_ROWS = 16
_MAX = tl.constexpr(E4M3_MAX)
_PROMOTE_K = tl.constexpr(PROMOTE_K)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------ the row-wise quantizer
@triton.jit
def _to_e4m3(value, GPU: tl.constexpr):
    """fp32 values in [-448, 448] -> float8e4nv, nearest-even, as torch's .to(float8_e4m3fn). GPU:
    the hardware conversion (cvt.rn.satfinite). The interpreter's own cast rounds ties away from
    zero and truncates subnormals, so there the value is first put on the E4M3 grid in fp32
    (the cast is then exact): a normal value keeps 3 mantissa bits (integer rounding of its bit
    pattern; a carry runs into the exponent, as it should), a subnormal one (below 2^-6) becomes a
    multiple of 2^-9 (adding and subtracting 1.5 * 2^23 rounds |v| * 2^9 to an integer, ties to
    even), its sign put back so that -0.0 stays -0.0; a NaN becomes 0x7F, as torch's."""
    if GPU:
        return value.to(tl.float8e4nv)
    bits = value.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(value) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    subnormal = tl.where(bits < 0, -magnitude, magnitude)
    on_grid = tl.where(tl.abs(value) < 0.015625, subnormal, normal)
    byte = on_grid.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(value == value, byte, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _row_scale(amax):
    """fp8.quantize_rowwise's scale: amax / 448 (IEEE division, as torch's), 1.0 for an all-zero row
    (and, as torch's `amax > 0` test has it, for a row holding a NaN)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, _MAX), 1.0)


@triton.jit
def _quantize_tile(x, scale, GPU: tl.constexpr):
    """x (R, C) fp32 and its rows' scales (R,) -> E4M3 codes: x / scale (IEEE division), clamped to
    +-448 (a NaN stays NaN, as torch's clamp keeps it), rounded."""
    value = tl.math.div_rn(x, scale[:, None])
    value = tl.minimum(
        tl.maximum(value, -_MAX, propagate_nan=tl.PropagateNan.ALL),
        _MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    return _to_e4m3(value, GPU)


@triton.jit
def _rows_amax(x_ptr, rows, row_mask, stride_x, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """max |x| of each of ROWS rows over all K columns -> (ROWS,) fp32. Taken on the bit patterns of
    |x| as integers (their order is the magnitudes' for non-negative floats, with NaN above Inf), so
    that a NaN wins as in torch's amax, on the GPU and in the interpreter alike."""
    running = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + cols[None, :],
            mask=row_mask[:, None] & (cols < K)[None, :],
            other=0.0,
        )
        running = tl.maximum(running, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    return tl.max(running, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kernel(
    # pointers: the input, its codes and its row scales
    x_ptr,
    codes_ptr,
    scale_ptr,
    # sizes and strides (elements)
    M,
    K,
    stride_x,
    stride_codes,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GPU: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    scale = _row_scale(_rows_amax(x_ptr, rows, row_mask, stride_x, K, ROWS, BLOCK_K))
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    for k0 in range(0, K, BLOCK_K):  # the second read of the rows comes from L1 / L2
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        tl.store(
            codes_ptr + rows[:, None] * stride_codes + cols[None, :],
            _quantize_tile(x, scale, GPU),
            mask=mask,
        )


# ------------------------------------------------------------------ the GEMMs' main loop
@triton.jit
def _x_tile(
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
        tile = _quantize_tile(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), x_scale, GPU)
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _mainloop(
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
        x = _x_tile(x_ptr, x_rows, row_mask, stride_x, x_scale, cols, K, FUSED, GPU, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
    return acc


# ------------------------------------------------------------------ autotuning
# (BLOCK_M token rows, BLOCK_N weight rows, BLOCK_K, warps, stages, SPLIT_K) per M bucket. Decode
# buckets stream the weight: few token rows, long contiguous runs per weight row (BLOCK_K bytes),
# and enough (N tile, K split) programs to keep every SM's loads in flight (k/v_proj's 512 rows are
# 8 tiles of 64: splits of 8); prefill tiles are square-ish for the tensor cores. All compile for
# sm_90 with Triton 3.6 without spilling (ptxas), but for the fused variant of (128, 64, 128)
# (a few registers). Under the interpreter one small configuration per bucket, splitting K in the
# decode buckets so that tests run the split-K epilogue.
DENSE_CONFIGS = {
    16: [
        (16, 64, 256, 4, 4, 2),
        (16, 64, 256, 4, 3, 4),
        (16, 128, 256, 4, 3, 2),
        (16, 64, 128, 4, 4, 4),
        (16, 64, 128, 4, 3, 8),
    ],
    64: [
        (32, 64, 256, 4, 3, 2),
        (64, 64, 256, 4, 3, 2),
        (64, 128, 128, 4, 4, 1),
        (32, 128, 256, 8, 3, 1),
        (64, 64, 128, 4, 4, 4),
        (64, 64, 128, 4, 3, 8),
    ],
    256: [
        (64, 128, 128, 4, 4, 1),
        (128, 128, 128, 8, 3, 1),
        (64, 64, 256, 4, 3, 2),
        (128, 64, 128, 4, 4, 1),
    ],
    4096: [
        (128, 128, 128, 8, 3, 1),
        (128, 128, 128, 8, 4, 1),
        (64, 128, 128, 4, 4, 1),
        (128, 64, 128, 4, 4, 1),
    ],
}
# The experts: buckets of rows an expert (the mean); BLOCK_N counts output columns, so that the
# gate/up GEMM's SwiGLU tile stacks 2 * BLOCK_N weight rows. BLOCK_N >= 64: the down GEMM's weight
# tile fills the wgmma's 64 rows (with fewer, Triton 3.6 falls back to fp16 mma.sync on sm_90). No
# split-K: the experts give the stream programs enough. Tiles of 128 x 128 spill at 8 warps
# (ptxas, sm_90): not in the table.
GROUPED_CONFIGS = {
    4: [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 8, 3), (16, 64, 128, 4, 3)],
    16: [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (16, 128, 128, 8, 3)],
    64: [(32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 8, 3)],
    4096: [(64, 128, 128, 8, 3), (128, 64, 128, 8, 3), (64, 64, 128, 4, 4)],
}
INTERPRETER_CONFIGS = {
    bucket: [(16, 32, 64, 4, 1, 2 if bucket <= 64 else 1)] for bucket in DENSE_CONFIGS
}


def _configs(table):
    """The autotuner's configurations of a table (the interpreter's own under
    TRITON_INTERPRET=1)."""
    configs = []
    for bucket, entries in table.items():
        if INTERPRET:
            entries = INTERPRETER_CONFIGS[m_bucket(bucket, INTERPRETER_CONFIGS)][:1]
        for bm, bn, bk, warps, stages, *split_k in entries:
            kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BUCKET": bucket}
            if table is DENSE_CONFIGS:
                kwargs["SPLIT_K"] = split_k[0]
            configs.append(triton.Config(kwargs, num_warps=warps, num_stages=stages))
    return configs


# ------------------------------------------------------------------ the dense GEMM
# Reference: fp8.linear_reference (FUSED: on fp8.quantize_rowwise's codes of x).
@triton.autotune(
    configs=_configs(DENSE_CONFIGS),
    key=["M_BUCKET", "N", "K", "FUSED"],
    prune_configs_by={"early_config_prune": prune_to_bucket},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit(do_not_specialize=["M"])
def dense_kernel(
    # pointers: x's codes and row scales, or (FUSED) x itself; the weight's codes and row scales; y;
    # split-K: partial tiles and per-tile arrival counters
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    y_ptr,
    workspace_ptr,
    counter_ptr,
    # sizes (M_BUCKET: the autotuning key)
    M,
    N,
    K,
    M_BUCKET,
    # strides (elements)
    stride_x,
    stride_w,
    stride_y,
    # meta-parameters
    FUSED: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # N tiles vary fastest: programs running together share the activation rows and stream disjoint
    # weight rows
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    cols = ((pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    # the quantizer's first pass, for this program's rows (every split needs the whole row's amax)
    if FUSED:
        AMAX_K: tl.constexpr = 8192 // BLOCK_M
        x_scale = _row_scale(_rows_amax(x_ptr, rows, row_mask, stride_x, K, BLOCK_M, AMAX_K))
    else:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = _mainloop(
        x_ptr,
        rows,
        row_mask,
        stride_x,
        x_scale,
        w_ptr,
        cols,
        col_mask,
        stride_w,
        k_begin,
        k_end,
        K,
        FUSED,
        GPU,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
    )
    scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[:, None] * x_scale[None, :]
    if SPLIT_K == 1:
        store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, acc * scale, OUT_BF16)
    else:
        # each split stores its partial tile; the last to arrive (an acq_rel counter per tile) adds
        # the SPLIT_K partials in a fixed order (deterministic), resets the counter and stores y
        tile: tl.constexpr = BLOCK_N * BLOCK_M
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        part_ptr = workspace_ptr + pid.to(tl.int64) * (SPLIT_K * tile) + offs
        tl.store(part_ptr + pid_k * tile, acc)
        tl.debug_barrier()  # all partials issued
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        tl.debug_barrier()
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(part_ptr + split * tile, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + pid, 0)  # ready for the next call
            store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, total * scale, OUT_BF16)


# ------------------------------------------------------------------ the experts' grouped GEMM
# Reference: fp8.grouped_linear_reference.
@triton.autotune(
    configs=_configs(GROUPED_CONFIGS),
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": prune_to_bucket},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit
def grouped_kernel(
    # pointers: x's codes and row scales; the sorted rows' x rows (row_ids), router weights and
    # where each sorted row's weight is (weight_ids, routing.order); the experts' codes and row
    # scales; rows per expert; y
    x_ptr,
    x_scale_ptr,
    row_ids_ptr,
    row_weights_ptr,
    weight_ids_ptr,
    w_ptr,
    w_scale_ptr,
    counts_ptr,
    y_ptr,
    # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
    N,
    K,
    E,
    M_BUCKET,
    # strides (elements): x rows; weight (expert, row); scales (expert); y rows
    stride_x,
    stride_we,
    stride_w,
    stride_se,
    stride_y,
    # meta-parameters
    GATHER: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert, row0, end_row = expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
        return
    sorted_rows, row_mask, x_rows, weight_rows = tile_rows(
        row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER, WEIGHT_IDS, BLOCK_M
    )
    x_rows = x_rows.to(tl.int64)
    n_out = N // 2 if SWIGLU else N
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    w_rows, w_mask = expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
    expert = expert.to(tl.int64)
    x_scale = tl.load(x_scale_ptr + x_rows, mask=row_mask, other=1.0)
    acc = _mainloop(
        x_ptr,
        x_rows,
        row_mask,
        stride_x,
        x_scale,
        w_ptr + expert * stride_we,
        w_rows,
        w_mask,
        stride_w,
        0,
        K,
        K,
        False,
        GPU,
        BLOCK_M,
        W_ROWS,
        BLOCK_K,
        EVEN_K,
    )
    w_scale = tl.load(w_scale_ptr + expert * stride_se + w_rows, mask=w_mask, other=0.0)
    grouped_store(
        acc,
        w_scale[:, None] * x_scale[None, :],
        y_ptr,
        row_weights_ptr,
        weight_rows,
        sorted_rows,
        row_mask,
        pid_n,
        n_out,
        stride_y,
        ROW_WEIGHTS,
        SWIGLU,
        OUT_BF16,
        BLOCK_M,
        BLOCK_N,
    )


# ------------------------------------------------------------------ input checks (one line each)
def _check(ok, message):
    if not ok:
        raise ValueError(message)


def _described(t):
    """What a bad argument was, for its error message: (dtype, shape) of a tensor, else its type."""
    return (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t)


def _rows(name, x, dtypes, what):
    """x checked to be a 2-D tensor of one of `dtypes`, with unit stride along its last dim
    (a copy if not)."""
    _check(
        isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in dtypes,
        f"w8a8: {name} must be a 2-D {what} tensor, got "
        f"{(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__}",
    )
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _check_weight(w_codes, w_scale, K, device, experts=False):
    shape = "(E, N, K)" if experts else "(N, K)"
    _check(
        isinstance(w_codes, torch.Tensor)
        and w_codes.dtype == torch.float8_e4m3fn
        and w_codes.dim() == 2 + experts
        and w_codes.is_contiguous(),
        f"w8a8: w_codes must be a contiguous {shape} float8_e4m3fn tensor, got "
        f"{_described(w_codes)}",
    )
    _check(w_codes.shape[-1] == K, f"w8a8: w_codes has K={w_codes.shape[-1]}, the activation K={K}")
    _check(
        isinstance(w_scale, torch.Tensor)
        and w_scale.dtype == torch.float32
        and tuple(w_scale.shape) == tuple(w_codes.shape[:-1])
        and w_scale.is_contiguous(),
        f"w8a8: w_scale must be contiguous fp32 of shape {tuple(w_codes.shape[:-1])}, got "
        f"{_described(w_scale)}",
    )
    _check(
        w_codes.device == device and w_scale.device == device,
        f"w8a8: the weight is on {w_codes.device}, its scales on {w_scale.device}, "
        f"the activation on {device}",
    )


def _check_scale(x_scale, M, device):
    _check(
        isinstance(x_scale, torch.Tensor)
        and x_scale.dtype == torch.float32
        and x_scale.numel() == M
        and x_scale.is_contiguous()
        and x_scale.device == device,
        f"w8a8: x_scale must be {M} contiguous fp32 row scales on {device}, got "
        f"{_described(x_scale)}",
    )


def _check_out_dtype(out_dtype):
    _check(
        out_dtype in _FLOATS, f"w8a8: out_dtype must be bfloat16/float16/float32, got {out_dtype}"
    )


# ------------------------------------------------------------------ launches
def quantize_rows(x):
    """x (M, K) bf16/fp16/fp32 -> (codes (M, K) float8_e4m3fn, scale (M, 1) fp32):
    fp8.quantize_rowwise, bit for bit, in one launch."""
    x = _rows("x", x, _FLOATS, "bfloat16/float16/float32")
    M, K = x.shape
    codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return codes, scale
    block_k = min(triton.next_power_of_2(max(K, 16)), 2048)
    # about 4096 elements a program, but two programs an SM at least, for short latency
    rows = max(1, min(8, 4096 // block_k))
    while rows > 1 and triton.cdiv(M, rows) < 264:
        rows //= 2
    quantize_kernel[(triton.cdiv(M, rows),)](
        x, codes, scale, M, K, x.stride(0), K, ROWS=rows, BLOCK_K=block_k, GPU=not INTERPRET
    )
    return codes, scale


SPLIT_COUNTERS = {}


def _split_k_buffers(M, N, bucket, device):
    """Scratch for split-K partial tiles (written before read: no init) and the per-tile arrival
    counters (zero, reset to zero by the kernel itself: kept per device). Counters are shared by all
    calls, so split-K launches must not run concurrently on two streams."""
    configs = INTERPRETER_CONFIGS if INTERPRET else DENSE_CONFIGS
    splits = [
        (bm, bn, split)
        for bm, bn, _, _, _, split in configs[m_bucket(bucket, configs)]
        if split > 1
    ]
    if not splits:
        return (
            torch.empty(1, dtype=torch.float32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
    size = max(
        split * triton.cdiv(M, bm) * bm * triton.cdiv(N, bn) * bn for bm, bn, split in splits
    )
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for bm, bn, _ in splits)
    counters = SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = SPLIT_COUNTERS[device] = torch.zeros(
            max(tiles, 4096), dtype=torch.int32, device=device
        )
    return torch.empty(size, dtype=torch.float32, device=device), counters


def _dense(x, x_scale, w_codes, w_scale, out_dtype, fused):
    M, K = x.shape
    N = w_codes.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    bucket = m_bucket(M, DENSE_CONFIGS)
    workspace, counters = _split_k_buffers(M, N, bucket, x.device)

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"]

    dense_kernel[grid](
        x,
        x_scale,
        w_codes,
        w_scale,
        as_int16(y),
        workspace,
        counters,
        M,
        N,
        K,
        bucket,
        x.stride(0),
        K,
        N,
        FUSED=fused,
        OUT_BF16=out_dtype == torch.bfloat16,
        GPU=not INTERPRET,
    )
    return y


def linear_codes(x_codes, x_scale, w_codes, w_scale, out_dtype=torch.bfloat16):
    """The dense GEMM on a quantized activation: x_codes (M, K) float8_e4m3fn and x_scale (M, 1)
    fp32 (quantize_rows), w_codes (N, K) float8_e4m3fn and w_scale (N,) fp32 (fp8.quantize_weight)
    -> y (M, N) out_dtype."""
    x_codes = _rows("x_codes", x_codes, (torch.float8_e4m3fn,), "float8_e4m3fn")
    _check_scale(x_scale, x_codes.shape[0], x_codes.device)
    _check_weight(w_codes, w_scale, x_codes.shape[1], x_codes.device)
    _check_out_dtype(out_dtype)
    return _dense(x_codes, x_scale, w_codes, w_scale, out_dtype, False)


def linear(x, w_codes, w_scale, fused=None, out_dtype=torch.bfloat16):
    """The W8A8 layer: x (M, K) bf16/fp16/fp32 quantized per row, times
    (w_codes * w_scale[:, None]).T -> (M, N) out_dtype. fused: the GEMM quantizes x itself, one
    launch (None: up to FUSE_MAX_ROWS rows); else the quantizer runs first. Either way the codes are
    fp8.quantize_rowwise's."""
    x = _rows("x", x, _FLOATS, "bfloat16/float16/float32")
    _check_weight(w_codes, w_scale, x.shape[1], x.device)
    _check_out_dtype(out_dtype)
    if x.shape[0] <= FUSE_MAX_ROWS if fused is None else fused:
        return _dense(x, w_scale, w_codes, w_scale, out_dtype, True)  # (x_scale: unread)
    return _dense(*quantize_rows(x), w_codes, w_scale, out_dtype, False)


def grouped_linear(
    x_codes,
    x_scale,
    w_codes,
    w_scale,
    counts,
    row_ids=None,
    row_weights=None,
    row_weight_ids=None,
    swiglu=False,
    out_dtype=torch.bfloat16,
):
    """The experts' GEMM, one launch, no host sync: rows (x_codes' own, or x_codes[row_ids]) grouped
    by expert, counts (E,) int64 rows each, times expert e's weight w_codes[e] (E, N, K)
    float8_e4m3fn with row scales w_scale (E, N) fp32; x_scale (rows of x_codes, 1) fp32. swiglu:
    the weight rows are [gate; up] and the output is silu(gate) * up. Output row r is scaled by
    row_weights[r], or row_weights[row_weight_ids[r]]. -> y (rows, N or N/2) out_dtype. Reference:
    fp8.grouped_linear_reference."""
    x_codes = _rows("x_codes", x_codes, (torch.float8_e4m3fn,), "float8_e4m3fn")
    device = x_codes.device
    _check_scale(x_scale, x_codes.shape[0], device)
    _check_weight(w_codes, w_scale, x_codes.shape[1], device, experts=True)
    _check_out_dtype(out_dtype)
    E, N, K = w_codes.shape
    _check(
        isinstance(counts, torch.Tensor)
        and counts.shape == (E,)
        and counts.device == device
        and not counts.is_floating_point(),
        f"w8a8: counts must be an integer tensor of shape ({E},) on {device}, got "
        f"{_described(counts)}",
    )
    _check(not swiglu or N % 2 == 0, f"w8a8: swiglu needs an even number of weight rows, got N={N}")
    n_rows = row_ids.numel() if row_ids is not None else x_codes.shape[0]
    if row_weight_ids is not None:
        _check(
            row_weights is not None and row_weight_ids.shape == (n_rows,),
            f"w8a8: row_weight_ids must index row_weights with one id per row ({n_rows},)",
        )
    elif row_weights is not None:
        _check(
            row_weights.shape == (n_rows,),
            f"w8a8: row_weights must hold one weight per row ({n_rows},), "
            f"got {tuple(row_weights.shape)}",
        )
    y, flags, (row_ids, row_weights, row_weight_ids) = grouped_output(
        n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu
    )
    if n_rows == 0:
        return y
    n_out = y.shape[1]

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_M): no host sync
        row_tiles = triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows)
        return row_tiles, triton.cdiv(n_out, meta["BLOCK_N"])

    grouped_kernel[grid](
        x_codes,
        x_scale,
        row_ids,
        row_weights,
        row_weight_ids,
        w_codes,
        w_scale,
        counts,
        as_int16(y),
        N,
        K,
        E,
        m_bucket(triton.cdiv(n_rows, E), GROUPED_CONFIGS),
        x_codes.stride(0),
        N * K,
        K,
        N,
        y.stride(0),
        OUT_BF16=out_dtype == torch.bfloat16,
        GPU=not INTERPRET,
        **flags,
    )
    return y
