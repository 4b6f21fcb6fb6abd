"""The W4A4 activation quantizer: x (M, K) -> NVFP4 codes of x and of its RAC residual, and the fp16
operand the Hopper GEMMs multiply. The codes equal nvfp4.quantize_activation(x, rac_mask, act_scale)
bit for bit (the arithmetic of nvfp4.quantize_reference); the operand is their values,
(DQ(x_q) + DQ(r_q)) / g * 2^-6 rounded once to fp16. The global scale g is one per tensor
(act_scale "tensor") or one per row ("row", row_scale=True). Where g is NaN (its input holds NaN or
Inf) every value dequantizes to NaN, but the kernel writes scale 0 for the finite blocks, where the
reference writes the E4M3 NaN (nvfp4_quantize's block step does so for nvfp4 too).

Per 16-element block b of x, with the dynamic global scale g = amax(|x|) / (6 * 448) (amax over x,
or x's row):

    s_b   = e4m3(amax(|x_b|) / 6 / g)          the block scale
    q_b   = rne_e2m1(x_b / (s_b * g))          the codes (ties to even, saturating at 6)
    r_b   = x_b - q_b * s_b * g                the residual, on the blocks rac_mask selects, else 0
    r_q   = the same two lines on r_b, with g  (a residual block is 6-16x smaller: its scale fits)
    op_b  = (q_b * s_b + r_q * s_r) * 2^-6     the operand, fp16: each term is exact, the sum rounds

A program quantizes BLOCKS blocks of the flattened (M * G, 16) input as two (BLOCKS, 8) tiles of
even and odd elements: a bf16 pair is one 32-bit load, a packed byte is code(even) | code(odd) << 4,
and the operand is written as two planes (2, M, K/2) of even and odd columns, the order in which a
packed weight byte holds its two codes (gpu_kernels/w4a4_dense.py consumes K as those two halves). A
tensor's global scale needs amax(|x|) before any block: inputs up to AMAX_IN_LAUNCH elements are
reduced by every program itself (they sit in L2); larger ones by one partial-max launch ahead
(at most 256 slices), whose maxima every program then reduces. A row's (row_scale) is one program's
own: it holds the whole row (next_power_of_2(G) blocks, masked to G) and reduces the amax from the
tiles it quantizes, one read of x, no second launch.

W4A16 (quantize=False): no codes; the operand is x itself, op = x / g * 2^-6 in fp16, with g the
smallest power of two >= amax / 2688 (per tensor or per row; at least 2^-126). Dividing by a power
of two is exact, |op| <= 42, and a bf16 value's 8 significant bits fit fp16's 11: the operand is
exact wherever |x| >= 2^-11 g (below, about 2e-7 of amax, fp16's subnormals drop bits). The GEMMs
multiply by g as for a W4A4 operand: y = x @ DQ(W).T.

The format's arithmetic is nvfp4_blocks.py's, shared with the NVFP4 quantizer: it restates
nvfp4.py's (a kernel file imports no project module), and the tests hold both to the same references
bit for bit. The operand's layout (OPERAND_SHIFT, empty_planes) is w4a4_common.py's, shared with the
GEMMs that read it.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.nvfp4_blocks import e2m1_value, load_pairs, quantize_pairs
from gpu_kernels.w4a4_common import OPERAND_SHIFT, empty_planes

BLOCK_SIZE = 16  # NVFP4 block: 16 elements along K, one E4M3 scale
GLOBAL_SCALE_DIVISOR = 6.0 * 448.0  # 2688: global_scale = amax / (E2M1 max * E4M3 max)
AMAX_IN_LAUNCH = 4096  # inputs up to this size (M * K): the quantizer reduces the amax itself
_DIVISOR = tl.constexpr(GLOBAL_SCALE_DIVISOR)
_SHIFT = tl.constexpr(OPERAND_SHIFT)
_FP32_MANTISSA = tl.constexpr(0x7FFFFF)  # the 23 mantissa bits of an fp32 bit pattern


# ------------------------------------------------------------------------------ the quantizer
# Reference: nvfp4.quantize_activation (codes; the operand is their values). A program quantizes
# BLOCKS 16-element blocks of the flattened (M * G, 16) input as two (BLOCKS, 8) tiles of even and
# odd elements (nvfp4.py's pair layout: a bf16 pair is one 32-bit load, and a packed byte is
# code(even) | code(odd) << 4) with nvfp4.py's own arithmetic: bit for bit the reference. A row's
# global scale is a scalar in its one program, so the block arithmetic is the same in both modes.
@triton.jit
def _scale_from_amax(amax):
    """nvfp4.compute_global_scale: amax / 2688, 1.0 for an all-zero input, NaN if not finite."""
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, _DIVISOR))
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _power_of_two_scale(amax):
    """The W4A16 operand's scale: the smallest power of two >= amax / 2688 and >= 2^-126 (a normal
    number: nothing flushes it to zero), 1.0 for an all-zero input, NaN if not finite. Integer
    arithmetic on the fp32 bits of amax / 2688 (>= 0), the same on the GPU and in the interpreter:
    the exponent field, plus one where the mantissa is not zero (a subnormal quotient, exponent
    field 0, gives 1: 2^-126)."""
    bits = tl.math.div_rn(amax, _DIVISOR).to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) + ((bits & _FP32_MANTISSA) != 0).to(tl.int32), 1)
    scale = tl.where(amax == 0, 1.0, (exponent << 23).to(tl.float32, bitcast=True))
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _tiles_abs_max(even, odd):
    """max |x| over a row's even and odd (BLOCKS, 8) tiles (masked elements load as 0); NaN counts
    as Inf, as in _abs_max."""
    even, odd = tl.abs(even), tl.abs(odd)
    running = tl.maximum(
        tl.where(even == even, even, float("inf")), tl.where(odd == odd, odd, float("inf"))
    )
    return tl.max(tl.max(running, axis=1), axis=0)


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
    into one FMA by the GPU compiler, which skips that rounding (the reference makes it): mul.rn is
    never fused. Seen on the H200: RAC residual codes that differed from the reference's."""
    if GPU:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return a * b


