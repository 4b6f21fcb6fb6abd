"""NVFP4, the 4-bit floating-point format the rollouts run in: its definition, a plain-PyTorch
reference, the public API, and the Triton kernels that implement it bit for bit.

An NVFP4 tensor stores every value as a 4-bit float (E2M1) times two scales:

    x  ~=  code_value * block_scale * global_scale

- E2M1 code: 1 sign bit (bit 3) and 3 magnitude bits (2 exponent, 1 mantissa). The 8 magnitudes are

      code  0    1    2    3    4    5    6    7
      value 0    0.5  1    1.5  2    3    4    6

  so the grid is fine near zero and coarse near the top (relative spacing 1/3 to 1/2). Codes 8..15
  are the same magnitudes negated; code 8 is -0.
- Blocks of 16 consecutive elements along the last (reduction, K) dimension share one block scale,
  an FP8 E4M3 number (4 exponent bits, 3 mantissa bits, max 448, no infinities, 0x7F is NaN).
- One FP32 global (tensor) scale, a *decode* scale: global_scale = amax(|x|) / (6 * 448), chosen so
  that the largest block scale lands on E4M3's maximum. A stack of matrices (the experts' weights,
  (E, N, K)) may carry one global scale per matrix instead, shape (E,).
- Two codes per byte along the last dimension: element 2i in the low nibble, 2i+1 in the high one.

Quantizing x of shape (..., K), K a multiple of 16 (G = K / 16 blocks per row):

    global_scale = amax(|x|) / 2688                                     # fp32 scalar; 2688 = 6 * 448
    block_scale  = e4m3(clamp(block_amax / 6 / global_scale, 0, 448))   # (..., G), nearest-even
    unit         = float(block_scale) * global_scale                    # (..., G), the block's divisor
    code         = e2m1(x / unit)                                       # (..., K)
    dequantize   = code_value * float(block_scale) * global_scale       # fp32, then cast

Rounding. e2m1 rounds to the nearest grid value, ties to the even code (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturates beyond 6. The E4M3 cast of the
block scale rounds to nearest, so a block's largest element can land slightly above 6 units: it
saturates, the only clipping the format does. The division x / unit is never computed: the code's
magnitude is the number of grid midpoints times the unit (0.25 * unit, ..., 5 * unit, fp32 products)
that |x| passes, strictly where the code below the midpoint is even and inclusively where it is odd.
That is round-to-nearest-even of x / unit, except within half an fp32 ulp of a midpoint, where the
product's rounding decides. Every fp32 operation is a correctly rounded IEEE multiplication or
division, in exactly this order, so the torch reference and the Triton kernels agree bit for bit.

The sign. Every code carries its input's sign bit, as an IEEE conversion does: a negative value that
rounds to magnitude 0 is stored as -0 (code 8), and so is an input -0.0. This matches torchao's NVFP4
quantizer (it copies the fp32 sign bit onto the code) and the GPU's own conversion to E2M1 (PTX
`cvt.rn.satfinite.e2m1x2.f32` rounds to nearest, which keeps the sign of a result that rounds to zero;
only its `.relu` form clamps negatives to +0). TransformerEngine's reference quantizer stores negative
values that round to zero as -0 too, and differs only on an input -0.0, which it stores as +0. The
choice changes no value (a zero is a zero), only packed codes and the signs of dequantized zeros.

Edge cases, one behaviour each:
- zero blocks: a block whose scale rounds to 0 (all zeros, or one whose largest value is below about
  2^-19 of the tensor's) stores block_scale 0 and codes of magnitude 0, each with its input's sign:
  it dequantizes to zeros of the inputs' signs.
- an all-zero tensor: the global scale would be 0; it is 1.0 instead (any positive value would do,
  1.0 keeps dequantize exact), and every block is a zero block.
- subnormal inputs (bf16/fp32 denormals) are ordinary small numbers: quantized like any other value,
  no flush to zero before scaling.
- NaN and +-Inf propagate as NaN, never as a silent finite value: a block that holds one gets the
  E4M3 NaN as its block scale and codes of magnitude 0 (signs as always), so its 16 values dequantize
  to NaN; a computed global scale of a tensor that holds one is NaN, so the whole tensor does.

Weights follow one rule on both sides of RL: quantize_weight (the rollout's packed weights) and
fake_quantize_weight (the trainer's QAT forward) share weight_global_scale, one scale per linear
weight (N, K) and one per expert for stacked (E, N, K) weights, so they agree bit for bit.

Fast path: on CUDA tensors quantize, dequantize and fake_quantize run Triton kernels (one read of x,
one write of codes and scales; a computed global scale is one more read of x, by torch).
fake_quantize, quantize then dequantize with a straight-through gradient, is one fused kernel. The
slow twins, quantize_reference and dequantize_reference, are plain PyTorch and run everywhere else;
tests compare the two bit for bit, on the CPU under TRITON_INTERPRET=1 and on the GPU.

Deliberately left out: MX formats (E8M0 scales, 32-element blocks), stochastic rounding, per-row
global scales, and the swizzled 128x4 block-scale layout of Blackwell tensor cores (rac.py's native
kernels hand row-major scales to `tl.dot_scaled`).

Shape letters: K = last (reduction) dim, G = K / 16 blocks per row, M = product of the leading dims.
"""
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch on Linux; without it the torch twin runs
    triton = None

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: the tensor's amax maps onto the largest block scale
# Magnitudes of the 8 E2M1 codes; code c (0..15) decodes to sign(c & E2M1_SIGN) * E2M1_VALUES[c & 7].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN = 8
# Midpoints between neighbouring magnitudes. A value exactly on a midpoint goes to the even code:
# up when the code below is odd (ROUND_UP_AT_TIE), down when it is even.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
ROUND_UP_AT_TIE = (False, True, False, True, False, True, False)


