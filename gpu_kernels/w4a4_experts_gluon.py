"""The experts' grouped W4A4 GEMM in Gluon, for sm_89 and sm_90: the same product as
gpu_kernels/w4a4_experts.py's Triton kernel (equal outputs on the H200), and so equal to
rac.grouped_matmul_reference up to fp32 accumulation order.

Gluon is Triton's layout-explicit dialect: here it lets the weight codes be loaded straight into the
MMA's operand registers and decoded there, which Triton's own layout choice does not (it stages the
codes in shared memory, and from 8-bit codes picks operand layouts that cost 140 register moves a K
step). GPU only: Gluon does not run under the interpreter, so the CPU tests compile it for sm_90 and
the GPU tests check it against the reference.
  - mma.sync m16n8k16 with the weight rows on the left (M) and the tile's token rows on the right
    (N, in steps of 8): at 4 rows an expert (64 decode tokens) an 8-row tile pads half its MMA work,
    a 16-row one three quarters.
  - k_width 8: a thread holds 8 consecutive K elements of a row, one NVFP4 block, so its codes are
    one 8-byte load, its block scale one byte, and the decode feeds the MMA operand with no data
    movement.
  - SwiGLU: the tile's weight rows alternate 8 gate rows and their 8 up rows, so that gate and up of
    one output sit in the same thread's accumulator registers; the epilogue splits them in
    registers.
  - The experts' blocked layout (expert_layout.ExpertWeights): a program's K steps read a few
    contiguous runs.
  - Per-row x scales (ROW_SCALE): the epilogue reads each row's own, that of its gathered activation
    row (row_ids) at gate/up, of its sorted row at down, and forms (2^12 g_x) g_w in the one-scale
    order. A W4A16 operand (x / g_x * 2^-6, w4a4_quantize's quantize=False) runs as any other.
  - A tile holding at most half its rows runs as a tile of half the rows, one of 32 rows or more at
    most three quarters full as that half plus a quarter (the loop and epilogue are compiled for
    each size): at 16 rows an expert most 32-row tiles skip 8 or 16 padding rows' MMAs and
    activation loads.
No shared memory and no software pipeline: programs a multiprocessor (registers allow 3-4) hide the
load latency. A cp.async pipeline of 3-6 stages, a one-step register prefetch, and wgmma in place of
mma.sync (the activation tile in shared memory once per warpgroup) were all no faster.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gpu_kernels.expert_layout import expert_shape
from gpu_kernels.gemm_common import bench_in_graph, grouped_output, m_bucket
from gpu_kernels.w4a4_common import EPILOGUE, EXPERT_ROWS, E2M1_PAIRS_PTX, x_scale_is_per_row


@gluon.constexpr_function
def _gluon_mma_layout(num_warps):
    """mma.sync m16n8k16's accumulator layout, the warps stacked along the weight rows
    (the MMA's M)."""
    return gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8]
    )


