"""The W4A4 dense GEMM for Hopper (and sm_89): y = x @ W.T with NVFP4 weights and the quantizer's fp16
activation operand (gpu_kernels/w4a4_quantize.py). It equals rac.matmul_reference up to fp32 accumulation order
(and, with a RAC residual, the fp16 rounding of x + r the operand makes); the prefill weight pass equals
the definition of that fp16 operand (value * block scale * 2^-6) bit for bit.

Hopper has no FP4 tensor cores and `tl.dot_scaled` does not compile for sm_90, so the weight is decoded in
registers. An E2M1 code c put in an E4M3 byte as (c & 7) << 2 | (c & 8) << 4 *is* c's value times 2^-6, and
the hardware E4M3 -> fp16 conversion times the block scale s gives

    W_tile = value * s * 2^-6        exact in fp16 (<= 6 significant bits)
    X_tile = (DQ(x_q) + DQ(r_q)) / g_x * 2^-6          the quantizer's operand (W4A16: x / g_x * 2^-6)
    y      = (W_tile @ X_tile.T) * 2^12 * g_x * g_w    fp32 accumulation; scales in the epilogue

A weight byte holds elements 2i and 2i+1, so K is consumed as an even and an odd half: two products per K
step, no shuffles. Variants, each chosen per call or by the autotuner:
  - y.T = W @ x.T: the weight rows on the MMA's wide side (the experts' kernel may also take y = x @ W.T).
  - Split-K (decode): each of SPLIT_K programs stores a partial tile, the last to arrive (an atomic counter
    per tile) sums them in a fixed order: deterministic. Gives the weight stream enough programs.
  - Prefill (M >= PREFILL_ROWS): one pass decodes the weight to fp16 planes first, then both operands
    stream through shared memory; decoding in registers would repeat M / BLOCK_M times.
  - Stacked weights: up to three weights (q/k/v_proj) along N, each with its own global scale on its
    columns and its output stored as its own (M, N_i) tensor.
  - Per-row x scales (the quantizer's row_scale): g_x one per operand row, read in the epilogue, where
    (2^12 g_x) g_w is formed in the order of the one-scale product: equal scales give equal bits.
The experts' kernels (w4a4_experts.py) reuse the building blocks here.
"""

import itertools

import torch
import triton
import triton.language as tl

from gpu_kernels.expert_layout import EXPERT_ROW_BLOCK
from gpu_kernels.nvfp4_quantize import _to_bf16_bits
from gpu_kernels.w4a4_quantize import INTERPRET, OPERAND_SHIFT, empty_planes

PREFILL_ROWS = 257  # from this many rows on, the weight is decoded once per call
_EPILOGUE = tl.constexpr(OPERAND_SHIFT**-2)  # 2^12: undoes the two operands' 2^-6
EXPERT_ROWS = tl.constexpr(EXPERT_ROW_BLOCK)

