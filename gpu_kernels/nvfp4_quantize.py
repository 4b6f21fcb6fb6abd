"""NVFP4 quantize, dequantize and fake-quantize as Triton kernels: bit for bit
nvfp4.quantize_reference and nvfp4.dequantize_reference (fake_quantize: the two composed, in x's
dtype).

One program quantizes BLOCKS consecutive 16-element blocks of the flattened (M*G, 16) input: a
contiguous, coalesced tile. Per block: amax -> E4M3 scale (rounded by integer arithmetic on the fp32
bit pattern, so the GPU and the CPU interpreter, whose float8 casts differ, both match torch's
cast); per element: count the E2M1 midpoints passed (the code), take the sign bit, pack neighbours
into one byte. With FAKE=True the same program writes code_value * scale instead, in x's dtype.

The programs work on element *pairs*: a (BLOCKS, 8) tile of even elements (2j) and one of odd
elements (2j+1). A bf16 pair is one 32-bit word (element 2j in the low half, little-endian), so the
input is read with wide int32 loads and split into two exact fp32 tiles by shifts, and the packed
byte of a pair is simply code(even) | code(odd) << 4: no reshapes or shuffles inside the kernel.

The format's arithmetic on those tiles (quantize_pairs, load_pairs, e2m1_value, e4m3_value) lives in
nvfp4_blocks.py, shared with the W4A4 activation quantizer; why counting midpoints equals
round-to-nearest-even of x / unit: see nvfp4.py's docstring.

Shape letters: K = last (reduction) dim, G = K / 16 blocks per row, M = product of the leading dims.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.nvfp4_blocks import e2m1_value, e4m3_value, load_pairs, quantize_pairs
from gpu_kernels.rounding import to_bf16_bits

BLOCK_SIZE = 16  # elements per block (nvfp4.BLOCK_SIZE)
_BLOCKS_PER_PROGRAM = 128  # 2048 elements a program: 4 KB of bf16 in flight


@triton.jit
def _store_pairs(out_ptr, rows, pairs, even, odd, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        words = to_bf16_bits(even) | (to_bf16_bits(odd) << 16)  # int32 view
        tl.store(out_ptr + rows[:, None] * 8 + pairs[None, :], words, mask=mask)
    else:
        offs = rows[:, None] * 16 + 2 * pairs[None, :]
        tl.store(out_ptr + offs, even.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + offs + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr,
    data_ptr,
    scale_ptr,
    global_scale_ptr,
    out_ptr,
    # sizes
    n_blocks,
    blocks_per_scale,
    # meta-parameters
    BLOCKS: tl.constexpr,
    FAKE: tl.constexpr,
    X_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PER_MATRIX: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # block indices
    pairs = tl.arange(0, 8)
    in_range = rows < n_blocks
    mask = in_range[:, None]
    even, odd = load_pairs(x_ptr, rows, pairs, mask, X_BF16)  # (BLOCKS, 8) each
    if PER_MATRIX:
        global_scale = tl.load(
            global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0
        )
    else:
        global_scale = tl.load(global_scale_ptr)

    code_even, code_odd, block_scale, scale_byte = quantize_pairs(even, odd, global_scale)

    if FAKE:
        if PER_MATRIX:
            global_scale = global_scale[:, None]
        value_even = e2m1_value(code_even) * block_scale[:, None] * global_scale
        value_odd = e2m1_value(code_odd) * block_scale[:, None] * global_scale
        _store_pairs(out_ptr, rows, pairs, value_even, value_odd, mask, OUT_BF16)
    else:
        packed = (code_even | (code_odd << 4)).to(tl.uint8)  # (BLOCKS, 8)
        tl.store(data_ptr + rows[:, None] * 8 + pairs[None, :], packed, mask=mask)
        tl.store(scale_ptr + rows, scale_byte.to(tl.uint8), mask=in_range)


@triton.jit
def _dequantize_kernel(
    # pointers
    data_ptr,
    scale_ptr,
    global_scale_ptr,
    out_ptr,
    # sizes
    n_blocks,
    blocks_per_scale,
    # meta-parameters
    BLOCKS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PER_MATRIX: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    pairs = tl.arange(0, 8)
    in_range = rows < n_blocks
    mask = in_range[:, None]
    packed = tl.load(data_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0).to(tl.int32)
    block_scale = e4m3_value(tl.load(scale_ptr + rows, mask=in_range, other=0).to(tl.int32))
    if PER_MATRIX:
        global_scale = tl.load(
            global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0
        )
        global_scale = global_scale[:, None]
    else:
        global_scale = tl.load(global_scale_ptr)
    value_even = e2m1_value(packed & 0xF) * block_scale[:, None] * global_scale
    value_odd = e2m1_value(packed >> 4) * block_scale[:, None] * global_scale
    _store_pairs(out_ptr, rows, pairs, value_even, value_odd, mask, OUT_BF16)


# ----------------------------------------------------------------------------- launchers
def _launch_args(x_or_out, global_scale):
    """Sizes and flags shared by the quantize and dequantize launches."""
    n_blocks = x_or_out.numel() // BLOCK_SIZE
    per_matrix = global_scale.numel() > 1
    grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM),)
    return grid, n_blocks, n_blocks // global_scale.numel(), per_matrix


def pair_view(t):
    """A bf16 tensor as int32 words of element pairs (the kernels' wide-load layout)."""
    return t.view(torch.int32) if t.dtype == torch.bfloat16 else t


def contiguous_pairs(x):
    """x contiguous, and 4-byte aligned if bf16 (int32 pair loads; an odd-offset view is copied)."""
    x = x.contiguous()
    if x.dtype == torch.bfloat16 and x.data_ptr() % 4:
        x = x.clone()
    return x


def _check(x, global_scale, name):
    if x.shape[-1] % BLOCK_SIZE or not x.is_floating_point():
        raise ValueError(
            f"{name}: x must be float with a last dim a multiple of {BLOCK_SIZE}, got "
            f"{x.dtype} of shape {tuple(x.shape)}"
        )
    if global_scale.dtype != torch.float32 or global_scale.device != x.device:
        raise ValueError(
            f"{name}: global_scale must be a float32 tensor on {x.device}, got "
            f"{global_scale.dtype} on {global_scale.device}"
        )


def quantize(x, global_scale):
    """x (..., K) float32/bfloat16/float16 and its float32 decode scale (a scalar, or one per matrix
    of a stack: shape x.shape[:-2]) -> (codes (..., K/2) uint8, block scales (..., K/16)
    float8_e4m3fn)."""
    _check(x, global_scale, "nvfp4_quantize.quantize")
    global_scale = global_scale.contiguous()
    x = contiguous_pairs(x)
    data = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty(
        (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device
    )
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(x, global_scale)
    _quantize_kernel[grid](
        pair_view(x),
        data,
        block_scale.view(torch.uint8),
        global_scale,
        data,
        n_blocks,
        blocks_per_scale,
        BLOCKS=_BLOCKS_PER_PROGRAM,
        FAKE=False,
        X_BF16=x.dtype == torch.bfloat16,
        OUT_BF16=False,
        PER_MATRIX=per_matrix,
    )
    return data, block_scale


def fake_quantize(x, global_scale):
    """dequantize(quantize(x, global_scale), x.dtype) in one pass (no gradient here:
    nvfp4.fake_quantize adds the straight-through one)."""
    _check(x, global_scale, "nvfp4_quantize.fake_quantize")
    global_scale = global_scale.contiguous()
    x = contiguous_pairs(x)
    out = torch.empty_like(x)
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(x, global_scale)
    is_bf16 = x.dtype == torch.bfloat16
    _quantize_kernel[grid](
        pair_view(x),
        x,
        x,
        global_scale,
        pair_view(out),
        n_blocks,
        blocks_per_scale,
        BLOCKS=_BLOCKS_PER_PROGRAM,
        FAKE=True,
        X_BF16=is_bf16,
        OUT_BF16=is_bf16,
        PER_MATRIX=per_matrix,
    )
    return out


def dequantize(data, block_scale, global_scale, dtype=torch.bfloat16):
    """codes (..., K/2), block scales (..., K/16), decode scale -> (..., K) in dtype: code_value *
    block_scale * global_scale in fp32, then cast."""
    out = torch.empty((*data.shape[:-1], data.shape[-1] * 2), dtype=dtype, device=data.device)
    global_scale = global_scale.contiguous()
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(out, global_scale)
    _dequantize_kernel[grid](
        data.contiguous(),
        block_scale.contiguous().view(torch.uint8),
        global_scale,
        pair_view(out),
        n_blocks,
        blocks_per_scale,
        BLOCKS=_BLOCKS_PER_PROGRAM,
        OUT_BF16=dtype == torch.bfloat16,
        PER_MATRIX=per_matrix,
    )
    return out
