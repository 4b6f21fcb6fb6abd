"""Prototype: the dense decode layer (M <= 8, x quantized in the prologue) as a Gluon kernel."""
import torch, triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
import rac, nvfp4
from rac import (_gluon_e2m1_pairs, _gluon_wait_for_previous_kernel, _EPILOGUE, _SHIFT, _FUSED,
                 _scale_from_amax, _mul_rn)
from nvfp4 import _load_pairs, _quantize_pairs, _e2m1_value


@gluon.jit
def _gluon_quantized_rows(x_ptr, x_words_ptr, rac_mask_ptr, M, K, k_begin, even_smem, odd_smem,
                          HAS_RESIDUAL: gl.constexpr, X_BF16: gl.constexpr, KS: gl.constexpr,
                          NUM_WARPS: gl.constexpr, NO_AMAX: gl.constexpr):
    """x's global scale from all M * K elements; this split's KS columns of the (up to 8) rows quantized as the
    layer's quantizer does, stored to shared memory as (KS / 2, 8) fp16 even and odd operand planes."""
    if NO_AMAX:
        x_global = 1.0
    else:
        flat: gl.constexpr = gl.BlockedLayout([8], [32], [NUM_WARPS], [0])
        offs = gl.arange(0, _FUSED, layout=flat)
        v = gl.abs(gl.load(x_ptr + offs, mask=offs < M * K, other=0.0).to(gl.float32))
        x_global = _scale_from_amax(gl.max(gl.where(v == v, v, float("inf")), axis=0))
    GS: gl.constexpr = KS // 16
    pairs_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NUM_WARPS, 1], [1, 0])
    idx = gl.arange(0, 8 * GS, layout=gl.SliceLayout(1, pairs_layout))
    row, block = idx // GS, k_begin // 16 + idx % GS
    in_range = (row < M) & (block < K // 16)
    blocks = row.to(gl.int64) * (K // 16) + block
    pairs = gl.arange(0, 8, layout=gl.SliceLayout(0, pairs_layout))
    even, odd = _load_pairs(x_words_ptr, blocks, pairs, in_range[:, None], X_BF16)
    code_even, code_odd, block_scale, _ = _quantize_pairs(even, odd, x_global)
    value_even = _e2m1_value(code_even) * block_scale[:, None]
    value_odd = _e2m1_value(code_odd) * block_scale[:, None]
    if HAS_RESIDUAL:
        keep = (gl.load(rac_mask_ptr + block, mask=in_range, other=0) != 0)[:, None]
        res_even = gl.where(keep, even - _mul_rn(value_even, x_global, True), 0.0)
        res_odd = gl.where(keep, odd - _mul_rn(value_odd, x_global, True), 0.0)
        r_even, r_odd, r_scale, _ = _quantize_pairs(res_even, res_odd, x_global)
        value_even += _e2m1_value(r_even) * r_scale[:, None]
        value_odd += _e2m1_value(r_odd) * r_scale[:, None]
    even_smem.store(gl.permute(gl.reshape((value_even * _SHIFT).to(gl.float16), (8, KS // 2)), (1, 0)))
    odd_smem.store(gl.permute(gl.reshape((value_odd * _SHIFT).to(gl.float16), (8, KS // 2)), (1, 0)))
    return x_global


@gluon.jit
def dense_gluon_kernel(x_ptr, x_words_ptr, rac_mask_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr,
                       workspace_ptr, counter_ptr, M, N, K, N1, N2, x_plane, stride_x, stride_w, stride_ws,
                       FUSED: gl.constexpr, HAS_RESIDUAL: gl.constexpr, X_BF16: gl.constexpr, PDL: gl.constexpr,
                       BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STEPS: gl.constexpr,
                       NUM_WARPS: gl.constexpr, LOAD_FIRST: gl.constexpr, DROP: gl.constexpr):
    # DROP (timing variants): 1 no amax (global 1), 2 no quantization (zeros), 3 no weight loads, 4 empty
    T: gl.constexpr = BLOCK_T
    KC: gl.constexpr = BLOCK_K // 2
    KS: gl.constexpr = BLOCK_K * STEPS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1])
    if PDL:
        _gluon_wait_for_previous_kernel()
    if DROP == 4:
        return
    pid, pid_k = gl.program_id(0), gl.program_id(1)
    m_tiles = gl.cdiv(M, BLOCK_T)
    pid_m, pid_n = pid % m_tiles, pid // m_tiles   # the row tiles of one weight tile run together
    row0 = pid_m * BLOCK_T
    n_splits = gl.num_programs(1)
    k_begin = pid_k * KS
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    cols = pid_n * BLOCK_N + r
    w_mask = (cols < N)[:, None]
    kb = gl.arange(0, KC, layout=gl.SliceLayout(0, w_layout))
    w_base = w_ptr + cols.to(gl.int64)[:, None] * stride_w + (k_begin // 2 + kb)[None, :]
    s_base = w_scale_ptr + cols.to(gl.int64)[:, None] * stride_ws + (k_begin // 16 + kb // 8)[None, :]
    if LOAD_FIRST:
        codes0 = gl.load(w_base, mask=w_mask, other=0)
        scale0 = gl.load(s_base, mask=w_mask, other=0)
    if FUSED:
        even_smem = gl.allocate_shared_memory(gl.float16, [KS // 2, T], smem_layout)
        odd_smem = gl.allocate_shared_memory(gl.float16, [KS // 2, T], smem_layout)
        if DROP == 2:
            x_global = 1.0
            zero = gl.zeros((KS // 2, T), gl.float16, layout=x_layout)
            even_smem.store(zero)
            odd_smem.store(zero)
        else:
            x_global = _gluon_quantized_rows(x_ptr, x_words_ptr, rac_mask_ptr, M, K, k_begin, even_smem,
                                             odd_smem, HAS_RESIDUAL, X_BF16, KS, NUM_WARPS, DROP == 1)
        gl.thread_barrier()
    else:
        x_global = gl.load(x_global_ptr)
        t_x = row0 + gl.arange(0, T, layout=gl.SliceLayout(0, x_layout))
        x_base = (x_ptr + t_x.to(gl.int64)[None, :] * stride_x
                  + (k_begin // 2 + gl.arange(0, KC, layout=gl.SliceLayout(1, x_layout)))[:, None])
        x_mask = (t_x < M)[None, :]
    acc = gl.zeros((BLOCK_N, T), gl.float32, layout=mma)
    if FUSED:
        for s in gl.static_range(STEPS):
            if LOAD_FIRST and s == 0:
                codes, scale = codes0, scale0
            elif DROP == 3:
                codes = gl.full((BLOCK_N, KC), s, gl.uint8, layout=w_layout)
                scale = gl.full((BLOCK_N, KC), 56, gl.uint8, layout=w_layout)
            else:
                codes = gl.load(w_base + s * KC, mask=w_mask, other=0)
                scale = gl.load(s_base + s * (BLOCK_K // 16), mask=w_mask, other=0)
            scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            x_even = even_smem.slice(s * KC, KC, dim=0).load(x_layout)
            x_odd = odd_smem.slice(s * KC, KC, dim=0).load(x_layout)
            w_even, w_odd = _gluon_e2m1_pairs(codes)
            acc = gl.nvidia.ampere.mma_v2(w_even * scale, x_even, acc)
            acc = gl.nvidia.ampere.mma_v2(w_odd * scale, x_odd, acc)
    else:
        for k in range(0, gl.minimum(KS, K - k_begin), BLOCK_K):
            codes = gl.load(w_base + k // 2, mask=w_mask, other=0)
            scale = gl.load(s_base + k // 16, mask=w_mask, other=0)
            scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            x_even = gl.load(x_base + k // 2, mask=x_mask, other=0.0)
            x_odd = gl.load(x_base + x_plane + k // 2, mask=x_mask, other=0.0)
            w_even, w_odd = _gluon_e2m1_pairs(codes)
            acc = gl.nvidia.ampere.mma_v2(w_even * scale, x_even, acc)
            acc = gl.nvidia.ampere.mma_v2(w_odd * scale, x_odd, acc)
    # epilogue: (BLOCK_N, T) -> y rows < M; columns of up to three stacked weights (N1, N2)
    r_y = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    t_y = row0 + gl.arange(0, T, layout=gl.SliceLayout(0, mma))
    col_y = pid_n * BLOCK_N + r_y
    which = (col_y >= N1).to(gl.int32) + (col_y >= N2).to(gl.int32)
    start = gl.where(which == 0, 0, gl.where(which == 1, N1, N2)).to(gl.int64)
    end = gl.where(which == 0, N1, gl.where(which == 1, N2, N)).to(gl.int64)
    y_offs = M * start[:, None] + t_y.to(gl.int64)[None, :] * (end - start)[:, None] + (col_y - start)[:, None]
    y_mask = (col_y < N)[:, None] & (t_y < M)[None, :]
    scale_y = _EPILOGUE * x_global * gl.load(w_global_ptr + which, mask=col_y < N, other=0.0)[:, None]
    if n_splits == 1:
        gl.store(y_ptr + y_offs, (acc * scale_y).to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile: gl.constexpr = BLOCK_N * T
        offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))[:, None] * T + \
            gl.arange(0, T, layout=gl.SliceLayout(0, mma))[None, :]
        part = workspace_ptr + pid.to(gl.int64) * (n_splits * tile) + offs
        gl.store(part + pid_k * tile, acc)
        gl.thread_barrier()
        arrived = gl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        gl.thread_barrier()
        if arrived == n_splits - 1:
            total = gl.zeros((BLOCK_N, T), gl.float32, layout=mma)
            for split in range(n_splits):
                total += gl.load(part + split * tile, cache_modifier=".cg")
            gl.atomic_xchg(counter_ptr + pid, 0)
            gl.store(y_ptr + y_offs, (total * scale_y).to(y_ptr.dtype.element_ty), mask=y_mask)


_COUNTERS = {}


def dense_gluon(x, w_q, rac_mask=None, out_dtype=torch.bfloat16, splits=None, act=None, BLOCK_T=8, BLOCK_N=64,
                BLOCK_K=256, STEPS=1, num_warps=4, LOAD_FIRST=False, pdl=False, DROP=0):
    """x (M, K) quantized inside (act None, M <= 8), or act: the quantizer's Activation."""
    fused = act is None
    M, K = x.shape if fused else (act.operand.shape[1], act.operand.shape[2] * 2)
    N = w_q.shape[0]
    if fused:
        assert M <= 8 and M * K <= rac.FUSED_ELEMENTS and BLOCK_T == 8
        x = nvfp4._contiguous_pairs(x)
    w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
    y = torch.empty(M * N, dtype=out_dtype, device=w_data.device)
    programs, n_splits = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, BLOCK_T), triton.cdiv(K, BLOCK_K * STEPS)
    dev = w_data.device
    if dev not in _COUNTERS:
        _COUNTERS[dev] = torch.zeros(8192, dtype=torch.int32, device=dev)
    counters = _COUNTERS[dev]
    ws = torch.empty(programs * n_splits * BLOCK_N * BLOCK_T if n_splits > 1 else 1, dtype=torch.float32, device=dev)
    mask = rac_mask.view(torch.uint8) if rac_mask is not None else w_data
    N1, N2 = rac._column_splits(w_q, splits)
    if fused:
        xa = (x, nvfp4._pair_view(x), mask, w_q.global_scale)
        x_plane, stride_x = 0, 0
    else:
        xa = (act.operand, act.operand, mask, act.global_scale)
        x_plane, stride_x = act.operand.stride(0), act.operand.stride(1)
    dense_gluon_kernel[(programs, n_splits)](
        *xa, w_data, w_scale, w_q.global_scale.reshape(-1), y, ws, counters,
        M, N, K, N1, N2, x_plane, stride_x, w_data.stride(0), w_scale.stride(0), FUSED=fused,
        HAS_RESIDUAL=rac_mask is not None, X_BF16=fused and x.dtype == torch.bfloat16, PDL=pdl,
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STEPS=STEPS,
        NUM_WARPS=num_warps, LOAD_FIRST=LOAD_FIRST, DROP=DROP, num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}))
    return rac._split_output(y, M, N, splits)