@gluon.jit
def _gluon_e2m1_pairs(packed):
    return gl.inline_asm_elementwise(
        E2M1_PAIRS_PTX,
        "=r,=r,=r,=r,r",
        [packed],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _gluon_add(a, b):
    return a + b


@gluon.jit
def _gluon_expert_tile(
    counts_ptr, E, pid_m, BLOCK_T: gl.constexpr, E_POW2: gl.constexpr, NUM_WARPS: gl.constexpr
):
    """expert_tile in Gluon: program pid_m's (expert, first sorted row, end row of the expert)."""
    experts = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
    counts = gl.load(counts_ptr + experts, mask=experts < E, other=0).to(gl.int64)
    packed = (((counts + BLOCK_T - 1) // BLOCK_T) << 32) + counts
    ends = gl.associative_scan(packed, 0, _gluon_add)  # (tile end << 32) + row end
    expert = gl.sum(((ends >> 32) <= pid_m).to(gl.int32), axis=0)
    start = gl.sum(gl.where(experts == expert, ends - packed, 0), axis=0)
    first_tile = start >> 32
    first_row = (start - (first_tile << 32)).to(gl.int32)
    rows = gl.sum(gl.where(experts == expert, counts, 0), axis=0).to(gl.int32)
    return expert, first_row + (pid_m - first_tile.to(gl.int32)) * BLOCK_T, first_row + rows


@gluon.jit
def _gluon_gate_up(t, W_ROWS: gl.constexpr, BLOCK_T: gl.constexpr):
    """A (W_ROWS, T) tile whose rows alternate 8 gate and 8 up rows -> gate, up: (W_ROWS / 2, T)
    each."""
    gate, up = gl.split(gl.permute(gl.reshape(t, (W_ROWS // 16, 2, 8, BLOCK_T)), (0, 2, 3, 1)))
    return gl.reshape(gate, (W_ROWS // 2, BLOCK_T)), gl.reshape(up, (W_ROWS // 2, BLOCK_T))


def gluon_prune(configs, named_args, **kwargs):
    """The call's M bucket; BLOCK_K at most one chunk of the weight's layout and a divisor of it: 64
    or 128 (an operand of k_width 8 needs 32 K elements an MMA, 64 of the even and odd halves). A
    divisor, where grouped_prune only caps the step: this kernel has no K masks, so no step may run
    past K."""
    chunk = kwargs["CHUNK"]

    def step(c):
        return max(b for b in (64, 128) if b <= c.kwargs["BLOCK_K"] and chunk % b == 0)

    return [
        triton.Config({**c.kwargs, "BLOCK_K": step(c)}, num_warps=c.num_warps)
        for c in configs
        if c.kwargs["BUCKET"] == named_args["M_BUCKET"]
    ]


# (BLOCK_T rows, BLOCK_N output columns, BLOCK_K, warps) per bucket of rows an expert (mean). Timed
# on the H200 at 64 and 256 decode tokens (4 and 16 rows an expert): 8-row tiles at 4, 32-row tiles
# at 16 (one decode of the weight where 16-row tiles decode it about 1.5 times). At 8 (128 tokens)
# 8-row tiles would decode the weight of an expert with 9 to 16 rows twice: 16-row tiles, whose half
# serves those with 8 or fewer, are candidates beside them. Larger buckets: prefill.
GLUON_CONFIGS = {
    4: [(8, 64, 128, 4), (8, 128, 128, 4), (8, 128, 64, 4)],
    8: [(16, 128, 128, 4), (16, 64, 128, 4), (16, 128, 64, 4), (8, 128, 128, 4), (8, 128, 64, 4)],
    16: [(32, 64, 64, 4), (32, 128, 64, 4), (16, 128, 128, 4)],
    64: [(32, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4)],
    4096: [(64, 64, 64, 4), (64, 128, 64, 8), (32, 128, 64, 4)],
}


@gluon.jit
def _gluon_token_rows(
    x_ptr,
    row_ids_ptr,
    stride_x,
    t0,
    end_row,
    GATHER: gl.constexpr,
    T: gl.constexpr,
    KC: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """Sorted rows t0 .. t0 + T (those before end_row) as the MMA's right operand: pointers to their
    (KC, T) columns of the fp16 operand planes at K = 0, and their mask."""
    mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
    x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    t_x = t0 + gl.arange(0, T, layout=gl.SliceLayout(0, x_layout))
    if GATHER:
        x_rows = gl.load(row_ids_ptr + t_x, mask=t_x < end_row, other=0)
    else:
        x_rows = t_x.to(gl.int64)
    x_base = (
        x_ptr
        + x_rows.to(gl.int64)[None, :] * stride_x
        + gl.arange(0, KC, layout=gl.SliceLayout(1, x_layout))[:, None]
    )
    return x_base, (t_x < end_row)[None, :]


@gluon.jit
def _gluon_expert_store(
    acc,
    scale,
    t0,
    end_row,
    pid_n,
    n_out,
    y_ptr,
    stride_y,
    row_weights_ptr,
    weight_ids_ptr,
    x_global_ptr,
    row_ids_ptr,
    ROW_WEIGHTS: gl.constexpr,
    WEIGHT_IDS: gl.constexpr,
    SWIGLU: gl.constexpr,
    GATHER: gl.constexpr,
    ROW_SCALE: gl.constexpr,
    T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """The epilogue of rows t0 .. t0 + T: both global scales and 2^12 (scale; ROW_SCALE: g_w alone,
    each row's g_x read here), SwiGLU, router weights."""
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
    if not ROW_SCALE:
        out = acc * scale  # (W_ROWS, T)
    t_y = t0 + gl.arange(0, T, layout=gl.SliceLayout(0, mma))
    if ROW_SCALE:
        # the x scale of the activation row each column reads: (2^12 g_x) g_w, the one-scale order
        x_rows = gl.load(row_ids_ptr + t_y, mask=t_y < end_row, other=0) if GATHER else t_y
        x_global = gl.load(x_global_ptr + x_rows, mask=t_y < end_row, other=0.0)
        out = acc * (EPILOGUE * x_global * scale)[None, :]
    r_y = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
    col_y = pid_n * BLOCK_N + ((r_y // 16) * 8 + r_y % 8 if SWIGLU else r_y)
    y_ptrs = y_ptr + t_y.to(gl.int64)[None, :] * stride_y + col_y[:, None]
    y_mask = (t_y < end_row)[None, :] & (col_y < n_out)[:, None]
    if ROW_WEIGHTS:
        ids = gl.load(weight_ids_ptr + t_y, mask=t_y < end_row, other=0) if WEIGHT_IDS else t_y
        router = gl.load(row_weights_ptr + ids, mask=t_y < end_row, other=0.0).to(gl.float32)
        router = gl.zeros_like(out) + router[None, :]
    if SWIGLU:
        gate, up = _gluon_gate_up(out, W_ROWS, T)
        out = gate / (1.0 + gl.exp(-gate)) * up  # (BLOCK_N, T)
        y_ptrs, _ = _gluon_gate_up(y_ptrs, W_ROWS, T)
        y_mask, _ = _gluon_gate_up(y_mask, W_ROWS, T)
        if ROW_WEIGHTS:
            router, _ = _gluon_gate_up(router, W_ROWS, T)
    if ROW_WEIGHTS:
        out = out * router
    gl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)  # bf16: round to nearest even


@gluon.jit
def _gluon_expert_rows(
    args,
    tile,
    GATHER: gl.constexpr,
    ROW_WEIGHTS: gl.constexpr,
    WEIGHT_IDS: gl.constexpr,
    SWIGLU: gl.constexpr,
    ROW_SCALE: gl.constexpr,
    CHUNK: gl.constexpr,
    BLOCK_T: gl.constexpr,
    EXTRA: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """tile = (expert, row0, end_row, pid_n): sorted rows row0 .. min(row0 + BLOCK_T + EXTRA,
    end_row) of `expert` times its weight rows of output tile pid_n, into y: BLOCK_T rows, and EXTRA
    more (0, or a quarter of the autotuned tile) in a second accumulator on the same decoded weight.
    args: grouped_gluon_kernel's pointers, sizes and strides."""
    (
        x_ptr,
        x_global_ptr,
        row_ids_ptr,
        row_weights_ptr,
        weight_ids_ptr,
        w_ptr,
        w_scale_ptr,
        w_global_ptr,
        y_ptr,
        N,
        K,
        x_plane,
        stride_x,
        stride_we,
        stride_wb,
        stride_wc,
        stride_se,
        stride_sb,
        stride_sc,
        stride_y,
    ) = args
    expert, row0, end_row, pid_n = tile
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2  # bytes of a row a K step
    mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    n_out = N // 2 if SWIGLU else N
    # the right operand: the tile's activation rows, as (K, T) columns of the fp16 operand planes
    x_base, x_mask = _gluon_token_rows(
        x_ptr, row_ids_ptr, stride_x, row0, end_row, GATHER, BLOCK_T, KC, NUM_WARPS
    )
    if EXTRA:
        x2_base, x2_mask = _gluon_token_rows(
            x_ptr, row_ids_ptr, stride_x, row0 + BLOCK_T, end_row, GATHER, EXTRA, KC, NUM_WARPS
        )
    # the left operand: W_ROWS weight rows (SwiGLU: 8 gate rows, their 8 up rows, the next 8 gate
    # rows...)
    r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, w_layout))
    if SWIGLU:
        col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
        w_rows = col + ((r // 8) % 2) * n_out
    else:
        col = pid_n * BLOCK_N + r
        w_rows = col
    w_mask = (col < n_out)[:, None]
    block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, w_layout))
    w_base = (
        w_ptr
        + expert.to(gl.int64) * stride_we
        + gl.multiple_of(block * stride_wb + row * (CHUNK // 2), 16)[:, None]
        + k[None, :]
    )
    s_base = (
        w_scale_ptr
        + expert.to(gl.int64) * stride_se
        + (block * stride_sb + row * (CHUNK // 16))[:, None]
        + (k // 8)[None, :]
    )
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    if EXTRA:
        acc2 = gl.zeros((W_ROWS, EXTRA), gl.float32, layout=mma)
    for k0 in range(0, K, BLOCK_K):
        chunk, within = k0 // CHUNK, k0 % CHUNK
        step = gl.multiple_of(chunk * stride_wc + within // 2, 16)
        codes = gl.load(w_base + step, mask=w_mask, other=0)
        scale = gl.load(s_base + chunk * stride_sc + within // 16, mask=w_mask, other=0)
        scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)  # exact
        x_even = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
        x_odd = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
        w_even, w_odd = _gluon_e2m1_pairs(codes)
        w_even, w_odd = w_even * scale, w_odd * scale
        acc = gl.nvidia.ampere.mma_v2(w_even, x_even, acc)
        acc = gl.nvidia.ampere.mma_v2(w_odd, x_odd, acc)
        if EXTRA:
            x2_even = gl.load(x2_base + k0 // 2, mask=x2_mask, other=0.0)
            x2_odd = gl.load(x2_base + x_plane + k0 // 2, mask=x2_mask, other=0.0)
            acc2 = gl.nvidia.ampere.mma_v2(w_even, x2_even, acc2)
            acc2 = gl.nvidia.ampere.mma_v2(w_odd, x2_odd, acc2)
    if ROW_SCALE:  # g_w here, each row's g_x in the store
        scale = gl.load(w_global_ptr + expert)
    else:
        scale = EPILOGUE * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert)
    _gluon_expert_store(
        acc,
        scale,
        row0,
        end_row,
        pid_n,
        n_out,
        y_ptr,
        stride_y,
        row_weights_ptr,
        weight_ids_ptr,
        x_global_ptr,
        row_ids_ptr,
        ROW_WEIGHTS,
        WEIGHT_IDS,
        SWIGLU,
        GATHER,
        ROW_SCALE,
        BLOCK_T,
        BLOCK_N,
        NUM_WARPS,
    )
    if EXTRA:
        _gluon_expert_store(
            acc2,
            scale,
            row0 + BLOCK_T,
            end_row,
            pid_n,
            n_out,
            y_ptr,
            stride_y,
            row_weights_ptr,
            weight_ids_ptr,
            x_global_ptr,
            row_ids_ptr,
            ROW_WEIGHTS,
            WEIGHT_IDS,
            SWIGLU,
            GATHER,
            ROW_SCALE,
            EXTRA,
            BLOCK_N,
            NUM_WARPS,
        )


@triton.autotune(
    configs=[
        triton.Config(
            {"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w, "BUCKET": bucket},
            num_warps=w,
        )
        for bucket, rows in GLUON_CONFIGS.items()
        for t, n, k, w in rows
    ],
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": gluon_prune},
    do_bench=bench_in_graph,
)
@gluon.jit
def grouped_gluon_kernel(
    # pointers, as grouped_kernel's (x_global: one scale, or one per operand row with ROW_SCALE);
    # the weight in ExpertWeights' layout
    x_ptr,
    x_global_ptr,
    row_ids_ptr,
    row_weights_ptr,
    weight_ids_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    counts_ptr,
    y_ptr,
    # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
    N,
    K,
    E,
    M_BUCKET,
    x_plane,
    # strides: activation rows; weight (expert, row block, chunk) in bytes, scales in blocks; y rows
    stride_x,
    stride_we,
    stride_wb,
    stride_wc,
    stride_se,
    stride_sb,
    stride_sc,
    stride_y,
    # meta-parameters
    GATHER: gl.constexpr,
    ROW_WEIGHTS: gl.constexpr,
    WEIGHT_IDS: gl.constexpr,
    SWIGLU: gl.constexpr,
    ROW_SCALE: gl.constexpr,
    E_POW2: gl.constexpr,
    CHUNK: gl.constexpr,
    BUCKET: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    pid_m, pid_n = gl.program_id(0), gl.program_id(1)
    expert, row0, end_row = _gluon_expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
        return
    args = (
        x_ptr,
        x_global_ptr,
        row_ids_ptr,
        row_weights_ptr,
        weight_ids_ptr,
        w_ptr,
        w_scale_ptr,
        w_global_ptr,
        y_ptr,
        N,
        K,
        x_plane,
        stride_x,
        stride_we,
        stride_wb,
        stride_wc,
        stride_se,
        stride_sb,
        stride_sc,
        stride_y,
    )
    tile = (expert, row0, end_row, pid_n)
    # a tile holding at most half its rows (most often an expert's last) runs as a tile of half the
    # rows, one of at most three quarters as that half plus a quarter: the padding rows' MMAs and
    # loads skipped (at 16 rows an expert about half of the 32-row tiles run as 16 rows, and most
    # others as 16 + 8)
    rows = end_row - row0
    if BLOCK_T >= 16 and rows <= BLOCK_T // 2:
        _gluon_expert_rows(
            args,
            tile,
            GATHER,
            ROW_WEIGHTS,
            WEIGHT_IDS,
            SWIGLU,
            ROW_SCALE,
            CHUNK,
            BLOCK_T // 2,
            0,
            BLOCK_N,
            BLOCK_K,
            NUM_WARPS,
        )
    elif BLOCK_T >= 32 and rows <= BLOCK_T // 2 + BLOCK_T // 4:
        _gluon_expert_rows(
            args,
            tile,
            GATHER,
            ROW_WEIGHTS,
            WEIGHT_IDS,
            SWIGLU,
            ROW_SCALE,
            CHUNK,
            BLOCK_T // 2,
            BLOCK_T // 4,
            BLOCK_N,
            BLOCK_K,
            NUM_WARPS,
        )
    else:
        _gluon_expert_rows(
            args,
            tile,
            GATHER,
            ROW_WEIGHTS,
            WEIGHT_IDS,
            SWIGLU,
            ROW_SCALE,
            CHUNK,
            BLOCK_T,
            0,
            BLOCK_N,
            BLOCK_K,
            NUM_WARPS,
        )


# ------------------------------------------------------------------ launch
def grouped_matmul(
    operand,
    x_global_scale,
    w_data,
    w_block_scale,
    w_global_scale,
    counts,
    out_dtype,
    row_ids=None,
    row_weights=None,
    row_weight_ids=None,
    swiglu=False,
):
    """gpu_kernels.w4a4_experts.grouped_matmul on the Gluon kernel (same arguments, x_global_scale
    one or one per operand row; K a multiple of 64; a CUDA GPU of compute capability 8.9 to 9.x). y
    is stored in its own dtype (bf16 rounds to nearest even)."""
    E, N, K, chunk = expert_shape(w_data)
    if K % 64:  # the kernel has no K masks: a shorter last step would read past each row
        raise ValueError(
            f"grouped_matmul (Gluon): the weight's K must be a multiple of 64, got {K}"
        )
    row_scale = x_scale_is_per_row(x_global_scale, operand.shape[1], "grouped_matmul")
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    y, flags, (row_ids, row_weights, row_weight_ids) = grouped_output(
        n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu
    )
    if n_rows == 0:
        return y
    w_scale = w_block_scale.view(torch.uint8)
    n_out = y.shape[1]

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_T): no host sync
        row_tiles = triton.cdiv(n_rows, meta["BLOCK_T"]) + min(E, n_rows)
        return row_tiles, triton.cdiv(n_out, meta["BLOCK_N"])

    grouped_gluon_kernel[grid](
        operand,
        x_global_scale,
        row_ids,
        row_weights,
        row_weight_ids,
        w_data,
        w_scale,
        w_global_scale,
        counts,
        y,
        N,
        K,
        E,
        m_bucket(triton.cdiv(n_rows, E), GLUON_CONFIGS),
        operand.stride(0),
        operand.stride(1),
        *w_data.stride()[:3],
        *w_scale.stride()[:3],
        y.stride(0),
        CHUNK=chunk,
        ROW_SCALE=row_scale,
        **flags,
    )
    return y
