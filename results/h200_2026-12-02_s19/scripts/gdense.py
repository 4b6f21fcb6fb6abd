"""Prototype: the dense decode GEMM in Gluon, split-K, weight tile loaded before the PDL wait."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
import rac
from rac import _gluon_e2m1_pairs, _gluon_wait_for_previous_kernel, _EPILOGUE


@gluon.jit
def _gluon_split_columns(cols, M, N, N1, N2):
    which = (cols >= N1).to(gl.int32) + (cols >= N2).to(gl.int32)
    start = gl.where(which == 0, 0, gl.where(which == 1, N1, N2)).to(gl.int64)
    end = gl.where(which == 0, N1, gl.where(which == 1, N2, N)).to(gl.int64)
    return which, M * start + cols - start, end - start


@gluon.jit
def _w_off(k0, stride_wc, BLOCKED: gl.constexpr, CHUNK: gl.constexpr):
    if BLOCKED:
        return (k0 // CHUNK) * stride_wc + (k0 % CHUNK) // 2
    else:
        return k0 // 2


@gluon.jit
def _s_off(k0, stride_sc, BLOCKED: gl.constexpr, CHUNK: gl.constexpr):
    if BLOCKED:
        return (k0 // CHUNK) * stride_sc + (k0 % CHUNK) // 16
    else:
        return k0 // 16


@gluon.jit
def dense_gluon_kernel(x_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr, workspace_ptr, counter_ptr,
                       M, N, K, x_plane, N1, N2, stride_x, stride_w, stride_ws, stride_wc, stride_sc,
                       BLOCKED: gl.constexpr, CHUNK: gl.constexpr, REDUCE: gl.constexpr, K_FAST: gl.constexpr, PDL: gl.constexpr, EARLY_W: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr, NUM_WARPS: gl.constexpr):
    if K_FAST:
        pid_k, pid_n = gl.program_id(0), gl.program_id(1)
        n_programs = gl.num_programs(1)
    else:
        pid_n, pid_k = gl.program_id(0), gl.program_id(1)
        n_programs = gl.num_programs(0)
    pid_m = gl.program_id(2)
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    k_per_split = gl.cdiv(gl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = gl.minimum(K, k_begin + k_per_split)
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    w_mask = (cols < N)[:, None]
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, w_layout))
    if BLOCKED:  # stride_w / stride_ws: a 16-row block's; stride_wc / stride_sc: a chunk's
        w_base = w_ptr + ((cols // 16).to(gl.int64) * stride_w + (cols % 16) * (CHUNK // 2))[:, None] + k[None, :]
        s_base = w_scale_ptr + ((cols // 16).to(gl.int64) * stride_ws + (cols % 16) * (CHUNK // 16))[:, None] + (k // 8)[None, :]
    else:
        w_base = w_ptr + cols.to(gl.int64)[:, None] * stride_w + k[None, :]
        s_base = w_scale_ptr + cols.to(gl.int64)[:, None] * stride_ws + (k // 8)[None, :]
    if EARLY_W:
        codes = gl.load(w_base + _w_off(k_begin, stride_wc, BLOCKED, CHUNK), mask=w_mask & (k_begin < k_end), other=0)
        scale = gl.load(s_base + _s_off(k_begin, stride_sc, BLOCKED, CHUNK), mask=w_mask & (k_begin < k_end), other=0)
    if PDL:
        _gluon_wait_for_previous_kernel()
    if not EARLY_W:
        codes = gl.load(w_base + _w_off(k_begin, stride_wc, BLOCKED, CHUNK), mask=w_mask & (k_begin < k_end), other=0)
        scale = gl.load(s_base + _s_off(k_begin, stride_sc, BLOCKED, CHUNK), mask=w_mask & (k_begin < k_end), other=0)
    t_x = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, x_layout))
    x_base = (x_ptr + t_x.to(gl.int64)[None, :] * stride_x
              + gl.arange(0, KC, layout=gl.SliceLayout(1, x_layout))[:, None])
    x_mask = (t_x < M)[None, :]
    acc = gl.zeros((BLOCK_N, BLOCK_T), gl.float32, layout=mma)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x_even = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
        x_odd = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
        w_scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        w_even, w_odd = _gluon_e2m1_pairs(codes)
        w_even, w_odd = w_even * w_scale, w_odd * w_scale
        nxt = k0 + BLOCK_K
        codes = gl.load(w_base + _w_off(nxt, stride_wc, BLOCKED, CHUNK), mask=w_mask & (nxt < k_end), other=0)
        scale = gl.load(s_base + _s_off(nxt, stride_sc, BLOCKED, CHUNK), mask=w_mask & (nxt < k_end), other=0)
        acc = gl.nvidia.ampere.mma_v2(w_even, x_even, acc)
        acc = gl.nvidia.ampere.mma_v2(w_odd, x_odd, acc)
    r_y = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    cols_y = pid_n * BLOCK_N + r_y
    t_y = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma))
    col_mask = cols_y < N
    which, col_base, col_stride = _gluon_split_columns(cols_y.to(gl.int64), M, N, N1, N2)
    w_global = gl.load(w_global_ptr + which, mask=col_mask, other=0.0)
    scale_y = (_EPILOGUE * gl.load(x_global_ptr) * w_global)[:, None]
    y_offs = t_y.to(gl.int64)[None, :] * col_stride[:, None] + col_base[:, None]
    y_mask = (t_y < M)[None, :] & col_mask[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptr + y_offs, (acc * scale_y).to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        TILE: gl.constexpr = BLOCK_N * BLOCK_T
        tile_id = pid_m * n_programs + pid_n
        offs = r_y[:, None] * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma))[None, :]
        part = workspace_ptr + tile_id.to(gl.int64) * (SPLIT_K * TILE) + offs
        if REDUCE == 2:
            gl.atomic_add(y_ptr + y_offs, acc * scale_y, mask=y_mask, sem="relaxed")
            return
        gl.store(part + pid_k * TILE, acc)
        if REDUCE == 0:
            return
        gl.thread_barrier()
        arrived = gl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel")
        gl.thread_barrier()
        if arrived == SPLIT_K - 1:
            total = gl.zeros((BLOCK_N, BLOCK_T), gl.float32, layout=mma)
            for split in gl.static_range(SPLIT_K):
                total += gl.load(part + split * TILE, cache_modifier=".cg")
            gl.atomic_xchg(counter_ptr + tile_id, 0)
            gl.store(y_ptr + y_offs, (total * scale_y).to(y_ptr.dtype.element_ty), mask=y_mask)


_COUNTERS = {}


def dense_gluon(act, w_q, out_dtype=torch.bfloat16, splits=None, T=16, BN=64, BK=128, S=16, W=4, early_w=True,
                blocked=None, reduce=1, y=None, k_fast=False):
    M = act.operand.shape[1]
    N, K = w_q.shape
    dev = w_q.device
    if y is None:
        y = torch.empty(M * N, dtype=out_dtype, device=dev)
    n_tiles, m_tiles = triton.cdiv(N, BN), triton.cdiv(M, T)
    S = max(1, min(S, K // BK))
    ws = torch.empty(max(1, S * n_tiles * m_tiles * BN * T) if S > 1 else 1, dtype=torch.float32, device=dev)
    c = _COUNTERS.get(dev)
    if c is None or c.numel() < n_tiles * m_tiles:
        c = _COUNTERS[dev] = torch.zeros(max(4096, n_tiles * m_tiles), dtype=torch.int32, device=dev)
    if blocked is not None:  # ExpertWeights of one expert, w_q's codes
        w_data, w_scale = blocked.data[0], blocked.block_scale[0].view(torch.uint8)
        strides = (w_data.stride(0), w_scale.stride(0), w_data.stride(1), w_scale.stride(1))
        chunk = blocked.chunk
    else:
        w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
        strides = (w_data.stride(0), w_scale.stride(0), 0, 0)
        chunk = 128
    pdl = rac._pdl(dev)
    dense_gluon_kernel[(S, n_tiles, m_tiles) if k_fast else (n_tiles, S, m_tiles)](
        act.operand, act.global_scale, w_data, w_scale, w_q.global_scale.reshape(-1), y, ws, c,
        M, N, K, act.operand.stride(0), *rac._column_splits(w_q, splits), act.operand.stride(1),
        *strides, BLOCKED=blocked is not None, CHUNK=chunk, REDUCE=reduce, K_FAST=k_fast, PDL=pdl, EARLY_W=early_w and pdl, BLOCK_T=T, BLOCK_N=BN,
        BLOCK_K=BK, SPLIT_K=S, NUM_WARPS=W, num_warps=W, launch_pdl=pdl)
    return rac._split_output(y, M, N, splits)
