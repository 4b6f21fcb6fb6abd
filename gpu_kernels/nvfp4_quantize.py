"""NVFP4 quantize, dequantize and fake-quantize as Triton kernels: bit for bit nvfp4.quantize_reference
and nvfp4.dequantize_reference (fake_quantize: the two composed, in x's dtype).

One program quantizes BLOCKS consecutive 16-element blocks of the flattened (M*G, 16) input: a
contiguous, coalesced tile. Per block: amax -> E4M3 scale (rounded by integer arithmetic on the fp32
bit pattern, so the GPU and the CPU interpreter, whose float8 casts differ, both match torch's cast);
per element: count the E2M1 midpoints passed (the code), take the sign bit, pack neighbours into one
byte. With FAKE=True the same program writes code_value * scale instead, in x's dtype.

The programs work on element *pairs*: a (BLOCKS, 8) tile of even elements (2j) and one of odd
elements (2j+1). A bf16 pair is one 32-bit word (element 2j in the low half, little-endian), so the
input is read with wide int32 loads and split into two exact fp32 tiles by shifts, and the packed
byte of a pair is simply code(even) | code(odd) << 4: no reshapes or shuffles inside the kernel.

Why counting midpoints equals round-to-nearest-even of x / unit: see nvfp4.py's docstring. The jit
helpers (_quantize_pairs, _load_pairs, _e2m1_value, _to_bf16_bits) are the format's arithmetic on a tile,
for any kernel that quantizes on the way (the W4A4 activation quantizer).

Shape letters: K = last (reduction) dim, G = K / 16 blocks per row, M = product of the leading dims.
"""

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 16  # elements per block (nvfp4.BLOCK_SIZE)
_BLOCKS_PER_PROGRAM = 128  # 2048 elements a program: 4 KB of bf16 in flight

# the format's constants, as constexprs the kernels can read (nvfp4.py's E2M1_MAX, E4M3_MAX, E2M1_SIGN)
_E2M1_MAX = tl.constexpr(6.0)
_E4M3_MAX = tl.constexpr(448.0)
_E2M1_SIGN = tl.constexpr(8)
_E4M3_NAN = tl.constexpr(0x7F)  # the E4M3 NaN byte; also the mask of its 7 value bits
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)  # E4M3 subnormals are the multiples of 2^-9
_E4M3_SUBNORMALS_PER_ONE = tl.constexpr(2.0**9)
_FP32_ROUND_TO_INT = tl.constexpr(2.0**23)  # (x + 2^23) - 2^23 rounds 0 <= x < 2^23 to an integer
# fp32 -> E4M3 keeps 3 of the 23 mantissa bits: add just under half of the dropped 20 bits' range
# plus the kept lsb (ties to even), then clear them
_E4M3_ROUND_BIAS = tl.constexpr((1 << 19) - 1)  # 0x7FFFF
_E4M3_KEEP_MASK = tl.constexpr(-(1 << 20))  # sign, exponent and the top 3 mantissa bits
_E4M3_EXPONENT_OFFSET = tl.constexpr(127 - 7)  # fp32 bias minus E4M3 bias
_BF16_ROUND_BIAS = tl.constexpr((1 << 15) - 1)  # 0x7FFF: the same trick for fp32 -> bf16 (16 bits)
_BF16_NAN = tl.constexpr(0x7FC0)
_FP32_HALF = tl.constexpr(0x3F000000)  # the bit pattern of 0.5, E2M1 code 1