@triton.jit
def _quantize_blocks(
    even,
    odd,
    rac_mask_ptr,
    blocks,
    in_range,
    blocks_per_row,
    global_scale,
    HAS_RESIDUAL: tl.constexpr,
    GPU: tl.constexpr,
):
    """The (BLOCKS, 8) even and odd tiles of flat blocks `blocks` -> codes and E4M3 bytes of x and
    of its RAC residual, and the operand values (DQ(x_q) + DQ(r_q)) / global_scale as fp32 even and
    odd tiles."""
    code_even, code_odd, block_scale, scale_byte = quantize_pairs(even, odd, global_scale)
    value_even = e2m1_value(code_even) * block_scale[:, None]
    value_odd = e2m1_value(code_odd) * block_scale[:, None]
    r_even, r_odd, r_byte = code_even, code_odd, scale_byte  # (placeholders without a residual)
    if HAS_RESIDUAL:
        keep = (tl.load(rac_mask_ptr + blocks % blocks_per_row, mask=in_range, other=0) != 0)[
            :, None
        ]
        res_even = tl.where(keep, even - _mul_rn(value_even, global_scale, GPU), 0.0)  # x - DQ(x_q)
        res_odd = tl.where(keep, odd - _mul_rn(value_odd, global_scale, GPU), 0.0)
        r_even, r_odd, r_scale, r_byte = quantize_pairs(res_even, res_odd, global_scale)
        value_even += e2m1_value(r_even) * r_scale[:, None]  # exact in fp32
        value_odd += e2m1_value(r_odd) * r_scale[:, None]
    return code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd


@triton.jit
def _store_codes(data_ptr, scale_ptr, blocks, in_range, code_even, code_odd, scale_byte):
    pairs = tl.arange(0, 8)
    tl.store(
        data_ptr + blocks[:, None] * 8 + pairs[None, :],
        (code_even | (code_odd << 4)).to(tl.uint8),
        mask=in_range[:, None],
    )
    tl.store(scale_ptr + blocks, scale_byte.to(tl.uint8), mask=in_range)


