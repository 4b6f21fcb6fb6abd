"""Prototype: the experts' Gluon kernel on wgmma (sm_90). The decoded weight rows are wgmma's left operand
from registers (k_width 2); the tile's activation rows its right operand from shared memory, written once
per K step by the whole warpgroup. A thread's left-operand K positions within a step are mapped onto one
contiguous run of its weight row's bytes (one 8- or 16-byte load), and the activation is stored in shared
memory in the same permuted order (the dot product is a sum over K: any common order gives the same
terms)."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
import rac
from rac import _gluon_expert_tile, _gluon_e2m1_pairs, _gluon_gate_up, _gluon_wait_for_previous_kernel

EXPERT_ROWS = gl.constexpr(rac.EXPERT_ROW_BLOCK)
_EPILOGUE = gl.constexpr(rac.EPILOGUE_SCALE)


def code_layout(R, KP):
    """(R, 4, NB, 8) bytes [row, t, block within t's run, byte within block], registers in load order."""
    NB = KP // 32
    reg = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] + ([[0, 0, 1, 0]] if NB == 2 else [])
    reg += [[8, 0, 0, 0]] + [[64 << i, 0, 0, 0] for i in range((R // 64).bit_length() - 1)]
    lane = [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warp = [[16, 0, 0, 0], [32, 0, 0, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [R, 4, NB, 8])


@gluon.jit
def _to_mma_k(t, R: gl.constexpr, KP: gl.constexpr):
    """(R, 4[t], NB[s1], 8[s0 h j]) -> (R, KP) with column p = 32 s1 + 16 s0 + 8 h + 2 t + j."""
    NB: gl.constexpr = KP // 32
    t = gl.reshape(t, (R, 4, NB, 2, 2, 2))
    t = gl.permute(t, (0, 2, 3, 4, 1, 5))
    return gl.reshape(t, (R, KP))


@gluon.jit
def _wg_loads(w_base, w_mask, s_base, s_mask, x_base, x_mask, x_plane, k0, stride_wc, stride_sc,
              CHUNK: gl.constexpr, valid=True):
    chunk, within = k0 // CHUNK, k0 % CHUNK
    step = gl.multiple_of(chunk * stride_wc + within // 2, 16)
    codes = gl.load(w_base + step, mask=w_mask & valid, other=0)
    scale = gl.load(s_base + chunk * stride_sc + within // 16, mask=s_mask & valid, other=0)
    x_even = gl.load(x_base + k0 // 2, mask=x_mask & valid, other=0.0)
    x_odd = gl.load(x_base + x_plane + k0 // 2, mask=x_mask & valid, other=0.0)
    return codes, scale, x_even, x_odd


@gluon.jit
def _wg_rows(args, tile, GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
             SWIGLU: gl.constexpr, CHUNK: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr, CODE_LAYOUT: gl.constexpr,
             X_LAYOUT: gl.constexpr, PREFETCH: gl.constexpr, SYNC: gl.constexpr):
    (x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
     y_ptr, N, K, x_plane, stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc,
     stride_y) = args
    expert, row0, end_row, pid_n = tile
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KP: gl.constexpr = BLOCK_K // 2                                   # bytes of a row a K step
    NB: gl.constexpr = KP // 32
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_T, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, KP], gl.float16)
    n_out = N // 2 if SWIGLU else N
    # the activation rows: (T, 4, NB, 8) fp16 of each plane, natural order (16-byte loads)
    xl3: gl.constexpr = gl.SliceLayout(3, X_LAYOUT)
    xl2: gl.constexpr = gl.SliceLayout(2, xl3)
    xl1: gl.constexpr = gl.SliceLayout(1, xl2)
    t_x = row0 + gl.arange(0, BLOCK_T, layout=xl1)
    if GATHER:
        x_rows = gl.load(row_ids_ptr + t_x, mask=t_x < end_row, other=0)
    else:
        x_rows = t_x.to(gl.int64)
    x0: gl.constexpr = gl.SliceLayout(0, X_LAYOUT)                      # (4, NB, 8)
    xo_t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, x0))) * (KP // 4)
    xo_b = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, x0))) * 8
    xo_i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x0)))
    x_off = xo_t[:, None, None] + xo_b[None, :, None] + xo_i[None, None, :]          # (4, NB, 8)
    x_base = x_ptr + x_rows.to(gl.int64)[:, None, None, None] * stride_x + x_off[None, :, :, :]
    x_mask = (t_x < end_row)[:, None, None, None]
    # the weight rows (SwiGLU: 8 gate rows, their 8 up rows, ...) in CODE_LAYOUT
    cl3: gl.constexpr = gl.SliceLayout(3, CODE_LAYOUT)
    cl2: gl.constexpr = gl.SliceLayout(2, cl3)
    cl1: gl.constexpr = gl.SliceLayout(1, cl2)
    r = gl.arange(0, W_ROWS, layout=cl1)
    if SWIGLU:
        col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
        w_rows = col + ((r // 8) % 2) * n_out
    else:
        col = pid_n * BLOCK_N + r
        w_rows = col
    w_mask = (col < n_out)[:, None, None, None]
    block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS
    row_off = expert.to(gl.int64) * stride_we + block * stride_wb + row * (CHUNK // 2)
    c0: gl.constexpr = gl.SliceLayout(0, CODE_LAYOUT)
    c_t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, c0))) * (KP // 4)
    c_b = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, c0))) * 8
    c_i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, c0)))
    c_off = c_t[:, None, None] + c_b[None, :, None] + c_i[None, None, :]
    w_base = w_ptr + gl.multiple_of(row_off, 16)[:, None, None, None] + c_off[None, :, :, :]
    s_row = expert.to(gl.int64) * stride_se + block * stride_sb + row * (CHUNK // 16)
    s0: gl.constexpr = gl.SliceLayout(0, cl3)                            # (4, NB)
    s_off = (gl.arange(0, 4, layout=gl.SliceLayout(1, s0))[:, None] * NB
             + gl.arange(0, NB, layout=gl.SliceLayout(0, s0))[None, :])
    s_base = w_scale_ptr + s_row[:, None, None] + s_off[None, :, :]
    s_mask = (col < n_out)[:, None, None]
    xs_even = gl.allocate_shared_memory(gl.float16, [2, BLOCK_T, KP], x_smem_layout)
    xs_odd = gl.allocate_shared_memory(gl.float16, [2, BLOCK_T, KP], x_smem_layout)
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    # the A operands of the MMAs in flight stay alive (and their registers untouched) until their wait
    prev_even = gl.zeros((W_ROWS, KP), gl.float16, layout=a_layout)
    prev_odd = gl.zeros((W_ROWS, KP), gl.float16, layout=a_layout)
    codes, scale, x_even, x_odd = _wg_loads(w_base, w_mask, s_base, s_mask, x_base, x_mask, x_plane, 0,
                                            stride_wc, stride_sc, CHUNK)
    i = 0
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:  # the next step's raw bytes in flight while this step decodes and multiplies
            nxt = _wg_loads(w_base, w_mask, s_base, s_mask, x_base, x_mask, x_plane, k0 + BLOCK_K,
                            stride_wc, stride_sc, CHUNK, k0 + BLOCK_K < K)
        else:
            codes, scale, x_even, x_odd = _wg_loads(w_base, w_mask, s_base, s_mask, x_base, x_mask, x_plane,
                                                    k0, stride_wc, stride_sc, CHUNK)
        scale16 = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)[:, :, :, None]
        w_even, w_odd = _gluon_e2m1_pairs(codes)
        a_even = gl.convert_layout(_to_mma_k(w_even * scale16, W_ROWS, KP), a_layout)
        a_odd = gl.convert_layout(_to_mma_k(w_odd * scale16, W_ROWS, KP), a_layout)
        buf = i % 2
        xe = xs_even.index(buf)
        xo = xs_odd.index(buf)
        xe.store(_to_mma_k(x_even, BLOCK_T, KP))
        xo.store(_to_mma_k(x_odd, BLOCK_T, KP))
        hopper.fence_async_shared()
        gl.thread_barrier()
        acc = hopper.warpgroup_mma(a_even, xe.permute((1, 0)), acc, is_async=True)
        acc = hopper.warpgroup_mma(a_odd, xo.permute((1, 0)), acc, is_async=True)
        acc, prev_even, prev_odd = hopper.warpgroup_mma_wait(num_outstanding=0 if SYNC else 2,
                                                             deps=[acc, prev_even, prev_odd])
        prev_even, prev_odd = a_even, a_odd
        if PREFETCH:
            codes, scale, x_even, x_odd = nxt
        i += 1
    acc, prev_even, prev_odd = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, prev_even, prev_odd])
    out = acc * (_EPILOGUE * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert))   # (W_ROWS, T)
    t_y = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma))
    r_y = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
    col_y = pid_n * BLOCK_N + ((r_y // 16) * 8 + r_y % 8 if SWIGLU else r_y)
    y_ptrs = y_ptr + t_y.to(gl.int64)[None, :] * stride_y + col_y[:, None]
    y_mask = (t_y < end_row)[None, :] & (col_y < n_out)[:, None]
    if ROW_WEIGHTS:
        ids = gl.load(weight_ids_ptr + t_y, mask=t_y < end_row, other=0) if WEIGHT_IDS else t_y
        router = gl.load(row_weights_ptr + ids, mask=t_y < end_row, other=0.0).to(gl.float32)
        router = gl.zeros_like(out) + router[None, :]
    if SWIGLU:
        gate, up = _gluon_gate_up(out, W_ROWS, BLOCK_T)
        out = gate / (1.0 + gl.exp(-gate)) * up
        y_ptrs, _ = _gluon_gate_up(y_ptrs, W_ROWS, BLOCK_T)
        y_mask, _ = _gluon_gate_up(y_mask, W_ROWS, BLOCK_T)
        if ROW_WEIGHTS:
            router, _ = _gluon_gate_up(router, W_ROWS, BLOCK_T)
    if ROW_WEIGHTS:
        out = out * router
    gl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@gluon.jit
def wg_kernel(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
              counts_ptr, y_ptr, N, K, E, x_plane,
              stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc, stride_y,
              GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr, SWIGLU: gl.constexpr,
              E_POW2: gl.constexpr, CHUNK: gl.constexpr, PDL: gl.constexpr, HALVES: gl.constexpr,
              BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr,
              CODE_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, X_LAYOUT_HALF: gl.constexpr,
              PREFETCH: gl.constexpr, SYNC: gl.constexpr):
    if PDL:
        _gluon_wait_for_previous_kernel()
    pid_m, pid_n = gl.program_id(0), gl.program_id(1)
    expert, row0, end_row = _gluon_expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    args = (x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
            w_global_ptr, y_ptr, N, K, x_plane, stride_x, stride_we, stride_wb, stride_wc, stride_se,
            stride_sb, stride_sc, stride_y)
    tile = (expert, row0, end_row, pid_n)
    if HALVES:
        if end_row - row0 <= BLOCK_T // 2:
            _wg_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T // 2, BLOCK_N, BLOCK_K,
                     NUM_WARPS, CODE_LAYOUT, X_LAYOUT_HALF, PREFETCH, SYNC)
        else:
            _wg_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T, BLOCK_N, BLOCK_K,
                     NUM_WARPS, CODE_LAYOUT, X_LAYOUT, PREFETCH, SYNC)
    else:
        _wg_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T, BLOCK_N, BLOCK_K,
                 NUM_WARPS, CODE_LAYOUT, X_LAYOUT, PREFETCH, SYNC)