@dataclass
class NVFP4Tensor:
    """A quantized tensor: packed codes plus the two levels of scale. `shape` is the logical shape."""
    data: torch.Tensor          # uint8 (..., K/2): two E2M1 codes per byte, low nibble first
    block_scale: torch.Tensor   # float8_e4m3fn (..., K/16)
    global_scale: torch.Tensor  # float32 decode scale: a scalar, or one per matrix (shape[:-2])

    @property
    def shape(self):
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    @property
    def device(self):
        return self.data.device

    def dequantize(self, dtype=torch.bfloat16):
        return dequantize(self, dtype)


# ----------------------------------------------------------------------------- codes and packing
def _encode_blocks(x, unit):
    """E2M1 codes (uint8 0..15) of x measured in units of `unit` (its block's divisor, broadcast
    against x): the number of midpoints m * unit (fp32 products) that |x| passes, strictly where the
    code below the midpoint is even and inclusively where it is odd (round-to-nearest, ties to even),
    with x's sign bit as bit 3. A NaN unit passes no midpoint: magnitude 0."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(E2M1_MIDPOINTS, ROUND_UP_AT_TIE):
        threshold = mid * unit
        code += (mag >= threshold) if up else (mag > threshold)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def encode_e2m1(x):
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), ties to even, saturating at +-6."""
    return _encode_blocks(x, torch.ones((), dtype=torch.float32, device=x.device))


_DECODE_TABLES = {}  # (dtype, device) -> the 16 signed values, built once


def decode_e2m1(code, dtype=torch.float32):
    """E2M1 codes (uint8 in 0..15) to their values (code 8 to -0.0): one lookup in the 16 signed values
    (codes 8..15 are 0..7 negated), five times faster on a CPU than building the table per call."""
    table = _DECODE_TABLES.get((dtype, code.device))
    if table is None:
        signed = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
        table = _DECODE_TABLES[dtype, code.device] = torch.tensor(signed, dtype=dtype, device=code.device)
    return table.index_select(0, (code.reshape(-1) & 15).int()).view(code.shape)  # bits above 3 ignored


