"""The W4A4 dense GEMM for Hopper (and sm_89): y = x @ W.T with NVFP4 weights and the quantizer's
fp16 activation operand (gpu_kernels/w4a4_quantize.py). It equals rac.matmul_reference up to fp32
accumulation order (and, with a RAC residual, the fp16 rounding of x + r the operand makes); the
prefill weight pass equals the definition of that fp16 operand (value * block scale * 2^-6) bit for
bit.

The weight is decoded in registers (Hopper has no FP4 tensor cores) and multiplied with the operand
by w4a4_common.py's main loop, whose docstring derives the decode:

    y = (W_tile @ X_tile.T) * 2^12 * g_x * g_w     fp32 accumulation
    W_tile = value * s * 2^-6                      the weight tile, exact in fp16
    X_tile = the operand's tile

Variants, each chosen per call or by the autotuner:
  - y.T = W @ x.T: the weight rows on the MMA's wide side (the experts' kernel may also take
    y = x @ W.T).
  - Split-K (decode): each of SPLIT_K programs stores a partial tile, the last to arrive (an atomic
    counter per tile) sums them in a fixed order: deterministic. Gives the weight stream enough
    programs.
  - Prefill (M >= PREFILL_ROWS): one pass decodes the weight to fp16 planes first, then both
    operands stream through shared memory; decoding in registers would repeat M / BLOCK_M times.
  - Stacked weights: up to three weights (q/k/v_proj) along N, each with its own global scale on its
    columns and its output stored as its own (M, N_i) tensor.
  - Per-row x scales (the quantizer's row_scale): g_x one per operand row, read in the epilogue,
    where (2^12 g_x) g_w is formed in the order of the one-scale product: equal scales give equal
    bits.
The experts' kernel (w4a4_experts.py) shares the main loop and the autotuning configurations.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.gemm_common import (
    EVEN_K_HEURISTICS,
    as_int16,
    bench_in_graph,
    column_splits,
    m_bucket,
    prune_to_bucket,
    split_columns,
    split_output,
    store_split,
)
from gpu_kernels.w4a4_common import (
    EPILOGUE,
    INTERPRETER_CONFIGS,
    autotune_configs,
    empty_planes,
    mainloop,
    weight_tile,
    x_scale_is_per_row,
)

PREFILL_ROWS = 257  # from this many rows on, the weight is decoded once per call


# ------------------------------------------------------------------ the prefill weight pass
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
    """Prefill: NVFP4 (N, K) -> fp16 planes (2, N, K/2), once a call; exact: values fit fp16."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    even, odd = weight_tile(
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
# Rows as w4a4_common.autotune_configs reads them: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages,
# SPLIT_K) per M bucket. Decode buckets stream the weight: small BLOCK_M, wide BLOCK_K (long
# contiguous byte runs per row), and enough (N tile, K split) programs to keep every SM's loads in
# flight. The weight is the MMA's left operand only (no X_FIRST): X_FIRST gained nothing here on the
# H200, 0.96-1.01x at 256 rows.
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


# ------------------------------------------------------------------ the dense GEMM
# Reference: rac.matmul_reference (on the quantizer's operand).
# ROW_SCALE is left out of the autotuning key: both modes run the configuration tuned first (they
# differ in the epilogue's loads alone), so that equal scales give equal bits.
@triton.autotune(
    configs=autotune_configs(DENSE_CONFIGS, x_first=False),
    key=["M_BUCKET", "N", "K", "W_FP16"],
    prune_configs_by={"early_config_prune": prune_to_bucket},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit(do_not_specialize=["M"])
def dense_kernel(
    # pointers: the operand planes and their global scale (one, or one per row: ROW_SCALE); split-K:
    # partial tiles and per-tile arrival counters
    x_ptr,
    x_global_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    y_ptr,
    workspace_ptr,
    counter_ptr,
    # sizes (M_BUCKET: the autotuning key; *_plane: elements in one operand plane; the columns from
    # N1 on take the second weight global scale, from N2 on the third: stacked q/k/v weights)
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
    acc = mainloop(
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
    which, col_base, col_stride = split_columns(cols, M, N, N1, N2)
    w_global = tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[:, None]
    if ROW_SCALE:
        # each row's own x scale, multiplied in the order of the one scale's: (2^12 g_x) g_w
        x_global = tl.load(x_global_ptr + rows, mask=rows < M, other=0.0)[None, :]
        scale = EPILOGUE * x_global * w_global
    else:
        scale = EPILOGUE * tl.load(x_global_ptr) * w_global
    if SPLIT_K == 1:
        store_split(y_ptr, rows, rows < M, col_base, col_stride, col_mask, acc * scale, OUT_BF16)
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
            store_split(
                y_ptr, rows, rows < M, col_base, col_stride, col_mask, total * scale, OUT_BF16
            )


# ------------------------------------------------------------------ launch
SPLIT_COUNTERS = {}


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
    counters = SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = SPLIT_COUNTERS[device] = torch.zeros(
            max(tiles, 4096), dtype=torch.int32, device=device
        )
    return torch.empty(size, dtype=torch.float32, device=device), counters


def weight_operand(w_data, w_block_scale):
    """Prefill: NVFP4 codes (N, K/2) and E4M3 scales (N, K/16) -> fp16 planes (2, N, K/2)."""
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
    """y = x @ W.T: operand (2, M, K/2) fp16 and x_global_scale () or (M,) fp32 (per row) from the
    quantizer (a W4A16 operand too); the weight's codes (N, K/2) uint8, block scales (N, K/16) E4M3
    and global scales (1 to 3,) fp32 -> (M, N) out_dtype, or with splits (the row counts of up to
    three stacked weights, one global scale each) one contiguous (M, n) tensor per weight. prefill:
    decode the weight to fp16 once first (None: from PREFILL_ROWS rows on)."""
    M = operand.shape[1]
    row_scale = x_scale_is_per_row(x_global_scale, M, "dense_matmul")
    N, K = w_data.shape[0], w_data.shape[1] * 2
    device = w_data.device
    # with splits: each weight's (M, n) after another
    y = torch.empty(M * N, dtype=out_dtype, device=device)
    w_data, w_scale = w_data.contiguous(), w_block_scale.contiguous().view(torch.uint8)
    w_fp16 = M >= PREFILL_ROWS if prefill is None else prefill
    w_ptr, stride_w, w_plane = w_data, w_data.stride(0), 0
    if w_fp16:
        w_operand = weight_operand(w_data, w_scale)
        w_ptr, stride_w, w_plane = w_operand, K // 2, w_operand.stride(0)
    bucket = m_bucket(M, DENSE_CONFIGS)
    workspace, counters = _split_k_buffers(M, N, bucket, device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    dense_kernel[grid](
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
