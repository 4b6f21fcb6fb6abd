"""The W4A4 activation quantizer: x (M, K) -> NVFP4 codes of x and of its RAC residual, and the fp16 operand
the Hopper GEMMs multiply. The codes equal rac.quantize_activation_reference bit for bit (the arithmetic of
nvfp4.quantize_reference); the operand is their values, (DQ(x_q) + DQ(r_q)) / g * 2^-6 rounded once to fp16.

Per 16-element block b of x, with the dynamic global scale g = amax(|x|) / (6 * 448):

    s_b   = e4m3(amax(|x_b|) / 6 / g)              the block scale
    q_b   = rne_e2m1(x_b / (s_b * g))              the codes (ties to even, saturating at 6)
    r_b   = x_b - q_b * s_b * g                    the residual, on the blocks rac_mask selects (else 0)
    r_q   = the same two lines on r_b, with g      (a residual block is 6-16x smaller: its scale fits)
    op_b  = (q_b * s_b + r_q * s_r) * 2^-6         the operand, fp16: each term is exact, the sum rounds

A program quantizes BLOCKS blocks of the flattened (M * G, 16) input as two (BLOCKS, 8) tiles of even and odd
elements: a bf16 pair is one 32-bit load, a packed byte is code(even) | code(odd) << 4, and the operand is
written as two planes (2, M, K/2) of even and odd columns, the order in which a packed weight byte holds its
two codes (gpu_kernels/w4a4_dense.py consumes K as those two halves). The global scale needs amax(|x|) before
any block: inputs up to AMAX_IN_LAUNCH elements are reduced by every program itself (they sit in L2); larger
ones by one partial-max launch ahead (at most 256 slices), whose maxima every program then reduces.

The format helpers below restate nvfp4.py's (a kernel file imports no project module); the tests hold
both to the same references bit for bit.
"""
import os

import torch
import triton
import triton.language as tl

# the format's arithmetic, shared with the NVFP4 quantizer (whose definition is nvfp4.py)
from gpu_kernels.nvfp4_quantize import _e2m1_value, _load_pairs, _quantize_pairs

BLOCK_SIZE = 16                   # NVFP4 block: 16 elements along K, one E4M3 scale
GLOBAL_SCALE_DIVISOR = 6.0 * 448.0  # 2688: global_scale = amax / (E2M1 max * E4M3 max)
OPERAND_SHIFT = 2.0 ** -6         # the Hopper kernels' fp16 operands hold value * block_scale * 2^-6
AMAX_IN_LAUNCH = 4096             # inputs up to this size (M * K): the quantizer reduces the amax itself
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_DIVISOR = tl.constexpr(GLOBAL_SCALE_DIVISOR)
_SHIFT = tl.constexpr(OPERAND_SHIFT)


# ------------------------------------------------------------------------------ the quantizer
# Reference: rac.quantize_activation_reference (codes; the operand is their values). A program
# quantizes BLOCKS 16-element blocks of the flattened (M * G, 16) input as two (BLOCKS, 8) tiles of
# even and odd elements (nvfp4.py's pair layout: a bf16 pair is one 32-bit load, and a packed byte
# is code(even) | code(odd) << 4) with nvfp4.py's own arithmetic: bit for bit the reference.
@triton.jit
def _scale_from_amax(amax):
    """nvfp4.compute_global_scale: amax / 2688, 1.0 for an all-zero input, NaN if not finite."""
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, _DIVISOR))
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _abs_max(x_ptr, start, stop, CHUNK: tl.constexpr):
    """max |x| over elements start..stop (a strided loop of CHUNK-wide loads); NaN counts as Inf."""
    running = tl.zeros((CHUNK,), dtype=tl.float32)
    for begin in range(start, stop, CHUNK):
        offs = begin + tl.arange(0, CHUNK)
        v = tl.abs(tl.load(x_ptr + offs, mask=offs < stop, other=0.0).to(tl.float32))
        running = tl.maximum(running, tl.where(v == v, v, float("inf")))
    return tl.max(running, axis=0)


@triton.jit
def _mul_rn(a, b, GPU: tl.constexpr):
    """a * b rounded to fp32 as a step of its own. A plain product followed by an addition is fused
    into one FMA by the GPU compiler, which skips that rounding (the reference makes it): mul.rn is never
    fused. Seen on the H200: RAC residual codes that differed from the reference's."""
    if GPU:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return a * b