@triton.jit
def quantize_activation_kernel(
    # pointers: input (elements, and its pair view), selection, scales, outputs
    x_ptr,
    x_words_ptr,
    rac_mask_ptr,
    partial_amax_ptr,
    global_scale_ptr,
    data_ptr,
    block_scale_ptr,
    res_data_ptr,
    res_block_scale_ptr,
    operand_ptr,
    # sizes (plane_size: elements in one operand plane, M * K / 2)
    numel,
    n_blocks,
    blocks_per_row,
    n_partials,
    plane_size,
    # meta-parameters (ROW_SCALE: one program and one global scale per row,
    # BLOCKS >= blocks_per_row; QUANTIZE False: W4A16, the operand of x itself and a power-of-two
    # scale, no codes)
    AMAX_HERE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    X_BF16: tl.constexpr,
    WRITE_CODES: tl.constexpr,
    WRITE_OPERAND: tl.constexpr,
    BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
    PARTIALS: tl.constexpr,
    GPU: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    if ROW_SCALE:  # the row's amax from the very tiles it quantizes: one read of x
        blocks = pid.to(tl.int64) * blocks_per_row + tl.arange(0, BLOCKS)
        in_range = tl.arange(0, BLOCKS) < blocks_per_row
        even, odd = load_pairs(x_words_ptr, blocks, tl.arange(0, 8), in_range[:, None], X_BF16)
        amax = _tiles_abs_max(even, odd)
        global_scale = _scale_from_amax(amax) if QUANTIZE else _power_of_two_scale(amax)
        tl.store(global_scale_ptr + pid, global_scale)
    else:
        if AMAX_HERE:  # a small input: every program reduces all of it (L2-resident) itself
            amax = _abs_max(x_ptr, 0, numel, CHUNK)
        else:  # the maxima of _partial_amax_kernel's slices
            idx = tl.arange(0, PARTIALS)
            partial = tl.load(partial_amax_ptr + idx, mask=idx < n_partials, other=0.0)
            amax = tl.max(partial, axis=0)
        global_scale = _scale_from_amax(amax) if QUANTIZE else _power_of_two_scale(amax)
        tl.store(global_scale_ptr, global_scale, mask=pid == 0)
        blocks = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        in_range = blocks < n_blocks
        even, odd = load_pairs(x_words_ptr, blocks, tl.arange(0, 8), in_range[:, None], X_BF16)
    if QUANTIZE:
        code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd = (
            _quantize_blocks(
                even,
                odd,
                rac_mask_ptr,
                blocks,
                in_range,
                blocks_per_row,
                global_scale,
                HAS_RESIDUAL,
                GPU,
            )
        )
        if WRITE_CODES:
            _store_codes(
                data_ptr, block_scale_ptr, blocks, in_range, code_even, code_odd, scale_byte
            )
            if HAS_RESIDUAL:
                _store_codes(
                    res_data_ptr, res_block_scale_ptr, blocks, in_range, r_even, r_odd, r_byte
                )
    else:
        # W4A16: x / g; 1 / g is a power of two, so the product is the exact quotient
        # (the same bits)
        inverse = tl.math.div_rn(1.0, global_scale)
        value_even, value_odd = even * inverse, odd * inverse
    if WRITE_OPERAND:  # fp16 planes, 16 contiguous bytes per block in each
        offs = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(operand_ptr + offs, (value_even * _SHIFT).to(tl.float16), mask=in_range[:, None])
        tl.store(
            operand_ptr + plane_size + offs,
            (value_odd * _SHIFT).to(tl.float16),
            mask=in_range[:, None],
        )


@triton.jit
def _partial_amax_kernel(x_ptr, partial_ptr, numel, SLICE: tl.constexpr, CHUNK: tl.constexpr):
    """One max |x| per program over a slice (no atomics, nothing to zero first)."""
    start = tl.program_id(0).to(tl.int64) * SLICE
    amax = _abs_max(x_ptr, start, tl.minimum(start + SLICE, numel), CHUNK)
    tl.store(partial_ptr + tl.program_id(0), amax)


# ------------------------------------------------------------------------------ launches
AMAX_CHUNK = AMAX_IN_LAUNCH  # elements per load in the amax loops: small inputs in one load
AMAX_SLICES = 256  # at most this many partial maxima: every quantizer program reads all of them


def partial_chunk(numel):
    """Elements per load of the partial-max launch. A program's loads over its slice wait one for
    another (plain loads are not pipelined), so inputs that would take more than two chunks a slice
    take chunks 4x wider: on the H200 the quantizer of 4096 x 4096 takes 47 instead of 57 us;
    decode-sized inputs are faster with the narrow chunk."""
    return AMAX_CHUNK * (4 if numel > 2 * AMAX_SLICES * AMAX_CHUNK else 1)


def partial_amax(x):
    """max |x| of each of at most AMAX_SLICES slices of the flat x, one launch -> (slices,) fp32."""
    chunk = partial_chunk(x.numel())
    slice_ = chunk * triton.cdiv(triton.cdiv(x.numel(), chunk), AMAX_SLICES)
    partials = torch.empty(triton.cdiv(x.numel(), slice_), dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(partials.numel(),)](x, partials, x.numel(), SLICE=slice_, CHUNK=chunk)
    return partials


def quantize_activation(
    x, rac_mask=None, codes=False, operand=True, row_scale=False, quantize=True
):
    """x (M, K) bf16/fp16/fp32, rac_mask (G,) bool or None -> (data, block_scale, residual_data,
    residual_block_scale, operand, global_scale): the packed codes (M, K/2) uint8 and E4M3 block
    scales (M, G) of x and of its residual (codes=True; the residual's None without a mask), the
    fp16 operand planes (2, M, K/2) (operand=True), the global scale: () fp32, or (M,) with
    row_scale (each row's own); what is not asked for is None. quantize=False (W4A16): no codes, the
    operand of x itself, x / g * 2^-6, and g the power-of-two scale (per tensor or row) the module's
    docstring defines."""
    if not quantize and (codes or rac_mask is not None):
        mask = None if rac_mask is None else "a mask"
        raise ValueError(
            f"quantize_activation: quantize=False writes x's unquantized operand only: it takes no "
            f"codes or rac_mask (got codes={codes}, rac_mask={mask})"
        )
    x = x.contiguous()
    if x.dtype == torch.bfloat16 and x.data_ptr() % 4:
        x = x.clone()  # int32 pair loads need 4-byte alignment (an odd-offset view)
    M, K = x.shape
    n_blocks, blocks_per_row, device = M * K // BLOCK_SIZE, K // BLOCK_SIZE, x.device
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    data = block_scale = res_data = res_block_scale = out_operand = None
    if codes:
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
        block_scale = torch.empty((M, blocks_per_row), dtype=torch.float8_e4m3fn, device=device)
        if rac_mask is not None:
            res_data, res_block_scale = torch.empty_like(data), torch.empty_like(block_scale)
    if operand:
        out_operand = empty_planes(M, K // 2, device)
    global_scale = torch.empty((M,) if row_scale else (), dtype=torch.float32, device=device)
    if row_scale:
        # a program a row: its blocks in one tile, its amax its own (no partial-max launch)
        amax_here, partials = True, dummy
        blocks = triton.next_power_of_2(blocks_per_row)
        grid = (M,)
        warps = min(16, max(4, blocks // 32))  # 4 warps up to 128 blocks (K 2048), then wider
    else:
        amax_here = x.numel() <= AMAX_IN_LAUNCH
        partials = dummy if amax_here else partial_amax(x)
        blocks = 32 if n_blocks <= 16384 else 128  # small inputs: more programs, shorter chains
        grid = (triton.cdiv(n_blocks, blocks),)
        warps = 4

    def ptr(t, view=None):
        return dummy if t is None else (t.view(view) if view is not None else t)

    quantize_activation_kernel[grid](
        x,
        x.view(torch.int32) if x.dtype == torch.bfloat16 else x,
        ptr(rac_mask, torch.uint8),
        partials,
        global_scale,
        ptr(data),
        ptr(block_scale, torch.uint8),
        ptr(res_data),
        ptr(res_block_scale, torch.uint8),
        ptr(out_operand),
        x.numel(),
        n_blocks,
        blocks_per_row,
        partials.numel() if not amax_here else 0,
        out_operand.stride(0) if operand else 0,
        AMAX_HERE=amax_here,
        HAS_RESIDUAL=rac_mask is not None,
        X_BF16=x.dtype == torch.bfloat16,
        WRITE_CODES=codes,
        WRITE_OPERAND=operand,
        BLOCKS=blocks,
        CHUNK=AMAX_CHUNK,
        GPU=not INTERPRET,
        PARTIALS=triton.next_power_of_2(partials.numel()),
        ROW_SCALE=row_scale,
        QUANTIZE=quantize,
        num_warps=warps,
    )
    return data, block_scale, res_data, res_block_scale, out_operand, global_scale