def pack_codes(code):
    """(..., K) codes in 0..15 -> (..., K/2) bytes, element 2i in the low nibble, 2i+1 in the high."""
    if code.shape[-1] % 2:
        raise ValueError(f"pack_codes: code's last dim must be even, got shape {tuple(code.shape)}")
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_codes(packed):
    """(..., K/2) bytes -> (..., K) codes; the exact inverse of pack_codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- scales and input checks
def _check_input(x, name="quantize"):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: x must be float32, float16 or bfloat16, got dtype {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{name}: x must be non-empty with at least one dim, got shape {tuple(x.shape)}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: x's last dim must be a multiple of the block size {BLOCK_SIZE}, "
                         f"got shape {tuple(x.shape)}")


def compute_global_scale(x, per_matrix=False):
    """amax(|x|) / (6 * 448) in float32; 1.0 where x is all zero; NaN where x holds NaN/Inf.

    A scalar, or with per_matrix=True one scale per matrix of a stack (..., N, K): shape x.shape[:-2].
    """
    if per_matrix and x.dim() < 3:
        raise ValueError(f"compute_global_scale: per_matrix=True needs x of shape (..., N, K), "
                         f"got shape {tuple(x.shape)}")
    # torch's inf-norm reads x once with no |x| temporary; on the GPU it is as fast as a Triton
    # atomic-max kernel (README), so it is the one path
    dims = (-2, -1) if per_matrix else None
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=dims).float()
    # divide by a tensor, not a Python scalar: CUDA turns scalar division into a reciprocal multiply,
    # which would differ from the CPU in the last bit
    scale = amax / torch.full_like(amax, GLOBAL_SCALE_DIVISOR)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _resolve_global_scale(x, global_scale, name="quantize"):
    """The caller's global scale as a float32 tensor (scalar, or one per matrix), or a computed one."""
    if global_scale is None:
        return compute_global_scale(x)
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), device=x.device)
    if global_scale.device != x.device:
        raise ValueError(f"{name}: global_scale is on {global_scale.device} but x is on {x.device}")
    if global_scale.numel() == 1:
        return global_scale.reshape(()).float()
    if x.dim() >= 3 and tuple(global_scale.shape) == tuple(x.shape[:-2]):
        return global_scale.float()
    raise ValueError(f"{name}: global_scale must be a scalar or one per matrix (shape "
                     f"{tuple(x.shape[:-2])}), got shape {tuple(global_scale.shape)} for x of shape "
                     f"{tuple(x.shape)}")


def _broadcastable(global_scale, extra_dims):
    """View a per-matrix global scale (shape[:-2]) so it broadcasts over `extra_dims` trailing dims."""
    return global_scale.reshape(*global_scale.shape, *([1] * extra_dims))


# ----------------------------------------------------------------------------- reference (slow twin)
def quantize_reference(x, global_scale=None):
    """Plain-PyTorch NVFP4 quantization; the definition the Triton kernel must match bit for bit."""
    _check_input(x)
    global_scale = _resolve_global_scale(x, global_scale)
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)           # (..., G, 16)
    block_amax = blocks.abs().amax(dim=-1)                              # (..., G), NaN if any is
    non_finite = ~torch.isfinite(block_amax)                            # (..., G) blocks with NaN/Inf
    gs = _broadcastable(global_scale, 2)                                # (..., 1, 1) or ()
    six = torch.full_like(block_amax, E2M1_MAX)  # a tensor divisor: true division on CUDA too
    scale = (block_amax / six / gs).clamp(0.0, E4M3_MAX).to(torch.float8_e4m3fn).float()
    block_scale = torch.where(non_finite, torch.full_like(scale, float("nan")), scale)
    block_scale = block_scale.to(torch.float8_e4m3fn)                   # (..., G)
    denom = block_scale.float() * gs                                    # (..., G)
    ok = (denom > 0) & torch.isfinite(denom)
    unit = torch.where(ok, denom, torch.full_like(denom, float("nan")))  # zero/NaN blocks: magnitude 0
    code = _encode_blocks(blocks, unit.unsqueeze(-1)).reshape(x.shape)
    return NVFP4Tensor(pack_codes(code), block_scale, global_scale)


def dequantize_reference(q, dtype=torch.bfloat16):
    """Plain-PyTorch dequantization: code_value * block_scale * global_scale in fp32, then cast."""
    values = decode_e2m1(unpack_codes(q.data))                          # (..., K)
    values = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE)         # (..., G, 16)
    out = values * q.block_scale.float().unsqueeze(-1) * _broadcastable(q.global_scale, 3)
    return out.reshape(q.shape).to(dtype)


# ----------------------------------------------------------------------------- public API
def _use_triton(x):
    # The one place the fast path is chosen: Triton on CUDA tensors, the torch twin elsewhere.
    return triton is not None and x.is_cuda