@triton.jit
def _quantize_blocks(x_words_ptr, rac_mask_ptr, blocks, in_range, blocks_per_row, global_scale,
                     HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, GPU: tl.constexpr):
    """Flat block indices (BLOCKS,) -> codes and E4M3 bytes of x and of its RAC residual, and the
    operand values (DQ(x_q) + DQ(r_q)) / global_scale as fp32 (BLOCKS, 8) even and odd tiles."""
    pairs = tl.arange(0, 8)
    even, odd = _load_pairs(x_words_ptr, blocks, pairs, in_range[:, None], X_BF16)  # (BLOCKS, 8) each
    code_even, code_odd, block_scale, scale_byte = _quantize_pairs(even, odd, global_scale)
    value_even = _e2m1_value(code_even) * block_scale[:, None]
    value_odd = _e2m1_value(code_odd) * block_scale[:, None]
    r_even, r_odd, r_byte = code_even, code_odd, scale_byte  # (placeholders without a residual)
    if HAS_RESIDUAL:
        keep = (tl.load(rac_mask_ptr + blocks % blocks_per_row, mask=in_range, other=0) != 0)[:, None]
        res_even = tl.where(keep, even - _mul_rn(value_even, global_scale, GPU), 0.0)  # x - DQ(x_q)
        res_odd = tl.where(keep, odd - _mul_rn(value_odd, global_scale, GPU), 0.0)
        r_even, r_odd, r_scale, r_byte = _quantize_pairs(res_even, res_odd, global_scale)
        value_even += _e2m1_value(r_even) * r_scale[:, None]                         # exact in fp32
        value_odd += _e2m1_value(r_odd) * r_scale[:, None]
    return code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd


@triton.jit
def _store_codes(data_ptr, scale_ptr, blocks, in_range, code_even, code_odd, scale_byte):
    pairs = tl.arange(0, 8)
    tl.store(data_ptr + blocks[:, None] * 8 + pairs[None, :], (code_even | (code_odd << 4)).to(tl.uint8),
             mask=in_range[:, None])
    tl.store(scale_ptr + blocks, scale_byte.to(tl.uint8), mask=in_range)


@triton.jit
def _quantize_activation_kernel(
    # pointers: input (elements, and its pair view), selection, scales, outputs
    x_ptr, x_words_ptr, rac_mask_ptr, partial_amax_ptr, global_scale_ptr,
    data_ptr, block_scale_ptr, res_data_ptr, res_block_scale_ptr, operand_ptr,
    # sizes (plane_size: elements in one operand plane, M * K / 2)
    numel, n_blocks, blocks_per_row, n_partials, plane_size,
    # meta-parameters
    AMAX_HERE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, WRITE_CODES: tl.constexpr,
    WRITE_OPERAND: tl.constexpr, BLOCKS: tl.constexpr, CHUNK: tl.constexpr, PARTIALS: tl.constexpr,
    GPU: tl.constexpr,
):
    pid = tl.program_id(0)
    if AMAX_HERE:  # a small input: every program reduces all of it (L2-resident) itself
        global_scale = _scale_from_amax(_abs_max(x_ptr, 0, numel, CHUNK))
    else:          # the maxima of _partial_amax_kernel's slices
        idx = tl.arange(0, PARTIALS)
        partial = tl.load(partial_amax_ptr + idx, mask=idx < n_partials, other=0.0)
        global_scale = _scale_from_amax(tl.max(partial, axis=0))
    tl.store(global_scale_ptr, global_scale, mask=pid == 0)
    blocks = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < n_blocks
    code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd = _quantize_blocks(
        x_words_ptr, rac_mask_ptr, blocks, in_range, blocks_per_row, global_scale, HAS_RESIDUAL, X_BF16,
        GPU)
    if WRITE_CODES:
        _store_codes(data_ptr, block_scale_ptr, blocks, in_range, code_even, code_odd, scale_byte)
        if HAS_RESIDUAL:
            _store_codes(res_data_ptr, res_block_scale_ptr, blocks, in_range, r_even, r_odd, r_byte)
    if WRITE_OPERAND:  # fp16 planes, 16 contiguous bytes per block in each
        offs = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(operand_ptr + offs, (value_even * _SHIFT).to(tl.float16), mask=in_range[:, None])
        tl.store(operand_ptr + plane_size + offs, (value_odd * _SHIFT).to(tl.float16),
                 mask=in_range[:, None])


