"""Prototype: the experts' grouped GEMM in Gluon (Hopper/Ampere mma.sync), weight rows on the MMA's left.
Each program: (expert, tile of BLOCK_T sorted rows) x (BLOCK_N output columns). The codes are loaded straight
into the left operand's register layout (k_width 8: 8 consecutive bytes a row, one NVFP4 block per run) and
decoded in registers; the activation rows are the right operand, loaded from the fp16 operand planes."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _pairs(packed):
    even, odd = gl.inline_asm_elementwise(
        asm="""
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
        """,
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    return even, odd


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_tile(counts_ptr, E, pid_m, BLOCK_T: gl.constexpr, E_POW2: gl.constexpr, NUM_WARPS: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    experts = gl.arange(0, E_POW2, layout=lay)
    counts = gl.load(counts_ptr + experts, mask=experts < E, other=0).to(gl.int64)
    packed = (((counts + BLOCK_T - 1) // BLOCK_T) << 32) + counts
    ends = gl.associative_scan(packed, 0, _add)
    expert = gl.sum(((ends >> 32) <= pid_m).to(gl.int32), axis=0)
    start = gl.sum(gl.where(experts == expert, ends - packed, 0), axis=0)
    first_tile = start >> 32
    first_row = (start - (first_tile << 32)).to(gl.int32)
    rows = gl.sum(gl.where(experts == expert, counts, 0), axis=0).to(gl.int32)
    return expert, first_row + (pid_m - first_tile.to(gl.int32)) * BLOCK_T, first_row + rows


@gluon.jit
def _gate_part(t, W_ROWS: gl.constexpr, BLOCK_T: gl.constexpr):
    """(W_ROWS, T) with gate/up rows interleaved by 8 -> the gate half and the up half, (W_ROWS/2, T) each."""
    t4 = gl.permute(gl.reshape(t, (W_ROWS // 16, 2, 8, BLOCK_T)), (0, 2, 3, 1))
    gate, up = gl.split(t4)
    return gl.reshape(gate, (W_ROWS // 2, BLOCK_T)), gl.reshape(up, (W_ROWS // 2, BLOCK_T))


@gluon.jit
def grouped_kernel(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
                   w_global_ptr, counts_ptr, y_ptr,
                   N, K, E, x_plane, stride_x, stride_we, stride_w, stride_wse, stride_ws, stride_y,
                   GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
                   SWIGLU: gl.constexpr, E_POW2: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr,
                   PREFETCH: gl.constexpr, PREFETCH_X: gl.constexpr):
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    n_out = N // 2 if SWIGLU else N
    # the activation rows: the right operand's columns
    t_b = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, b_l))
    t_mask_b = t_b < end_row
    if GATHER:
        x_rows = gl.load(row_ids_ptr + t_b, mask=t_mask_b, other=0)
    else:
        x_rows = t_b.to(gl.int64)
    kb = gl.arange(0, KC, layout=gl.SliceLayout(1, b_l))
    x_base = x_ptr + x_rows.to(gl.int64)[None, :] * stride_x + kb[:, None]
    x_mask = t_mask_b[None, :]
    # the weight rows: the left operand's rows (SwiGLU: 8 gate rows, then their 8 up rows, ...)
    r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, a_l))
    if SWIGLU:
        col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
        w_rows = col + ((r // 8) % 2) * n_out
    else:
        col = pid_n * BLOCK_N + r
        w_rows = col
    w_mask = (col < n_out)[:, None]
    ka = gl.arange(0, KC, layout=gl.SliceLayout(0, a_l))
    w_base = w_ptr + expert.to(gl.int64) * stride_we + w_rows.to(gl.int64)[:, None] * stride_w + ka[None, :]
    ws_base = (w_scale_ptr + expert.to(gl.int64) * stride_wse + w_rows.to(gl.int64)[:, None] * stride_ws
               + (ka // 8)[None, :])
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    if PREFETCH:
        codes = gl.load(w_base, mask=w_mask, other=0)
        sb = gl.load(ws_base, mask=w_mask, other=0)
        if PREFETCH_X:
            xe = gl.load(x_base, mask=x_mask, other=0.0)
            xo = gl.load(x_base + x_plane, mask=x_mask, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            nk = k0 + BLOCK_K
            pmask = w_mask & (nk < K)
            codes_n = gl.load(w_base + nk // 2, mask=pmask, other=0)
            sb_n = gl.load(ws_base + nk // 16, mask=pmask, other=0)
            if PREFETCH_X:
                xmask_n = x_mask & (nk < K)
                xe_n = gl.load(x_base + nk // 2, mask=xmask_n, other=0.0)
                xo_n = gl.load(x_base + x_plane + nk // 2, mask=xmask_n, other=0.0)
            else:
                xe = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
                xo = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
            scale = sb.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            even, odd = _pairs(codes)
            acc = gl.nvidia.ampere.mma_v2(even * scale, xe, acc)
            acc = gl.nvidia.ampere.mma_v2(odd * scale, xo, acc)
            codes = codes_n
            sb = sb_n
            if PREFETCH_X:
                xe = xe_n
                xo = xo_n
    else:
        for k0 in range(0, K, BLOCK_K):
            codes = gl.load(w_base + k0 // 2, mask=w_mask, other=0)
            scale = gl.load(ws_base + k0 // 16, mask=w_mask, other=0).to(gl.float8e4nv, bitcast=True).to(gl.float16)
            xe = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
            xo = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
            even, odd = _pairs(codes)
            acc = gl.nvidia.ampere.mma_v2(even * scale, xe, acc)
            acc = gl.nvidia.ampere.mma_v2(odd * scale, xo, acc)
    # epilogue: scales, SwiGLU, router weights, bf16 (round to nearest even)
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


def grouped_matmul(act, w_q, counts, row_ids=None, row_weights=None, swiglu=False, row_weight_ids=None,
                   BLOCK_T=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, PREFETCH=0, PREFETCH_X=0,
                   maxnreg=None):
    E, N, K = w_q.shape
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=torch.bfloat16, device=w_q.device)
    w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
    dummy = counts
    grid = (triton.cdiv(n_rows, BLOCK_T) + min(E, n_rows), triton.cdiv(n_out, BLOCK_N))
    grouped_kernel[grid](operand, act.global_scale, row_ids if row_ids is not None else dummy,
                         row_weights if row_weights is not None else dummy,
                         row_weight_ids if row_weight_ids is not None else dummy, w_data, w_scale,
                         w_q.global_scale, counts, y, N, K, E, operand.stride(0), operand.stride(1),
                         w_data.stride(0), w_data.stride(1), w_scale.stride(0), w_scale.stride(1), y.stride(0),
                         GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
                         WEIGHT_IDS=row_weight_ids is not None, SWIGLU=swiglu,
                         E_POW2=max(2, triton.next_power_of_2(E)), BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K, NUM_WARPS=num_warps, num_warps=num_warps,
                         PREFETCH=PREFETCH, PREFETCH_X=PREFETCH_X, **({'maxnreg': maxnreg} if maxnreg else {}))
    return y


@gluon.jit
def _issue(w_smem, x_smem, slot, k0, K, w_ptrs, w_ok, x_ptrs, x_ok, x_plane):
    ok = k0 < K
    gl.nvidia.ampere.async_copy.async_copy_global_to_shared(w_smem.index(slot), w_ptrs + k0 // 2, mask=w_ok & ok)
    gl.nvidia.ampere.async_copy.async_copy_global_to_shared(x_smem.index(2 * slot), x_ptrs + k0 // 2,
                                                            mask=x_ok & ok)
    gl.nvidia.ampere.async_copy.async_copy_global_to_shared(x_smem.index(2 * slot + 1), x_ptrs + x_plane + k0 // 2,
                                                            mask=x_ok & ok)
    gl.nvidia.ampere.async_copy.commit_group()


@gluon.jit
def grouped_kernel_cp(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
                      w_global_ptr, counts_ptr, y_ptr,
                      N, K, E, x_plane, stride_x, stride_we, stride_w, stride_wse, stride_ws, stride_y,
                      GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
                      SWIGLU: gl.constexpr, E_POW2: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr, STAGES: gl.constexpr):
    """cp.async ring of STAGES (codes, activation) tiles in shared memory; SwiGLU: gate and up rows as two
    accumulators of BLOCK_N rows each (the tile holds 2 BLOCK_N weight rows: gate rows then up rows)."""
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    # copy layouts: 16 bytes a thread
    wc_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // KC, KC // 16], [NUM_WARPS, 1], [1, 0])
    xc_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // KC, KC // 8], [NUM_WARPS, 1], [1, 0])
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    n_out = N // 2 if SWIGLU else N
    # copy pointers: weight rows (gate rows, then up rows) and activation rows
    rc = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, wc_l))
    if SWIGLU:
        colc = pid_n * BLOCK_N + rc % BLOCK_N
        w_rows = colc + (rc // BLOCK_N) * n_out
    else:
        colc = pid_n * BLOCK_N + rc
        w_rows = colc
    kc = gl.arange(0, KC, layout=gl.SliceLayout(0, wc_l))
    w_ptrs = w_ptr + expert.to(gl.int64) * stride_we + w_rows.to(gl.int64)[:, None] * stride_w + kc[None, :]
    w_ok = (colc < n_out)[:, None]
    tc = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, xc_l))
    tc_ok = tc < end_row
    if GATHER:
        xr = gl.load(row_ids_ptr + tc, mask=tc_ok, other=0)
    else:
        xr = tc.to(gl.int64)
    kx = gl.arange(0, KC, layout=gl.SliceLayout(0, xc_l))
    x_ptrs = x_ptr + xr.to(gl.int64)[:, None] * stride_x + kx[None, :]
    x_ok = tc_ok[:, None]
    # block scales: read straight from global memory in the operand's layout, one step ahead
    ra = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, KC, layout=gl.SliceLayout(0, a_l))
    s_ok = (pid_n * BLOCK_N + ra < n_out)[:, None]
    s_base = (w_scale_ptr + expert.to(gl.int64) * stride_wse + (pid_n * BLOCK_N + ra).to(gl.int64)[:, None] * stride_ws
              + (ka // 8)[None, :])
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W_ROWS, KC], w_sl)
    x_smem = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_T, KC], x_sl)
    for s in gl.static_range(STAGES - 1):
        _issue(w_smem, x_smem, s, s * BLOCK_K, K, w_ptrs, w_ok, x_ptrs, x_ok, x_plane)
    acc = gl.zeros((BLOCK_N, BLOCK_T), gl.float32, layout=mma)
    acc_up = gl.zeros((BLOCK_N, BLOCK_T), gl.float32, layout=mma)
    sg = gl.load(s_base, mask=s_ok, other=0)
    if SWIGLU:
        su = gl.load(s_base + n_out * stride_ws, mask=s_ok, other=0)
    n_steps = K // BLOCK_K
    for i in range(n_steps):
        gl.nvidia.ampere.async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        _issue(w_smem, x_smem, (i + STAGES - 1) % STAGES, (i + STAGES - 1) * BLOCK_K, K, w_ptrs, w_ok, x_ptrs,
               x_ok, x_plane)
        nk = (i + 1) * BLOCK_K
        sg_n = gl.load(s_base + nk // 16, mask=s_ok & (nk < K), other=0)
        if SWIGLU:
            su_n = gl.load(s_base + n_out * stride_ws + nk // 16, mask=s_ok & (nk < K), other=0)
        slot = i % STAGES
        ws = w_smem.index(slot)
        xe = x_smem.index(2 * slot).permute((1, 0)).load(b_l)
        xo = x_smem.index(2 * slot + 1).permute((1, 0)).load(b_l)
        even, odd = _pairs(ws.slice(0, BLOCK_N, dim=0).load(a_l))
        scale = sg.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        acc = gl.nvidia.ampere.mma_v2(even * scale, xe, acc)
        acc = gl.nvidia.ampere.mma_v2(odd * scale, xo, acc)
        if SWIGLU:
            even, odd = _pairs(ws.slice(BLOCK_N, BLOCK_N, dim=0).load(a_l))
            scale = su.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            acc_up = gl.nvidia.ampere.mma_v2(even * scale, xe, acc_up)
            acc_up = gl.nvidia.ampere.mma_v2(odd * scale, xo, acc_up)
            su = su_n
        sg = sg_n
    gl.nvidia.ampere.async_copy.wait_group(0)
    # epilogue
    scale = 4096.0 * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert)
    out = acc * scale
    if SWIGLU:
        up = acc_up * scale
        out = out / (1.0 + gl.exp(-out)) * up
    t_o = row0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma))
    col_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    t_ok = t_o < end_row
    if ROW_WEIGHTS:
        if WEIGHT_IDS:
            wid = gl.load(weight_ids_ptr + t_o, mask=t_ok, other=0)
        else:
            wid = t_o
        out = out * gl.load(row_weights_ptr + wid, mask=t_ok, other=0.0).to(gl.float32)[None, :]
    gl.store(y_ptr + t_o.to(gl.int64)[None, :] * stride_y + col_o[:, None], out.to(gl.bfloat16),
             mask=t_ok[None, :] & (col_o < n_out)[:, None])


def grouped_matmul_cp(act, w_q, counts, row_ids=None, row_weights=None, swiglu=False, row_weight_ids=None,
                      BLOCK_T=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, STAGES=3, maxnreg=None):
    E, N, K = w_q.shape
    assert K % BLOCK_K == 0
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=torch.bfloat16, device=w_q.device)
    w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
    dummy = counts
    grid = (triton.cdiv(n_rows, BLOCK_T) + min(E, n_rows), triton.cdiv(n_out, BLOCK_N))
    grouped_kernel_cp[grid](operand, act.global_scale, row_ids if row_ids is not None else dummy,
                            row_weights if row_weights is not None else dummy,
                            row_weight_ids if row_weight_ids is not None else dummy, w_data, w_scale,
                            w_q.global_scale, counts, y, N, K, E, operand.stride(0), operand.stride(1),
                            w_data.stride(0), w_data.stride(1), w_scale.stride(0), w_scale.stride(1), y.stride(0),
                            GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
                            WEIGHT_IDS=row_weight_ids is not None, SWIGLU=swiglu,
                            E_POW2=max(2, triton.next_power_of_2(E)), BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
                            BLOCK_K=BLOCK_K, NUM_WARPS=num_warps, STAGES=STAGES, num_warps=num_warps,
                            **({'maxnreg': maxnreg} if maxnreg else {}))
    return y


@gluon.jit
def grouped_kernel_tiled(x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
                         w_global_ptr, counts_ptr, y_ptr,
                         N, K, E, x_plane, stride_x, stride_y,
                         GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
                         SWIGLU: gl.constexpr, E_POW2: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The plain kernel on weights stored tile by tile: (E, N tiles, K steps, W_ROWS, BLOCK_K/2) codes and
    (E, N tiles, K steps, W_ROWS, BLOCK_K/16) scales, so that each K step of a program reads one contiguous
    block (the rows in the kernel's order: SwiGLU's 8 gate rows, then their 8 up rows, ...)."""
    W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    KC: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
    if expert >= E:
        return
    n_out = N // 2 if SWIGLU else N
    n_tiles = gl.cdiv(n_out, BLOCK_N)
    k_steps = K // BLOCK_K
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
    ka = gl.arange(0, KC, layout=gl.SliceLayout(0, a_l))
    tile = (expert.to(gl.int64) * n_tiles + pid_n) * k_steps
    w_base = w_ptr + tile * (W_ROWS * KC) + (r * KC)[:, None] + ka[None, :]
    ws_base = w_scale_ptr + tile * (W_ROWS * KC // 8) + (r * (KC // 8))[:, None] + (ka // 8)[None, :]
    acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
    for step in range(0, k_steps):
        codes = gl.load(w_base + step * (W_ROWS * KC))
        scale = gl.load(ws_base + step * (W_ROWS * KC // 8)).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        k0 = step * BLOCK_K
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


def tile_weights(w_q, swiglu, BLOCK_N, BLOCK_K):
    """(E, N, K/2) codes and (E, N, K/16) scales -> tile by tile, rows in the tiled kernel's order."""
    E, N, K = w_q.shape
    n_out = N // 2 if swiglu else N
    W_ROWS = 2 * BLOCK_N if swiglu else BLOCK_N
    n_tiles, k_steps, KC = n_out // BLOCK_N, K // BLOCK_K, BLOCK_K // 2
    r = torch.arange(W_ROWS, device=w_q.data.device)
    p = torch.arange(n_tiles, device=r.device)[:, None]
    if swiglu:
        rows = p * BLOCK_N + (r // 16) * 8 + r % 8 + ((r // 8) % 2) * n_out
    else:
        rows = p * BLOCK_N + r
    data = w_q.data[:, rows.reshape(-1)]                                          # (E, n_tiles * W_ROWS, K/2)
    data = data.reshape(E, n_tiles, W_ROWS, k_steps, KC).permute(0, 1, 3, 2, 4).contiguous()
    scale = w_q.block_scale.view(torch.uint8)[:, rows.reshape(-1)]
    scale = scale.reshape(E, n_tiles, W_ROWS, k_steps, KC // 8).permute(0, 1, 3, 2, 4).contiguous()
    return data, scale


def grouped_matmul_tiled(act, w_q, tiled, counts, row_ids=None, row_weights=None, swiglu=False,
                         row_weight_ids=None, BLOCK_T=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, maxnreg=None):
    E, N, K = w_q.shape
    data, scale = tiled
    operand = act.operand
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=torch.bfloat16, device=w_q.device)
    dummy = counts
    grid = (triton.cdiv(n_rows, BLOCK_T) + min(E, n_rows), triton.cdiv(n_out, BLOCK_N))
    grouped_kernel_tiled[grid](operand, act.global_scale, row_ids if row_ids is not None else dummy,
                               row_weights if row_weights is not None else dummy,
                               row_weight_ids if row_weight_ids is not None else dummy, data, scale,
                               w_q.global_scale, counts, y, N, K, E, operand.stride(0), operand.stride(1),
                               y.stride(0), GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
                               WEIGHT_IDS=row_weight_ids is not None, SWIGLU=swiglu,
                               E_POW2=max(2, triton.next_power_of_2(E)), BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
                               BLOCK_K=BLOCK_K, NUM_WARPS=num_warps, num_warps=num_warps,
                               **({'maxnreg': maxnreg} if maxnreg else {}))
    return y