def quantize(x, global_scale=None):
    """Quantize a float tensor (..., K), K % 16 == 0, to NVFP4.

    global_scale: optional caller-supplied decode scale (float or scalar tensor), so that several
    tensors (fused q/k/v, gate/up) can share one; values beyond 6 * 448 * global_scale saturate.
    For a stack of matrices (..., N, K) it may be a tensor of shape x.shape[:-2]: one per matrix
    (see compute_global_scale(x, per_matrix=True)), as the experts' stacked weights use.
    """
    _check_input(x)
    if _use_triton(x):
        return quantize_triton(x, global_scale)
    return quantize_reference(x, global_scale)


def dequantize(q, dtype=torch.bfloat16):
    """NVFP4Tensor -> dense tensor of `dtype`: code_value * block_scale * global_scale in fp32."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"dequantize: q must be an NVFP4Tensor, got {type(q).__name__}")
    if q.block_scale.device != q.data.device or q.global_scale.device != q.data.device:
        raise ValueError(f"dequantize: q.data is on {q.data.device}, q.block_scale on "
                         f"{q.block_scale.device}, q.global_scale on {q.global_scale.device}: "
                         "all must be on one device")
    if _use_triton(q.data):
        return dequantize_triton(q, dtype)
    return dequantize_reference(q, dtype)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(x)) in x's dtype. Backward: identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, global_scale):
        if _use_triton(x):
            return fake_quantize_triton(x, global_scale)
        return dequantize_reference(quantize_reference(x, global_scale), x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None


def fake_quantize(x, global_scale=None):
    """Quantize then dequantize, in x's dtype, with a straight-through (identity) gradient."""
    _check_input(x, "fake_quantize")
    return _FakeQuantize.apply(x, global_scale)


def weight_global_scale(w):
    """The global-scale rule for weights, shared by the trainer (qat.py) and the rollout (rac.py):
    one scale per tensor for a linear layer's (N, K) weight, one per expert for stacked (E, N, K)
    expert weights (the fused gate/up rows of an expert share theirs)."""
    return compute_global_scale(w, per_matrix=w.dim() >= 3)


def quantize_weight(w):
    """The rollout's packed weight: quantize(w, weight_global_scale(w))."""
    return quantize(w, weight_global_scale(w))


def fake_quantize_weight(w):
    """The trainer's QAT weight: bit-identical to dequantize(quantize_weight(w), w.dtype), with a
    straight-through gradient to w."""
    return fake_quantize(w, weight_global_scale(w).detach())


# ----------------------------------------------------------------------------- the activation rule
def quantize_activation(x, rac_mask=None):
    """The activation rule both sides of RL share: x (M, K) -> (x_q, residual_q).

    x_q = quantize(x) with the dynamic global scale amax(|x|) / 2688. With rac_mask (G,) bool, the
    residual r = x - DQ(x_q) (exact in fp32) is kept on the selected blocks, zeroed elsewhere, and
    quantized with x_q's global scale: residual_q. Without a mask residual_q is None (naive NVFP4).
    """
    x_q = quantize(x)
    if rac_mask is None:
        return x_q, None
    M, K = x.shape
    residual = x.float() - dequantize(x_q, torch.float32)                              # (M, K), exact
    residual = torch.where(rac_mask[None, :, None], residual.view(M, -1, BLOCK_SIZE), 0.0).view(M, K)
    return x_q, quantize(residual, x_q.global_scale)


def fake_quantize_activation(x, rac_mask=None):
    """DQ(x_q) + DQ(residual_q) of quantize_activation(x, rac_mask), in fp32, no gradient: the values
    a W4A4 GEMM multiplies (the residual term only where rac_mask selects)."""
    with torch.no_grad():
        x_q, residual_q = quantize_activation(x, rac_mask)
        values = dequantize(x_q, torch.float32)
        return values if residual_q is None else values + dequantize(residual_q, torch.float32)