@triton.jit
def _e2m1_code_blocks(x, unit):
    """Codes (int32 0..15) of x (BLOCKS, n) in blocks whose divisor is unit (BLOCKS, 1); equals
    nvfp4._encode_blocks. The magnitude counts the E2M1_MIDPOINTS times the unit that |x| passes (>= at
    the ties that round up, > at the others); the sign bit is x's own. Comparing with seven
    products per block replaces a division and a rounding per element: a third of the arithmetic,
    which is what bounds this kernel. A NaN unit (zero or NaN blocks) gives magnitude 0."""
    mag = tl.abs(x)
    code = (
        (mag > unit * 0.25).to(tl.int32)
        + (mag >= unit * 0.75).to(tl.int32)
        + (mag > unit * 1.25).to(tl.int32)
        + (mag >= unit * 1.75).to(tl.int32)
        + (mag > unit * 2.5).to(tl.int32)
        + (mag >= unit * 3.5).to(tl.int32)
        + (mag > unit * 5.0).to(tl.int32)
    )
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too
    return code | (negative.to(tl.int32) << 3)


@triton.jit
def _e2m1_value(code):
    """E2M1 codes (int32) -> fp32 values, built as fp32 bit patterns: code c >= 2 is
    2^((c >> 1) - 1) * (1 + (c & 1) / 2); code 1 is 0.5; code 0 is 0; bit 3 is the sign."""
    mag = code & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)  # exponent bias 127 - 1
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, _FP32_HALF, 0))
    return (bits | ((code & _E2M1_SIGN) << 28)).to(tl.float32, bitcast=True)  # bit 3 -> bit 31


