"""Prototype (next session): the experts' Gluon kernel, warp-specialized. One producer warp streams each K step's
weight codes and activation rows into a STAGES-deep shared-memory ring with cp.async, signalling a `full`
mbarrier a stage; the 4 consumer warps (the default partition) read a stage into mma.sync's operand registers,
release it (`empty`), decode and multiply, as rac's kernel does from global memory. The block scales stay
global loads in the consumers, one step ahead. No half tiles: compare against rac's kernel at a forced tile."""
import os, torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
import rac
from rac import _gluon_expert_tile, _gluon_e2m1_pairs, _gluon_expert_store, _gluon_wait_for_previous_kernel

EXPERT_ROWS = gl.constexpr(rac.EXPERT_ROW_BLOCK)
_EPILOGUE = gl.constexpr(rac.EPILOGUE_SCALE)


@gluon.jit
def _weight_rows(pid_n, n_out, r, SWIGLU: gl.constexpr, BLOCK_N: gl.constexpr):
    if SWIGLU:
        col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
        w_rows = col + ((r // 8) % 2) * n_out
    else:
        col = pid_n * BLOCK_N + r
        w_rows = col
    return col, w_rows


@gluon.jit
def _producer(codes_s, xe_s, xo_s, full, empty, x_ptr, row_ids_ptr, w_ptr, expert, row0, end_row, pid_n, N, K,
              x_plane, stride_x, stride_we, stride_wb, stride_wc, GATHER: gl.constexpr, SWIGLU: gl.constexpr,
              CHUNK: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr):
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    # one warp: 16-byte copies (16 code bytes, 8 fp16 activation values a thread and row)
    cl: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (KC // 16), KC // 16], [1, 1], [1, 0])
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (KC // 8), KC // 8], [1, 1], [1, 0])
    n_out = N // 2 if SWIGLU else N
    r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, cl))
    col, w_rows = _weight_rows(pid_n, n_out, r, SWIGLU, BLOCK_N)
    block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS
    w_base = (w_ptr + expert.to(gl.int64) * stride_we
              + gl.multiple_of(block * stride_wb + row * (CHUNK // 2), 16)[:, None]
              + gl.arange(0, KC, layout=gl.SliceLayout(0, cl))[None, :])
    w_mask = (col < n_out)[:, None] & (gl.arange(0, KC, layout=gl.SliceLayout(0, cl)) >= 0)[None, :]
    t = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, xl))
    if GATHER:
        x_rows = gl.load(row_ids_ptr + t, mask=t < end_row, other=0)
    else:
        x_rows = t.to(gl.int64)
    x_base = (x_ptr + x_rows.to(gl.int64)[:, None] * stride_x
              + gl.arange(0, KC, layout=gl.SliceLayout(0, xl))[None, :])
    x_mask = (t < end_row)[:, None] & (gl.arange(0, KC, layout=gl.SliceLayout(0, xl)) >= 0)[None, :]
    i = 0
    for k0 in range(0, K, BLOCK_K):
        s = i % STAGES
        if i >= STAGES:  # the consumers have released this stage's previous round
            mbarrier.wait(empty.index(s), ((i // STAGES) - 1) & 1)
        chunk, within = k0 // CHUNK, k0 % CHUNK
        step = gl.multiple_of(chunk * stride_wc + within // 2, 16)
        async_copy.async_copy_global_to_shared(codes_s.index(s), w_base + step, mask=w_mask)
        async_copy.async_copy_global_to_shared(xe_s.index(s), x_base + k0 // 2, mask=x_mask)
        async_copy.async_copy_global_to_shared(xo_s.index(s), x_base + x_plane + k0 // 2, mask=x_mask)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)
        i += 1


@gluon.jit
def _consumer(codes_s, xe_s, xo_s, full, empty, w_scale_ptr, expert, pid_n, N, K, stride_se, stride_sb,
              stride_sc, SWIGLU: gl.constexpr, CHUNK: gl.constexpr, BLOCK_T: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    n_out = N // 2 if SWIGLU else N
    r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, w_layout))
    col, w_rows = _weight_rows(pid_n, n_out, r, SWIGLU, BLOCK_N)
    block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, w_layout))
    s_base = (w_scale_ptr + expert.to(gl.int64) * stride_se
              + (block * stride_sb + row * (CHUNK // 16))[:, None] + (k // 8)[None, :])
    s_mask = (col < n_out)[:, None]
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    scale = gl.load(s_base, mask=s_mask, other=0)
    i = 0
    for k0 in range(0, K, BLOCK_K):
        s = i % STAGES
        nxt = k0 + BLOCK_K
        chunk, within = nxt // CHUNK, nxt % CHUNK
        scale_next = gl.load(s_base + chunk * stride_sc + within // 16, mask=s_mask & (nxt < K), other=0)
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        codes = codes_s.index(s).load(w_layout)
        x_even = xe_s.index(s).permute((1, 0)).load(x_layout)
        x_odd = xo_s.index(s).permute((1, 0)).load(x_layout)
        mbarrier.arrive(empty.index(s))
        scale16 = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        w_even, w_odd = _gluon_e2m1_pairs(codes)
        acc = gl.nvidia.ampere.mma_v2(w_even * scale16, x_even, acc)
        acc = gl.nvidia.ampere.mma_v2(w_odd * scale16, x_odd, acc)
        scale = scale_next
        i += 1
    return (acc,)


@gluon.jit
def ws_kernel(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
              counts_ptr, y_ptr, N, K, E, x_plane,
              stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc, stride_y,
              GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr, SWIGLU: gl.constexpr,
              E_POW2: gl.constexpr, CHUNK: gl.constexpr, PDL: gl.constexpr, BLOCK_T: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr, STAGES: gl.constexpr,
              FULL_COUNT: gl.constexpr, EMPTY_COUNT: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    if PDL:
        _gluon_wait_for_previous_kernel()
    pid_m, pid_n = gl.program_id(0), gl.program_id(1)
    expert, row0, end_row = _gluon_expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    codes_s = gl.allocate_shared_memory(gl.uint8, [STAGES, W_ROWS, KC], flat)
    xe_s = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_T, KC], flat)
    xo_s = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_T, KC], flat)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=FULL_COUNT)
        mbarrier.init(empty.index(s), count=EMPTY_COUNT)
    results = gl.warp_specialize([
        (_consumer, (codes_s, xe_s, xo_s, full, empty, w_scale_ptr, expert, pid_n, N, K, stride_se, stride_sb,
                     stride_sc, SWIGLU, CHUNK, BLOCK_T, BLOCK_N, BLOCK_K, STAGES, NUM_WARPS)),
        (_producer, (codes_s, xe_s, xo_s, full, empty, x_ptr, row_ids_ptr, w_ptr, expert, row0, end_row, pid_n,
                     N, K, x_plane, stride_x, stride_we, stride_wb, stride_wc, GATHER, SWIGLU, CHUNK, BLOCK_T,
                     BLOCK_N, BLOCK_K, STAGES)),
    ], [1], [PRODUCER_REGS])
    acc = results[0]
    n_out = N // 2 if SWIGLU else N
    scale = _EPILOGUE * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert)
    _gluon_expert_store(acc, scale, row0, end_row, pid_n, n_out, y_ptr, stride_y, row_weights_ptr,
                        weight_ids_ptr, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, BLOCK_T, BLOCK_N, NUM_WARPS)


def constants(swiglu, T, BN, BK, stages=4, full_count=32, empty_count=1, producer_regs=40, pdl=False, warps=4):
    return dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, E_POW2=128,
                CHUNK=128, PDL=pdl, BLOCK_T=T, BLOCK_N=BN, BLOCK_K=BK, NUM_WARPS=warps, STAGES=stages,
                FULL_COUNT=full_count, EMPTY_COUNT=empty_count, PRODUCER_REGS=producer_regs)


def grouped(act, w, counts, row_ids=None, row_weights=None, row_weight_ids=None, swiglu=False, T=32, BN=64, BK=64,
            out_dtype=torch.bfloat16, **kw):
    E, N, K = w.shape
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=out_dtype, device=w.device)
    c = constants(swiglu, T, BN, BK, **kw)
    c.update(GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None, WEIGHT_IDS=row_weight_ids is not None)
    row_ids, row_weights, row_weight_ids = (t if t is not None else counts for t in (row_ids, row_weights,
                                                                                      row_weight_ids))
    grid = (triton.cdiv(n_rows, T) + min(E, n_rows), triton.cdiv(n_out, BN))
    ws_kernel[grid](operand, act.global_scale, row_ids, row_weights, row_weight_ids, w.data,
                    w.block_scale.view(torch.uint8), w.global_scale, counts, y, N, K, E, operand.stride(0),
                    operand.stride(1), *w.data.stride()[:3], *w.block_scale.stride()[:3], y.stride(0),
                    num_warps=c["NUM_WARPS"], **c, **({"maxnreg": int(os.environ["MAXNREG"])} if os.environ.get("MAXNREG") else {}))
    return y