# ----------------------------------------------------------------------------- Triton kernels
# One program quantizes BLOCKS consecutive 16-element blocks of the flattened (M*G, 16) input: a
# contiguous, coalesced tile. Per block: amax -> E4M3 scale (rounded by integer arithmetic on the
# fp32 bit pattern, so the GPU and the CPU interpreter, whose float8 casts differ, both match torch's
# cast); per element: count the E2M1 midpoints passed (the code), take the sign bit, pack neighbours
# into one byte. With FAKE=True the same program writes code_value * scale instead, in x's dtype.
#
# The programs work on element *pairs*: a (BLOCKS, 8) tile of even elements (2j) and one of odd
# elements (2j+1). A bf16 pair is one 32-bit word (element 2j in the low half, little-endian), so the
# input is read with wide int32 loads and split into two exact fp32 tiles by shifts, and the packed
# byte of a pair is simply code(even) | code(odd) << 4: no reshapes or shuffles inside the kernel.
if triton is not None:
    # the format's constants, as constexprs the kernels can read
    _E2M1_MAX = tl.constexpr(E2M1_MAX)
    _E4M3_MAX = tl.constexpr(E4M3_MAX)
    _E2M1_SIGN = tl.constexpr(E2M1_SIGN)
    _E4M3_NAN = tl.constexpr(0x7F)                   # the E4M3 NaN byte; also the mask of its 7 value bits
    _E4M3_MIN_NORMAL = tl.constexpr(2.0 ** -6)
    _E4M3_SUBNORMAL_STEP = tl.constexpr(2.0 ** -9)   # E4M3 subnormals are the multiples of 2^-9
    _E4M3_SUBNORMALS_PER_ONE = tl.constexpr(2.0 ** 9)
    _FP32_ROUND_TO_INT = tl.constexpr(2.0 ** 23)     # (x + 2^23) - 2^23 rounds 0 <= x < 2^23 to an integer
    # fp32 -> E4M3 keeps 3 of the 23 mantissa bits: add just under half of the dropped 20 bits' range
    # plus the kept lsb (ties to even), then clear them
    _E4M3_ROUND_BIAS = tl.constexpr((1 << 19) - 1)   # 0x7FFFF
    _E4M3_KEEP_MASK = tl.constexpr(-(1 << 20))       # sign, exponent and the top 3 mantissa bits
    _E4M3_EXPONENT_OFFSET = tl.constexpr(127 - 7)    # fp32 bias minus E4M3 bias
    _BF16_ROUND_BIAS = tl.constexpr((1 << 15) - 1)   # 0x7FFF: the same trick for fp32 -> bf16 (16 bits)
    _BF16_NAN = tl.constexpr(0x7FC0)
    _FP32_HALF = tl.constexpr(0x3F000000)            # the bit pattern of 0.5, E2M1 code 1

    @triton.jit
    def _e2m1_code_blocks(x, unit):
        """Codes (int32 0..15) of x (BLOCKS, n) in blocks whose divisor is unit (BLOCKS, 1); equals
        _encode_blocks. The magnitude counts the E2M1_MIDPOINTS times the unit that |x| passes (>= at
        the ties that round up, > at the others); the sign bit is x's own. Comparing with seven
        products per block replaces a division and a rounding per element: a third of the arithmetic,
        which is what bounds this kernel. A NaN unit (zero or NaN blocks) gives magnitude 0."""
        mag = tl.abs(x)
        code = (mag > unit * 0.25).to(tl.int32) + (mag >= unit * 0.75).to(tl.int32) \
            + (mag > unit * 1.25).to(tl.int32) + (mag >= unit * 1.75).to(tl.int32) \
            + (mag > unit * 2.5).to(tl.int32) + (mag >= unit * 3.5).to(tl.int32) \
            + (mag > unit * 5.0).to(tl.int32)
        negative = x.to(tl.int32, bitcast=True) < 0                             # the sign bit: -0.0 too
        return code | (negative.to(tl.int32) << 3)

    @triton.jit
    def _e2m1_value(code):
        """E2M1 codes (int32) -> fp32 values, built as fp32 bit patterns: code c >= 2 is
        2^((c >> 1) - 1) * (1 + (c & 1) / 2); code 1 is 0.5; code 0 is 0; bit 3 is the sign."""
        mag = code & 7
        normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)                 # exponent bias 127 - 1
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
        normal = (((exponent + _E4M3_EXPONENT_OFFSET) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP, normal)
        value = tl.where((byte & 0x80) != 0, -value, value)
        return tl.where((byte & _E4M3_NAN) == _E4M3_NAN, float("nan"), value)

    @triton.jit
    def _to_bf16_bits(value):
        """fp32 -> bf16 bit pattern (int32, low 16 bits), nearest-even, by integer arithmetic: the CPU
        interpreter's own fp32->bf16 cast truncates; on the GPU this equals torch's .to(bfloat16)."""
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + _BF16_ROUND_BIAS + ((bits >> 16) & 1)) >> 16
        return tl.where(value == value, bits, _BF16_NAN) & 0xFFFF                # keep NaN a NaN

    @triton.jit
    def _load_pairs(x_ptr, rows, pairs, mask, X_BF16: tl.constexpr):
        """(BLOCKS, 8) fp32 tiles of the even and the odd elements of blocks `rows`."""
        if X_BF16:
            words = tl.load(x_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0)  # int32 view
            even = (words << 16).to(tl.float32, bitcast=True)
            odd = (words & -65536).to(tl.float32, bitcast=True)                 # the high half, in place
        else:
            offs = rows[:, None] * 16 + 2 * pairs[None, :]
            even = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            odd = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.float32)
        return even, odd

    @triton.jit
    def _store_pairs(out_ptr, rows, pairs, even, odd, mask, OUT_BF16: tl.constexpr):
        if OUT_BF16:
            words = _to_bf16_bits(even) | (_to_bf16_bits(odd) << 16)            # int32 view
            tl.store(out_ptr + rows[:, None] * 8 + pairs[None, :], words, mask=mask)
        else:
            offs = rows[:, None] * 16 + 2 * pairs[None, :]
            tl.store(out_ptr + offs, even.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptr + offs + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_pairs(even, odd, global_scale):
        """The format's arithmetic on a tile of blocks: (BLOCKS, 8) even and odd fp32 elements and a
        global scale (scalar, or one per block) -> E2M1 codes of each half, the block scales as fp32
        and as E4M3 bit patterns (BLOCKS,). Shared with rac.py's fused activation quantizer."""
        # block amax and NaN/Inf detection (tl.max does not promise to propagate NaN)
        even_ok, odd_ok = tl.abs(even) < float("inf"), tl.abs(odd) < float("inf")  # False for NaN
        non_finite = tl.max((~even_ok | ~odd_ok).to(tl.int32), axis=1) > 0     # (BLOCKS,)
        block_amax = tl.maximum(tl.max(tl.where(even_ok, tl.abs(even), 0.0), axis=1),
                                tl.max(tl.where(odd_ok, tl.abs(odd), 0.0), axis=1))
        scale = tl.math.div_rn(tl.math.div_rn(block_amax, _E2M1_MAX), global_scale)
        scale = tl.minimum(tl.maximum(scale, 0.0), _E4M3_MAX)
        scale = tl.where(scale == scale, scale, 0.0)                            # NaN global scale
        block_scale, scale_byte = _e4m3_round(scale)
        block_scale = tl.where(non_finite, float("nan"), block_scale)
        scale_byte = tl.where(non_finite, _E4M3_NAN, scale_byte)
        denom = block_scale * global_scale                                      # (BLOCKS,)
        ok = (denom > 0) & (denom < float("inf"))
        unit = tl.where(ok, denom, float("nan"))[:, None]  # zero/NaN blocks: magnitude 0
        return _e2m1_code_blocks(even, unit), _e2m1_code_blocks(odd, unit), block_scale, scale_byte

    @triton.jit
    def _quantize_kernel(
        # pointers
        x_ptr, data_ptr, scale_ptr, global_scale_ptr, out_ptr,
        # sizes
        n_blocks, blocks_per_scale,
        # meta-parameters
        BLOCKS: tl.constexpr, FAKE: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
        PER_MATRIX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)               # block indices
        pairs = tl.arange(0, 8)
        in_range = rows < n_blocks
        mask = in_range[:, None]
        even, odd = _load_pairs(x_ptr, rows, pairs, mask, X_BF16)               # (BLOCKS, 8) each
        if PER_MATRIX:
            global_scale = tl.load(global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0)
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
            packed = (code_even | (code_odd << 4)).to(tl.uint8)                 # (BLOCKS, 8)
            tl.store(data_ptr + rows[:, None] * 8 + pairs[None, :], packed, mask=mask)
            tl.store(scale_ptr + rows, scale_byte.to(tl.uint8), mask=in_range)

    @triton.jit
    def _dequantize_kernel(
        # pointers
        data_ptr, scale_ptr, global_scale_ptr, out_ptr,
        # sizes
        n_blocks, blocks_per_scale,
        # meta-parameters
        BLOCKS: tl.constexpr, OUT_BF16: tl.constexpr, PER_MATRIX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        pairs = tl.arange(0, 8)
        in_range = rows < n_blocks
        mask = in_range[:, None]
        packed = tl.load(data_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0).to(tl.int32)
        block_scale = _e4m3_value(tl.load(scale_ptr + rows, mask=in_range, other=0).to(tl.int32))
        if PER_MATRIX:
            global_scale = tl.load(global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0)
            global_scale = global_scale[:, None]
        else:
            global_scale = tl.load(global_scale_ptr)
        value_even = _e2m1_value(packed & 0xF) * block_scale[:, None] * global_scale
        value_odd = _e2m1_value(packed >> 4) * block_scale[:, None] * global_scale
        _store_pairs(out_ptr, rows, pairs, value_even, value_odd, mask, OUT_BF16)


_BLOCKS_PER_PROGRAM = 128  # 2048 elements a program: 4 KB of bf16 in flight


def _launch_args(x_or_out, global_scale):
    """Sizes and flags shared by the quantize and dequantize launches."""
    n_blocks = x_or_out.numel() // BLOCK_SIZE
    per_matrix = global_scale.numel() > 1
    grid = (triton.cdiv(n_blocks, _BLOCKS_PER_PROGRAM),)
    return grid, n_blocks, n_blocks // global_scale.numel(), per_matrix


def _pair_view(t):
    """A bf16 tensor as int32 words of element pairs (the kernels' wide-load layout)."""
    return t.view(torch.int32) if t.dtype == torch.bfloat16 else t


def _require_triton():
    if triton is None:
        raise RuntimeError("the Triton kernels need the `triton` package; use quantize_reference instead")


def _contiguous_pairs(x):
    x = x.contiguous()
    if x.dtype == torch.bfloat16 and x.data_ptr() % 4:
        x = x.clone()  # int32 pair loads need 4-byte alignment (an odd-offset view)
    return x


def quantize_triton(x, global_scale=None):
    """The Triton quantize kernel (on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    _require_triton()
    _check_input(x)
    global_scale = _resolve_global_scale(x, global_scale).contiguous()
    x = _contiguous_pairs(x)
    data = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.float8_e4m3fn,
                              device=x.device)
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(x, global_scale)
    _quantize_kernel[grid](_pair_view(x), data, block_scale.view(torch.uint8), global_scale, data,
                           n_blocks, blocks_per_scale,
                           BLOCKS=_BLOCKS_PER_PROGRAM, FAKE=False, X_BF16=x.dtype == torch.bfloat16,
                           OUT_BF16=False, PER_MATRIX=per_matrix)
    return NVFP4Tensor(data, block_scale, global_scale)


def fake_quantize_triton(x, global_scale=None):
    """dequantize(quantize(x), x.dtype) in one fused kernel pass (no straight-through wrapper)."""
    _require_triton()
    _check_input(x, "fake_quantize")
    global_scale = _resolve_global_scale(x, global_scale, "fake_quantize").contiguous()
    x = _contiguous_pairs(x)
    out = torch.empty_like(x)
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(x, global_scale)
    is_bf16 = x.dtype == torch.bfloat16
    _quantize_kernel[grid](_pair_view(x), x, x, global_scale, _pair_view(out),
                           n_blocks, blocks_per_scale,
                           BLOCKS=_BLOCKS_PER_PROGRAM, FAKE=True, X_BF16=is_bf16, OUT_BF16=is_bf16,
                           PER_MATRIX=per_matrix)
    return out


def dequantize_triton(q, dtype=torch.bfloat16):
    """The Triton dequantize kernel: code_value * block_scale * global_scale in fp32, then cast."""
    _require_triton()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    global_scale = q.global_scale.contiguous()
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(out, global_scale)
    _dequantize_kernel[grid](q.data.contiguous(), q.block_scale.contiguous().view(torch.uint8),
                             global_scale, _pair_view(out), n_blocks, blocks_per_scale,
                             BLOCKS=_BLOCKS_PER_PROGRAM, OUT_BF16=dtype == torch.bfloat16,
                             PER_MATRIX=per_matrix)
    return out
