"""The NVFP4 format's arithmetic on a tile of blocks, as Triton jit functions: what both quantizer
kernels (nvfp4_quantize.py, w4a4_quantize.py) compute on the way, bit for bit nvfp4.py's definition.

A tile is BLOCKS 16-element blocks held as two (BLOCKS, 8) fp32 tiles, the even elements (2j) and
the odd ones (2j+1). A bf16 pair is one 32-bit word (element 2j in the low half, little-endian), so
load_pairs reads the input with wide int32 loads and splits it by shifts, exactly; and the packed
byte of a pair is code(even) | code(odd) << 4: no reshapes or shuffles inside a kernel.

Per block, quantize_pairs takes

    block_scale = e4m3(amax(|x_b|) / 6 / global_scale)    saturating at 448
    unit        = block_scale * global_scale
    code        = sign | (number of E2M1 midpoints |x| / unit passes)

The E4M3 rounding is integer arithmetic on the fp32 bit pattern (_e4m3_round), so the GPU and the
CPU interpreter, whose float8 casts differ, both match torch's cast. Why counting midpoints equals
round-to-nearest-even of x / unit: see nvfp4.py's docstring. e2m1_value and e4m3_value decode codes
and scale bytes back to fp32, by bit arithmetic as well.
"""

import triton
import triton.language as tl

# the format's constants, as constexprs the kernels can read (nvfp4.py's E2M1_MAX, E4M3_MAX,
# E2M1_SIGN)
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
_FP32_HALF = tl.constexpr(0x3F000000)  # the bit pattern of 0.5, E2M1 code 1


@triton.jit
def _e2m1_code_blocks(x, unit):
    """Codes (int32 0..15) of x (BLOCKS, n) in blocks whose divisor is unit (BLOCKS, 1); equals
    nvfp4._encode_blocks. The magnitude counts the E2M1_MIDPOINTS times the unit that |x| passes (>=
    at the ties that round up, > at the others); the sign bit is x's own. Comparing with seven
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
def e2m1_value(code):
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
def e4m3_value(byte):
    """E4M3 bit patterns (int32 0..255) -> fp32, by bit arithmetic (see _e4m3_round for why)."""
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    normal = (((exponent + _E4M3_EXPONENT_OFFSET) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP, normal)
    value = tl.where((byte & 0x80) != 0, -value, value)
    return tl.where((byte & _E4M3_NAN) == _E4M3_NAN, float("nan"), value)


@triton.jit
def load_pairs(x_ptr, rows, pairs, mask, X_BF16: tl.constexpr):
    """(BLOCKS, 8) fp32 tiles of the even and the odd elements of blocks `rows`."""
    if X_BF16:
        # the int32 view: a word holds a pair
        words = tl.load(x_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0)
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & -65536).to(tl.float32, bitcast=True)  # the high half, in place
    else:
        offs = rows[:, None] * 16 + 2 * pairs[None, :]
        even = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def quantize_pairs(even, odd, global_scale):
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