@triton.jit
def _e4m3_round(v):
    """Round fp32 v in [0, 448] to E4M3, nearest-even; returns (value as fp32, E4M3 bit pattern).

    Integer arithmetic rather than a float8 cast, so that every backend rounds as torch's cast
    does. Normal range (v >= 2^-6): round the fp32 mantissa to 3 bits by adding the rounding bias
    plus the kept lsb and truncating. Subnormal range: multiples of 2^-9, rounded to an integer
    count of them with the 2^23 trick.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + _E4M3_ROUND_BIAS + ((bits >> 20) & 1)) & _E4M3_KEEP_MASK
    normal = normal.to(tl.float32, bitcast=True)
    steps = (v * _E4M3_SUBNORMALS_PER_ONE + _FP32_ROUND_TO_INT) - _FP32_ROUND_TO_INT
    value = tl.where(v >= _E4M3_MIN_NORMAL, normal, steps * _E4M3_SUBNORMAL_STEP)
    vbits = value.to(tl.int32, bitcast=True)
    normal_byte = ((((vbits >> 23) & 0xFF) - _E4M3_EXPONENT_OFFSET) << 3) | ((vbits >> 20) & 7)
    subnormal_byte = (value * _E4M3_SUBNORMALS_PER_ONE).to(tl.int32)
    byte = tl.where(value >= _E4M3_MIN_NORMAL, normal_byte, subnormal_byte)
    return value, byte


@triton.jit
def _e4m3_value(byte):
    """E4M3 bit patterns (int32 0..255) -> fp32, by bit arithmetic (see _e4m3_round for why)."""
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    normal = (((exponent + _E4M3_EXPONENT_OFFSET) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP, normal)
    value = tl.where((byte & 0x80) != 0, -value, value)
    return tl.where((byte & _E4M3_NAN) == _E4M3_NAN, float("nan"), value)


@triton.jit
def _to_bf16_bits(value):
    """fp32 -> bf16 bit pattern (int32, low 16 bits), nearest-even, by integer arithmetic: the CPU
    interpreter's own fp32->bf16 cast truncates; on the GPU this equals torch's .to(bfloat16)."""
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + _BF16_ROUND_BIAS + ((bits >> 16) & 1)) >> 16
    return tl.where(value == value, bits, _BF16_NAN) & 0xFFFF  # keep NaN a NaN


@triton.jit
def _load_pairs(x_ptr, rows, pairs, mask, X_BF16: tl.constexpr):
    """(BLOCKS, 8) fp32 tiles of the even and the odd elements of blocks `rows`."""
    if X_BF16:
        words = tl.load(
            x_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0
        )  # int32 view
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & -65536).to(tl.float32, bitcast=True)  # the high half, in place
    else:
        offs = rows[:, None] * 16 + 2 * pairs[None, :]
        even = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _store_pairs(out_ptr, rows, pairs, even, odd, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        words = _to_bf16_bits(even) | (_to_bf16_bits(odd) << 16)  # int32 view
        tl.store(out_ptr + rows[:, None] * 8 + pairs[None, :], words, mask=mask)
    else:
        offs = rows[:, None] * 16 + 2 * pairs[None, :]
        tl.store(out_ptr + offs, even.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + offs + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_pairs(even, odd, global_scale):
    """The format's arithmetic on a tile of blocks: (BLOCKS, 8) even and odd fp32 elements and a
    global scale (scalar, or one per block) -> E2M1 codes of each half, the block scales as fp32
    and as E4M3 bit patterns (BLOCKS,). Shared with the W4A4 activation quantizer."""
    # block amax and NaN/Inf detection (tl.max does not promise to propagate NaN)
    even_ok, odd_ok = tl.abs(even) < float("inf"), tl.abs(odd) < float("inf")  # False for NaN
    non_finite = tl.max((~even_ok | ~odd_ok).to(tl.int32), axis=1) > 0  # (BLOCKS,)
    block_amax = tl.maximum(
        tl.max(tl.where(even_ok, tl.abs(even), 0.0), axis=1),
        tl.max(tl.where(odd_ok, tl.abs(odd), 0.0), axis=1),
    )
    scale = tl.math.div_rn(tl.math.div_rn(block_amax, _E2M1_MAX), global_scale)
    scale = tl.minimum(tl.maximum(scale, 0.0), _E4M3_MAX)
    scale = tl.where(scale == scale, scale, 0.0)  # NaN global scale
    block_scale, scale_byte = _e4m3_round(scale)
    block_scale = tl.where(non_finite, float("nan"), block_scale)
    scale_byte = tl.where(non_finite, _E4M3_NAN, scale_byte)
    denom = block_scale * global_scale  # (BLOCKS,)
    ok = (denom > 0) & (denom < float("inf"))
    unit = tl.where(ok, denom, float("nan"))[:, None]  # zero/NaN blocks: magnitude 0
    return _e2m1_code_blocks(even, unit), _e2m1_code_blocks(odd, unit), block_scale, scale_byte


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
    even, odd = _load_pairs(x_ptr, rows, pairs, mask, X_BF16)  # (BLOCKS, 8) each
    if PER_MATRIX:
        global_scale = tl.load(
            global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0
        )
    else:
        global_scale = tl.load(global_scale_ptr)

    code_even, code_odd, block_scale, scale_byte = _quantize_pairs(even, odd, global_scale)

    if FAKE:
        if PER_MATRIX:
            global_scale = global_scale[:, None]
        value_even = _e2m1_value(code_even) * block_scale[:, None] * global_scale
        value_odd = _e2m1_value(code_odd) * block_scale[:, None] * global_scale
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
    block_scale = _e4m3_value(tl.load(scale_ptr + rows, mask=in_range, other=0).to(tl.int32))
    if PER_MATRIX:
        global_scale = tl.load(
            global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0
        )
        global_scale = global_scale[:, None]
    else:
        global_scale = tl.load(global_scale_ptr)
    value_even = _e2m1_value(packed & 0xF) * block_scale[:, None] * global_scale
    value_odd = _e2m1_value(packed >> 4) * block_scale[:, None] * global_scale
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
    """x contiguous, and 4-byte aligned when bf16 (int32 pair loads; an odd-offset view is copied)."""
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
    """x (..., K) float32/bfloat16/float16 and its float32 decode scale (a scalar, or one per matrix of
    a stack: shape x.shape[:-2]) -> (codes (..., K/2) uint8, block scales (..., K/16) float8_e4m3fn)."""
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
    """dequantize(quantize(x, global_scale), x.dtype) in one pass (no gradient here: nvfp4.fake_quantize
    adds the straight-through one)."""
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