def x_layout(T, KP):
    """(T, 4, NB, 8) fp16: 8 consecutive a thread (16 bytes), 128 threads over rows and runs."""
    NB = KP // 32
    return gl.BlockedLayout([1, 1, 1, 8], [8, 4, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0])


def constants(swiglu, T, BN, BK, halves=True, pdl=False, prefetch=False, sync=True):
    W = 2 * BN if swiglu else BN
    KP = BK // 2
    return dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, E_POW2=128,
                CHUNK=128, PDL=pdl, HALVES=halves and T >= 16, BLOCK_T=T, BLOCK_N=BN, BLOCK_K=BK, NUM_WARPS=4,
                CODE_LAYOUT=code_layout(W, KP), X_LAYOUT=x_layout(T, KP), X_LAYOUT_HALF=x_layout(max(T // 2, 8), KP), PREFETCH=prefetch, SYNC=sync)


def grouped(act, w, counts, row_ids=None, row_weights=None, row_weight_ids=None, swiglu=False, T=32, BN=64,
            BK=64, halves=True, out_dtype=torch.bfloat16, prefetch=False, sync=True):
    E, N, K = w.shape
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=out_dtype, device=w.device)
    c = constants(swiglu, T, BN, BK, halves, pdl=False, prefetch=prefetch, sync=sync)
    c.update(GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
             WEIGHT_IDS=row_weight_ids is not None)
    row_ids, row_weights, row_weight_ids = (t if t is not None else counts
                                            for t in (row_ids, row_weights, row_weight_ids))
    grid = (triton.cdiv(n_rows, T) + min(E, n_rows), triton.cdiv(n_out, BN))
    wg_kernel[grid](operand, act.global_scale, row_ids, row_weights, row_weight_ids, w.data,
                    w.block_scale.view(torch.uint8), w.global_scale, counts, y, N, K, E, operand.stride(0),
                    operand.stride(1), *w.data.stride()[:3], *w.block_scale.stride()[:3], y.stride(0),
                    num_warps=4, **c)
    return y
