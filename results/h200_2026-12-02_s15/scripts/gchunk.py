"""Candidate: Gluon grouped kernel on K-chunked expert weights (E, K/C, N, C/2)."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from gg import _pairs, _expert_tile, _gate_part


def chunk_experts(data, scale, C, RB):
    """(E, N, K/2) codes, (E, N, K/16) scales -> (E, N/RB, K/C, RB, C/2), (E, N/RB, K/C, RB, C/16)."""
    E, N, half = data.shape
    d = data.reshape(E, N // RB, RB, half * 2 // C, C // 2).permute(0, 1, 3, 2, 4).contiguous()
    s = scale.view(torch.uint8).reshape(E, N // RB, RB, half * 2 // C, C // 16).permute(0, 1, 3, 2, 4).contiguous()
    return d, s


@gluon.jit
def _wait_previous():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def kernel(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
           w_global_ptr, counts_ptr, y_ptr,
           N, K, E, x_plane,
           stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc, stride_y,
           GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
           SWIGLU: gl.constexpr, E_POW2: gl.constexpr, CHUNK: gl.constexpr, RB: gl.constexpr, BLOCK_T: gl.constexpr,
           BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr):
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    if PDL:
        _wait_previous()
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    n_out = N // 2 if SWIGLU else N
    t_b = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, b_l))
    t_mask_b = t_b < end_row
    if GATHER:
        x_rows = gl.load(row_ids_ptr + t_b, mask=t_mask_b, other=0)
    else:
        x_rows = t_b.to(gl.int64)
    kb = gl.arange(0, KC, layout=gl.SliceLayout(1, b_l))
    x_base = x_ptr + x_rows.to(gl.int64)[None, :] * stride_x + kb[:, None]
    x_mask = t_mask_b[None, :]
    r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, a_l))
    if SWIGLU:
        col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
        w_rows = col + ((r // 8) % 2) * n_out
    else:
        col = pid_n * BLOCK_N + r
        w_rows = col
    w_mask = (col < n_out)[:, None]
    ka = gl.arange(0, KC, layout=gl.SliceLayout(0, a_l))
    w_off = gl.multiple_of((w_rows // RB) * stride_wb + (w_rows % RB) * (CHUNK // 2), CHUNK // 2)
    s_off = gl.multiple_of((w_rows // RB) * stride_sb + (w_rows % RB) * (CHUNK // 16), CHUNK // 16)
    w_base = w_ptr + expert.to(gl.int64) * stride_we + w_off[:, None] + ka[None, :]
    s_base = w_scale_ptr + expert.to(gl.int64) * stride_se + s_off[:, None] + (ka // 8)[None, :]
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    for k0 in range(0, K, BLOCK_K):
        chunk = k0 // CHUNK
        within = k0 % CHUNK
        w_k = gl.multiple_of(chunk * stride_wc + within // 2, BLOCK_K // 2)
        s_k = gl.multiple_of(chunk * stride_sc + within // 16, BLOCK_K // 16)
        codes = gl.load(w_base + w_k, mask=w_mask, other=0)
        scale = gl.load(s_base + s_k, mask=w_mask, other=0)
        scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        xe = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
        xo = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
        even, odd = _pairs(codes)
        acc = gl.nvidia.ampere.mma_v2(even * scale, xe, acc)
        acc = gl.nvidia.ampere.mma_v2(odd * scale, xo, acc)
    out = acc * (4096.0 * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert))
    t_o = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma))
    r_o = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
    if SWIGLU:
        col_o = pid_n * BLOCK_N + (r_o // 16) * 8 + r_o % 8
    else:
        col_o = pid_n * BLOCK_N + r_o
    ptrs = y_ptr + t_o.to(gl.int64)[None, :] * stride_y + col_o[:, None]
    mask = (t_o < end_row)[None, :] & (col_o < n_out)[:, None]
    if ROW_WEIGHTS:
        t_mask_o = t_o < end_row
        if WEIGHT_IDS:
            wid = gl.load(weight_ids_ptr + t_o, mask=t_mask_o, other=0)
        else:
            wid = t_o
        rw = gl.zeros_like(out) + gl.load(row_weights_ptr + wid, mask=t_mask_o, other=0.0).to(gl.float32)[None, :]
    if SWIGLU:
        gate, up = _gate_part(out, W_ROWS, BLOCK_T)
        out = gate / (1.0 + gl.exp(-gate)) * up
        ptrs, _ = _gate_part(ptrs, W_ROWS, BLOCK_T)
        mask, _ = _gate_part(mask, W_ROWS, BLOCK_T)
        if ROW_WEIGHTS:
            rw, _ = _gate_part(rw, W_ROWS, BLOCK_T)
    if ROW_WEIGHTS:
        out = out * rw
    gl.store(ptrs, out.to(gl.bfloat16), mask=mask)


def grouped(act, w_q, chunked, C, RB, counts, row_ids=None, row_weights=None, swiglu=False, row_weight_ids=None,
            BLOCK_T=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, maxnreg=None, PDL=False):
    E, N, K = w_q.shape
    data, scale = chunked
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=torch.bfloat16, device=w_q.device)
    dummy = counts
    grid = (triton.cdiv(n_rows, BLOCK_T) + min(E, n_rows), triton.cdiv(n_out, BLOCK_N))
    kernel[grid](operand, act.global_scale, row_ids if row_ids is not None else dummy,
                 row_weights if row_weights is not None else dummy,
                 row_weight_ids if row_weight_ids is not None else dummy, data, scale,
                 w_q.global_scale, counts, y, N, K, E, operand.stride(0), operand.stride(1),
                 data.stride(0), data.stride(1), data.stride(2), scale.stride(0), scale.stride(1), scale.stride(2),
                 y.stride(0), GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
                 WEIGHT_IDS=row_weight_ids is not None, SWIGLU=swiglu,
                 E_POW2=max(2, triton.next_power_of_2(E)), CHUNK=C, RB=RB, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
                 BLOCK_K=BLOCK_K, NUM_WARPS=num_warps, PDL=PDL, num_warps=num_warps, launch_pdl=PDL,
                 **({'maxnreg': maxnreg} if maxnreg else {}))
    return y