@triton.jit
def _partial_amax_kernel(x_ptr, partial_ptr, numel, SLICE: tl.constexpr, CHUNK: tl.constexpr):
    """One max |x| per program over a slice (no atomics, nothing to zero first)."""
    start = tl.program_id(0).to(tl.int64) * SLICE
    amax = _abs_max(x_ptr, start, tl.minimum(start + SLICE, numel), CHUNK)
    tl.store(partial_ptr + tl.program_id(0), amax)


# ------------------------------------------------------------------------------ launches
def empty_planes(rows, half_k, device):
    """An fp16 operand buffer (2, rows, K/2), the planes a multiple of 64 elements apart (16-byte aligned)."""
    plane = triton.cdiv(rows * half_k, 64) * 64
    return (torch.empty((2, plane), dtype=torch.float16, device=device)[:, :rows * half_k]
            .view(2, rows, half_k))


_AMAX_CHUNK = AMAX_IN_LAUNCH  # elements per load in the amax loops: small inputs in one load
_AMAX_SLICES = 256       # at most this many partial maxima: every quantizer program reads all of them


def _partial_chunk(numel):
    """Elements per load of the partial-max launch. A program's loads over its slice wait one for another
    (plain loads are not pipelined), so inputs that would take more than two chunks a slice take chunks 4x
    wider: on the H200 the quantizer of 4096 x 4096 takes 47 instead of 57 us; decode-sized inputs are faster
    with the narrow chunk."""
    return _AMAX_CHUNK * (4 if numel > 2 * _AMAX_SLICES * _AMAX_CHUNK else 1)


def _partial_amax(x):
    """max |x| over each of at most _AMAX_SLICES slices of the flattened x, one launch -> (slices,) fp32."""
    chunk = _partial_chunk(x.numel())
    slice_ = chunk * triton.cdiv(triton.cdiv(x.numel(), chunk), _AMAX_SLICES)
    partials = torch.empty(triton.cdiv(x.numel(), slice_), dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(partials.numel(),)](x, partials, x.numel(), SLICE=slice_, CHUNK=chunk)
    return partials


def quantize_activation(x, rac_mask=None, codes=False, operand=True):
    """x (M, K) bf16/fp16/fp32, rac_mask (G,) bool or None -> (data, block_scale, residual_data,
    residual_block_scale, operand, global_scale): the packed codes (M, K/2) uint8 and E4M3 block scales
    (M, G) of x and of its residual (codes=True; the residual's None without a mask), the fp16 operand
    planes (2, M, K/2) (operand=True), the global scale () fp32; what is not asked for is None."""
    x = x.contiguous()
    if x.dtype == torch.bfloat16 and x.data_ptr() % 4:
        x = x.clone()  # int32 pair loads need 4-byte alignment (an odd-offset view)
    M, K = x.shape
    n_blocks, device = M * K // BLOCK_SIZE, x.device
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    data = block_scale = res_data = res_block_scale = out_operand = None
    if codes:
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
        block_scale = torch.empty((M, K // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device)
        if rac_mask is not None:
            res_data, res_block_scale = torch.empty_like(data), torch.empty_like(block_scale)
    if operand:
        out_operand = empty_planes(M, K // 2, device)
    global_scale = torch.empty((), dtype=torch.float32, device=device)
    amax_here = x.numel() <= AMAX_IN_LAUNCH
    partials = dummy if amax_here else _partial_amax(x)

    def ptr(t, view=None):
        return dummy if t is None else (t.view(view) if view is not None else t)

    blocks = 32 if n_blocks <= 16384 else 128  # small inputs: more programs, shorter chains
    _quantize_activation_kernel[(triton.cdiv(n_blocks, blocks),)](
        x, x.view(torch.int32) if x.dtype == torch.bfloat16 else x, ptr(rac_mask, torch.uint8), partials,
        global_scale, ptr(data), ptr(block_scale, torch.uint8), ptr(res_data), ptr(res_block_scale, torch.uint8),
        ptr(out_operand),
        x.numel(), n_blocks, K // BLOCK_SIZE, partials.numel() if not amax_here else 0,
        out_operand.stride(0) if operand else 0,
        AMAX_HERE=amax_here, HAS_RESIDUAL=rac_mask is not None, X_BF16=x.dtype == torch.bfloat16,
        WRITE_CODES=codes, WRITE_OPERAND=operand, BLOCKS=blocks, CHUNK=_AMAX_CHUNK, GPU=not INTERPRET,
        PARTIALS=triton.next_power_of_2(partials.numel()))
    return data, block_scale, res_data, res_block_scale, out_operand, global_scale