# Packed E2M1 codes -> fp16 x 2^-6 (even and odd nibbles), 4 bytes an invocation: shared by the Triton and
# the Gluon kernels (_e2m1_pairs_to_fp16 says how it works).
_E2M1_PAIRS_PTX = tl.constexpr("""
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
    two bytes per instruction; elementwise, so however Triton groups 4 bytes the result is the same."""
    if GPU:
        even, odd = tl.inline_asm_elementwise(
            asm=_E2M1_PAIRS_PTX,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        even = (
            (((packed & 7) << 2) | ((packed & 8) << 4))
            .to(tl.float8e4nv, bitcast=True)
            .to(tl.float16)
        )
        odd = (
            (((packed >> 2) & 0x1C) | (packed & 0x80))
            .to(tl.float8e4nv, bitcast=True)
            .to(tl.float16)
        )
    return even, odd


@triton.jit
def _weight_tile(
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
    """_weight_tile's codes (ROWS, BLOCK_K/2) and E4M3 scale bytes (ROWS, BLOCK_K/16), as loaded."""
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
    """_weight_bytes' codes and scale bytes -> _weight_tile's even and odd fp16 tiles."""
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
    """Columns k0..k0+BLOCK_K of fp16 operand planes (2, rows, K/2) as (rows, BLOCK_K/2) even and odd
    tiles."""
    cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_row + cols
    mask = row_mask[:, None] & (cols < K // 2)
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + plane_size, mask=mask, other=0.0)


@triton.jit
def _mainloop(
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
    """acc (BLOCK_N, BLOCK_M) = W[cols] @ X[x_rows].T over columns k_begin..k_end, in fp32, without the
    global scales and 2^12. X: fp16 operand planes; W: NVFP4 codes, or fp16 operand planes (W_FP16).
    X_FIRST: X is the MMA's left operand (M side) and the weight its right one, whose staged codes
    Triton decodes straight into mma.sync's operand registers; fewer instructions per weight element
    than the weight on the left, whose wgmma register layout makes Triton read the codes two bytes at
    a time (seen in the SASS). CHUNK: W in ExpertWeights' layout (_weight_tile)."""
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
            w_even, w_odd = _weight_tile(
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


@triton.jit
def _store_at(y_ptr, offs, mask, value, OUT_BF16: tl.constexpr):
    """Store fp32 values at element offsets of y. BF16 rounds to nearest-even by integer arithmetic
    through an int16 view of y (the interpreter's own cast truncates)."""
    if OUT_BF16:
        tl.store(y_ptr + offs, _to_bf16_bits(value).to(tl.int16), mask=mask)
    else:
        tl.store(y_ptr + offs, value.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, value, OUT_BF16: tl.constexpr):
    """Store a (cols, rows) tile of fp32 values into y (M, N)."""
    offs = rows[None, :].to(tl.int64) * stride_y + cols[:, None]
    _store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)


@triton.jit
def _split_columns(cols, M, N, N1, N2):
    """Up to three weights stacked along N, split at columns N1 and N2 (N1 = N2 = N: one weight).
    Their outputs lie one after another in y, each (M, its N) row-major. -> per column (cols,): which
    weight (its global scale's index), y's offset of its row 0, and the row stride."""
    which = (cols >= N1).to(tl.int32) + (cols >= N2).to(tl.int32)
    start = tl.where(which == 0, 0, tl.where(which == 1, N1, N2)).to(tl.int64)
    end = tl.where(which == 0, N1, tl.where(which == 1, N2, N)).to(tl.int64)
    return which, M * start + cols - start, end - start


@triton.jit
def _store_split(
    y_ptr, rows, row_mask, col_base, col_stride, col_mask, value, OUT_BF16: tl.constexpr
):
    """Store a (cols, rows) tile at _split_columns' offsets."""
    offs = rows[None, :].to(tl.int64) * col_stride[:, None] + col_base[:, None]
    _store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)


@triton.jit
def _weight_operand_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    stride_data,
    stride_scale,
    plane_size,
    GPU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Prefill: NVFP4 (N, K) -> fp16 planes (2, N, K/2), once per call. Exact: each value fits fp16."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    even, odd = _weight_tile(
        data_ptr,
        scale_ptr,
        rows,
        row_mask,
        k0,
        K,
        stride_data,
        stride_scale,
        ROWS,
        BLOCK_K,
        False,
        GPU,
    )
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs = rows[:, None].to(tl.int64) * (K // 2) + cols[None, :]
    mask = row_mask[:, None] & (cols < K // 2)[None, :]
    tl.store(out_ptr + offs, even, mask=mask)
    tl.store(out_ptr + plane_size + offs, odd, mask=mask)


# ------------------------------------------------------------------ autotuning
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K[, X_FIRST[, maxnreg]]) per M bucket. maxnreg caps the
# registers a thread (more programs an SM, at the price of spills).
# Decode buckets stream the weight: small BLOCK_M, wide BLOCK_K (long contiguous byte runs per row),
# and enough (N tile, K split) programs to keep every SM's loads in flight. Under the interpreter one
# small configuration per bucket, splitting K in the decode buckets so tests run the split epilogue,
# and X_FIRST in two buckets so tests run both operand orders of the experts' kernel (the dense kernel has
# the weight-first order only: X_FIRST gained nothing there on the H200, 0.96-1.01x at 256 rows).
DENSE_CONFIGS = {
    16: [
        (16, 64, 256, 4, 3, 4),
        (16, 32, 256, 4, 3, 8),
        (16, 64, 256, 4, 3, 2),
        (16, 128, 256, 8, 3, 2),
    ],
    64: [
        (32, 64, 256, 4, 3, 2),
        (64, 64, 256, 8, 3, 4),
        (32, 64, 256, 4, 3, 4),
        (32, 32, 256, 4, 3, 4),
    ],
    256: [
        (64, 128, 128, 4, 3, 2),
        (64, 64, 256, 4, 3, 1),
        (128, 64, 128, 4, 3, 1),
        (64, 64, 128, 4, 3, 2),
        (64, 64, 128, 4, 3, 1),
    ],
    4096: [(128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1)],
}
INTERPRETER_CONFIGS = {
    bucket: [(16, 32, 64, 4, 1, 2 if bucket <= 64 else 1, bucket in (16, 256))]
    for bucket in DENSE_CONFIGS
}


def _m_bucket(m, table):
    return next(b for b in table if m <= b or b == 4096)


def _configs(table, x_first=True):
    """The autotuner's configurations of a table; x_first False: without the X_FIRST key (the dense kernel)."""
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


def _prune(configs, named_args, **kwargs):
    """Keep the configs of the call's M bucket: autotuning times 2-4 candidates, not all of them."""
    return [c for c in configs if c.kwargs["BUCKET"] == named_args["M_BUCKET"]]


_HEURISTICS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0}


def _bench_in_graph(kernel_call, quantiles):
    """Autotuning times candidates as CUDA-graph replays: decode kernels run for a few microseconds,
    where eager timing is mostly launch overhead and picked poor configurations (seen on the H200)."""
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


# ------------------------------------------------------------------ the dense GEMM
# Reference: rac.matmul_reference (on the quantizer's operand).
# ROW_SCALE is left out of the autotuning key: both modes run the configuration tuned first (they differ
# in the epilogue's loads alone), so that equal scales give equal bits.
@triton.autotune(
    configs=_configs(DENSE_CONFIGS, x_first=False),
    key=["M_BUCKET", "N", "K", "W_FP16"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench_in_graph,
)
@triton.heuristics(_HEURISTICS)
@triton.jit(do_not_specialize=["M"])
def _dense_kernel(
    # pointers: the operand planes and their global scale (one, or one per row: ROW_SCALE); split-K: partial
    # tiles and per-tile arrival counters
    x_ptr,
    x_global_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    y_ptr,
    workspace_ptr,
    counter_ptr,
    # sizes (M_BUCKET: the autotuning key; *_plane: elements in one operand plane; the columns from N1
    # on take the second weight global scale, from N2 on the third: stacked q/k/v weights)
    M,
    N,
    K,
    M_BUCKET,
    x_plane,
    w_plane,
    N1,
    N2,
    # strides (operand planes and y in elements, w in bytes, scales in blocks)
    stride_x,
    stride_w,
    stride_ws,
    # meta-parameters
    W_FP16: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # N tiles vary fastest: programs running together share the activation rows and stream
    # disjoint weight rows, which is what a weight-bound decode wants.
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    row0 = (pid // n_tiles) * BLOCK_M
    cols = ((pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    rows = row0 + tl.arange(0, BLOCK_M)
    acc = _mainloop(
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
        W_FP16,
        GPU,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        rows,
        False,
    )
    which, col_base, col_stride = _split_columns(cols, M, N, N1, N2)
    w_global = tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[:, None]
    if (
        ROW_SCALE
    ):  # each row's own x scale, multiplied in the order of the one scale's: (2^12 g_x) g_w
        scale = (
            _EPILOGUE * tl.load(x_global_ptr + rows, mask=rows < M, other=0.0)[None, :] * w_global
        )
    else:
        scale = _EPILOGUE * tl.load(x_global_ptr) * w_global
    if SPLIT_K == 1:
        _store_split(y_ptr, rows, rows < M, col_base, col_stride, col_mask, acc * scale, OUT_BF16)
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
            # ready for the next call
            tl.atomic_xchg(counter_ptr + pid, 0)
            _store_split(
                y_ptr, rows, rows < M, col_base, col_stride, col_mask, total * scale, OUT_BF16
            )


# ------------------------------------------------------------------ launch
_SPLIT_COUNTERS = {}


def _split_k_buffers(M, N, bucket, device):
    """Scratch for split-K partial tiles (written before read: no init) and the per-tile arrival
    counters (zero, reset to zero by the kernel itself: kept per device). Counters are shared by all
    calls, so split-K launches must not run concurrently on two streams."""
    configs = (INTERPRETER_CONFIGS if INTERPRET else DENSE_CONFIGS)[bucket]
    splits = [(bm, bn, split) for bm, bn, _, _, _, split, *_ in configs if split > 1]
    if not splits:
        return (
            torch.empty(1, dtype=torch.float32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
    size = max(
        split * triton.cdiv(M, bm) * bm * triton.cdiv(N, bn) * bn for bm, bn, split in splits
    )
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for bm, bn, _ in splits)
    counters = _SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _SPLIT_COUNTERS[device] = torch.zeros(
            max(tiles, 4096), dtype=torch.int32, device=device
        )
    return torch.empty(size, dtype=torch.float32, device=device), counters


def as_int16(y):
    """The kernels store bf16 through an int16 view (_store_at rounds by integer arithmetic)."""
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y


def split_output(y, M, N, splits):
    """A dense kernel's flat output -> (M, N), or one contiguous (M, n) tensor per stacked weight."""
    if splits is None:
        return y.view(M, N)
    return tuple(part.view(M, n) for part, n in zip(y.split([M * n for n in splits]), splits))


def column_splits(N, splits):
    """(N1, N2) for the kernels' per-column weight global scale: N rows stacking len(splits) weights."""
    ends = list(itertools.accumulate(splits or ()))[:-1] + [
        N,
        N,
    ]  # where weights 2 and 3 begin, else N
    return ends[0], ends[1]


def weight_operand(w_data, w_block_scale):
    """The prefill pass: NVFP4 codes (N, K/2) and E4M3 scales (N, K/16) -> fp16 planes (2, N, K/2)."""
    N, K = w_data.shape[0], w_data.shape[1] * 2
    w_scale = w_block_scale.view(torch.uint8)
    out = empty_planes(N, K // 2, w_data.device)
    rows, block_k = 64, 256
    _weight_operand_kernel[(triton.cdiv(N, rows), triton.cdiv(K, block_k))](
        w_data,
        w_scale,
        out,
        N,
        K,
        w_data.stride(0),
        w_scale.stride(0),
        out.stride(0),
        GPU=not INTERPRET,
        ROWS=rows,
        BLOCK_K=block_k,
    )
    return out


def x_scale_is_per_row(x_global_scale, rows, name):
    """Is an operand's global scale one per row ((rows,) fp32), not one for all (() or (1,))? One row's
    one scale is both: the kernels then read the same value either way."""
    if x_global_scale.numel() not in (1, rows):
        raise ValueError(
            f"{name}: x_global_scale must be one scale or one per operand row ({rows},), got shape "
            f"{tuple(x_global_scale.shape)}"
        )
    return x_global_scale.numel() > 1


def dense_matmul(
    operand,
    x_global_scale,
    w_data,
    w_block_scale,
    w_global_scale,
    out_dtype,
    splits=None,
    prefill=None,
):
    """y = x @ W.T: operand (2, M, K/2) fp16 and x_global_scale () or (M,) fp32 (per row) from the quantizer
    (a W4A16 operand too); the weight's codes (N, K/2) uint8, block scales (N, K/16) E4M3 and global scales
    (1 to 3,) fp32 -> (M, N) out_dtype, or with splits (the row counts of up to three stacked weights, one
    global scale each) one contiguous (M, n) tensor per weight. prefill: decode the weight to fp16 once first
    (None: from PREFILL_ROWS rows on)."""
    M = operand.shape[1]
    row_scale = x_scale_is_per_row(x_global_scale, M, "dense_matmul")
    N, K = w_data.shape[0], w_data.shape[1] * 2
    device = w_data.device
    y = torch.empty(
        M * N, dtype=out_dtype, device=device
    )  # splits: each weight's (M, n) after another
    w_data, w_scale = w_data.contiguous(), w_block_scale.contiguous().view(torch.uint8)
    w_fp16 = M >= PREFILL_ROWS if prefill is None else prefill
    w_ptr, stride_w, w_plane = w_data, w_data.stride(0), 0
    if w_fp16:
        w_operand = weight_operand(w_data, w_scale)
        w_ptr, stride_w, w_plane = w_operand, K // 2, w_operand.stride(0)
    bucket = _m_bucket(M, DENSE_CONFIGS)
    workspace, counters = _split_k_buffers(M, N, bucket, device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    _dense_kernel[grid](
        operand,
        x_global_scale,
        w_ptr,
        w_scale,
        w_global_scale.contiguous(),
        as_int16(y),
        workspace,
        counters,
        M,
        N,
        K,
        bucket,
        operand.stride(0),
        w_plane,
        *column_splits(N, splits),
        operand.stride(1),
        stride_w,
        w_scale.stride(0),
        W_FP16=w_fp16,
        ROW_SCALE=row_scale,
        OUT_BF16=out_dtype == torch.bfloat16,
        GPU=not INTERPRET,
    )
    return split_output(y, M, N, splits)
