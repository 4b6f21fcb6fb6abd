"""NVFP4: the 4-bit floating-point format that rollouts run in, in one file.

An NVFP4 tensor stores every value as a 4-bit float (E2M1) times two scales:

    x  ~=  code_value * block_scale * global_scale

- E2M1 code: 1 sign bit (bit 3) and 3 magnitude bits. The 8 magnitudes are

      code  0    1    2    3    4    5    6    7
      value 0    0.5  1    1.5  2    3    4    6

  so the grid is fine near zero and coarse near the top: relative spacing 1/3 to 1/2.
- Blocks of 16 consecutive elements along the last (reduction, K) dimension share one block scale,
  stored as an FP8 E4M3 number (4 exponent bits, 3 mantissa bits, max 448, no infinities).
- One FP32 global (tensor) scale per tensor, a *decode* scale: global_scale = amax(|x|) / (6 * 448),
  chosen so that the largest block scale lands on E4M3's maximum. A stack of matrices (the experts'
  weights, (E, N, K)) may instead carry one global scale per matrix, shape (E,): `per_matrix=True`.
- Two codes per byte along the last dimension: element 2i in the low nibble, 2i+1 in the high one.

Quantizing a tensor x of shape (..., K), K a multiple of 16 (G = K / 16 blocks per row):

    global_scale = amax(|x|) / 2688                                     # fp32 scalar
    block_scale  = e4m3(clamp(block_amax / 6 / global_scale, 0, 448))   # (..., G), RNE
    unit         = float(block_scale) * global_scale                    # (..., G), the block's divisor
    code         = e2m1(x / unit)                                       # (..., K), RNE, saturating at 6
    dequantize   = code_value * unit                                    # fp32, then cast

The element rounding is done without dividing: code = the number of grid midpoints m_i * unit
(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 times the unit, as fp32 products) that |x| passes, which is
round-to-nearest of x / unit with ties to even, except within half an fp32 ulp of a midpoint where
the product's rounding decides. Every fp32 operation is a correctly rounded IEEE division or
multiplication in exactly this order, so the torch reference and the Triton kernel agree bit for bit
(tested, also on every bf16 bit pattern).

Rounding to E2M1 is round-to-nearest with ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and everything beyond 6 saturates to 6. The block scale is
rounded to nearest-even by the E4M3 cast, so |x| / (block_scale * global_scale) can slightly exceed 6
for a block's largest element: it saturates, which is the only clipping this format does.

Edge cases, one behaviour each:
- zero blocks: a block whose scale rounds to 0 (an all-zero block, or one more than ~2^17 times
  smaller than the tensor's largest value) stores block_scale 0 and codes 0: it dequantizes to 0.
- an all-zero tensor: amax is 0, so the global scale would be 0; it is set to 1.0 instead and every
  block is a zero block. Any positive value would do; 1.0 keeps dequantize exact.
- subnormal inputs (bf16/fp32 denormals) are ordinary small numbers here: they are quantized like any
  other value (no flush to zero before scaling), and land on zero only when the grid says so.
- negative values that round to magnitude 0 are stored as +0 (code 0, never 8): one zero.
- NaN and +-Inf propagate as NaN, never as a silent finite value: a block that holds one gets the
  E4M3 NaN as its block scale (its 16 values dequantize to NaN), and a computed global scale of a
  tensor that holds one is NaN (the whole tensor dequantizes to NaN). train.py stops on NaN losses.

Fast path: on CUDA tensors `quantize` runs a Triton kernel (one read of x, one write of codes and
scales; the global amax is one more read, done by torch). Its slow twin, `quantize_reference`, is
plain PyTorch and is what runs on the CPU; tests compare them bit for bit, on the CPU under
TRITON_INTERPRET=1 and on the GPU. `fake_quantize` (quantize then dequantize, with a straight-through
gradient) has a fused Triton kernel as well, bit-identical to dequantize(quantize(x)).

Deliberately left out: MX formats (E8M0 scales, 32-element blocks), stochastic rounding, per-row
global scales, and the swizzled 128x4 block-scale layout Blackwell tensor cores want (rac.py lays
out what its kernels need).
"""
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch on Linux; without it the torch twin runs
    triton = None

# Shape letters: K = last (reduction) dim, G = K / 16 blocks, M = product of leading dims.

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitudes of the 8 E2M1 codes; code c (0..15) decodes to sign(c & 8) * E2M1_VALUES[c & 7].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
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
def encode_e2m1(x):
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), ties to even, saturating at +-6."""
    return _encode_blocks(x, torch.ones((), dtype=torch.float32, device=x.device))


def _encode_blocks(x, unit):
    """E2M1 codes of x measured in units of `unit` (its block's divisor, broadcast against x): the
    number of midpoints m * unit (fp32 products) that |x| passes, strictly where the code below the
    midpoint is even and inclusively where it is odd, which is round-to-nearest, ties to even."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(E2M1_MIDPOINTS, ROUND_UP_AT_TIE):
        threshold = mid * unit
        code += (mag >= threshold) if up else (mag > threshold)
    sign = (x < 0) & (code > 0)  # magnitude 0 is always stored as +0
    return code | (sign.to(torch.uint8) << 3)


def decode_e2m1(code, dtype=torch.float32):
    """E2M1 codes (uint8 in 0..15) to their values."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=code.device)
    value = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -value, value)


def pack_codes(code):
    """(..., K) codes in 0..15 -> (..., K/2) bytes, element 2i in the low nibble, 2i+1 in the high."""
    if code.shape[-1] % 2:
        raise ValueError(f"pack_codes: last dim must be even, got shape {tuple(code.shape)}")
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_codes(packed):
    """(..., K/2) bytes -> (..., K) codes; the exact inverse of pack_codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- input checks
def _check_input(x, name="quantize"):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: expected a float32/float16/bfloat16 tensor, got dtype {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor with at least one dim, got shape {tuple(x.shape)}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: last dim must be a multiple of the block size {BLOCK_SIZE}, "
                         f"got shape {tuple(x.shape)}")


def compute_global_scale(x, per_matrix=False):
    """amax(|x|) / (6 * 448) in float32; 1.0 where x is all zero; NaN where x holds NaN/Inf.

    A scalar, or with per_matrix=True one scale per matrix of a stack (..., N, K): shape x.shape[:-2].
    """
    if per_matrix and x.dim() < 3:
        raise ValueError(f"per_matrix global scales need a stack of matrices (..., N, K), got shape {tuple(x.shape)}")
    # torch's inf-norm reads x once with no |x| temporary; on the H200 it matched or beat a Triton
    # atomic-max kernel (16384^2 bf16: 187 vs 195 us; 8192^2: 77 vs 153 us), so it stays the one path.
    dims = (-2, -1) if per_matrix else None
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=dims).float()
    # divide by a tensor, not a Python scalar: CUDA turns scalar division into a reciprocal multiply,
    # which would differ from the CPU in the last bit
    scale = amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _resolve_global_scale(x, global_scale):
    if global_scale is None:
        return compute_global_scale(x)
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), device=x.device)
    if global_scale.device != x.device:
        raise ValueError(f"global_scale is on {global_scale.device} but x is on {x.device}")
    if global_scale.numel() == 1:
        return global_scale.reshape(()).float()
    if x.dim() >= 3 and tuple(global_scale.shape) == tuple(x.shape[:-2]):
        return global_scale.float()
    raise ValueError(f"global_scale must be a scalar or one per matrix (shape {tuple(x.shape[:-2])}), "
                     f"got shape {tuple(global_scale.shape)} for x of shape {tuple(x.shape)}")


def _broadcastable(global_scale, extra_dims):
    """View a per-matrix global scale (shape[:-2]) so it broadcasts over `extra_dims` trailing dims."""
    return global_scale.reshape(*global_scale.shape, *([1] * extra_dims))


# ----------------------------------------------------------------------------- reference (slow twin)
def quantize_reference(x, global_scale=None):
    """Plain-PyTorch NVFP4 quantization; the definition the Triton kernel must match bit for bit."""
    _check_input(x)
    global_scale = _resolve_global_scale(x, global_scale)
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)           # (..., G, 16)
    block_amax = blocks.abs().amax(dim=-1)                              # (..., G)
    bad = ~torch.isfinite(blocks).all(dim=-1)                           # blocks holding NaN/Inf
    gs = _broadcastable(global_scale, 2)                                # (..., 1, 1) or ()
    six = torch.full_like(block_amax, E2M1_MAX)  # a tensor divisor: true division on CUDA too
    scale = (block_amax / six / gs).clamp(0.0, E4M3_MAX)
    block_scale = scale.to(torch.float8_e4m3fn)
    block_scale = torch.where(bad, torch.full_like(scale, float("nan")), block_scale.float()).to(torch.float8_e4m3fn)
    denom = block_scale.float() * gs                                    # (..., G)
    ok = (denom > 0) & torch.isfinite(denom)                            # zero and NaN blocks store code 0
    unit = torch.where(ok, denom, torch.full_like(denom, float("nan")))  # every comparison false: code 0
    code = _encode_blocks(blocks, unit.unsqueeze(-1)).reshape(x.shape)
    return NVFP4Tensor(pack_codes(code), block_scale, global_scale)


def dequantize_reference(q, dtype=torch.bfloat16):
    values = decode_e2m1(unpack_codes(q.data))                          # (..., K)
    values = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE)         # (..., G, 16)
    out = values * q.block_scale.float().unsqueeze(-1) * _broadcastable(q.global_scale, 3)
    return out.reshape(q.shape).to(dtype)


# ----------------------------------------------------------------------------- Triton kernels
# One program quantizes BLOCKS consecutive 16-element blocks of the flattened (M*G, 16) input: a
# contiguous, coalesced (BLOCKS, 16) tile. Per block: amax -> E4M3 scale; per element: divide by the
# scale (div_rn: correctly rounded, like torch), count the E2M1 midpoints passed (the code), pack
# neighbours into one byte. With FAKE=True the same program writes code_value * scale instead (the
# fused fake-quantize used by QAT), in the input's dtype.
if triton is not None:
    @triton.jit
    def _e2m1_code(scaled):
        """Scaled fp32 values -> E2M1 codes (int32 0..15), ties to even, saturating; = encode_e2m1.

        Integer arithmetic on the fp32 bit pattern (no float<->int conversions, which run at a fraction
        of the ALU rate): for 1 <= |q|, E2M1 is fp32 with one mantissa bit, so rounding the mantissa
        to 1 bit (ties to even: add 0x1FFFFF plus the kept lsb) and reading exponent+mantissa gives the
        code (1.0 -> 2, ..., 6.0 -> 7; larger saturates at 7). Below 1 the grid is 0, 0.5, 1 and the
        two midpoints are compared directly (positive floats order like their bit patterns):
        |q| > 0.25 -> at least 0.5, |q| >= 0.75 -> 1 (both ties go to the even code).
        """
        bits = scaled.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        big = tl.minimum(((mag + 0x1FFFFF + ((mag >> 22) & 1)) >> 22) - 252, 7)
        small = (mag > 0x3E800000).to(tl.int32) + (mag >= 0x3F400000).to(tl.int32)
        code = tl.where(mag >= 0x3F800000, big, small)
        sign = (bits < 0) & (code > 0)                                          # -0 and tiny negatives: +0
        return code | (sign.to(tl.int32) << 3)

    @triton.jit
    def _e2m1_code_blocks(x, unit):
        """Codes of x (BLOCKS, n) in blocks whose divisor is unit (BLOCKS, 1); = _encode_blocks.

        Comparing |x| with the seven midpoints times the block's divisor (fp32 products, one set per
        block) replaces a division and a rounding per element: a third of the arithmetic, which is
        what bounds this kernel. A NaN divisor (zero or NaN blocks) yields code 0.
        """
        mag = tl.abs(x)
        code = (mag > 0.25 * unit).to(tl.int32) + (mag >= 0.75 * unit).to(tl.int32) \
            + (mag > 1.25 * unit).to(tl.int32) + (mag >= 1.75 * unit).to(tl.int32) \
            + (mag > 2.5 * unit).to(tl.int32) + (mag >= 3.5 * unit).to(tl.int32) \
            + (mag > 5.0 * unit).to(tl.int32)
        sign = x < -0.25 * unit                                                 # negative and code > 0
        return code | (sign.to(tl.int32) << 3)

    @triton.jit
    def _e2m1_value(code):
        """E2M1 codes (int32) -> fp32 values, built as fp32 bit patterns: code c >= 2 is
        2^((c >> 1) - 1) * (1 + (c & 1) / 2); code 1 is 0.5; code 0 is 0; bit 3 is the sign."""
        mag = code & 7
        normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
        bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 0x3F000000, 0))
        return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_round(v):
        """Round fp32 v in [0, 448] to E4M3, nearest-even; returns (value as fp32, E4M3 bit pattern).

        Done with integer arithmetic rather than a float8 cast so that every backend (GPU, and the
        CPU interpreter, whose fp8 casts differ) rounds identically to torch's cast. Normal range
        (v >= 2^-6): round the fp32 mantissa to 3 bits, ties to even, by adding 0x7FFFF plus the kept
        lsb and truncating. Subnormal range: multiples of 2^-9, rounded with the 2^23 magic number.
        """
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        subnormal = ((v * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        value = tl.where(v >= 0.015625, normal, subnormal)
        vbits = value.to(tl.int32, bitcast=True)
        normal_byte = ((((vbits >> 23) & 0xFF) - 120) << 3) | ((vbits >> 20) & 7)
        subnormal_byte = (value * 512.0).to(tl.int32)
        byte = tl.where(value >= 0.015625, normal_byte, subnormal_byte)
        return value, byte

    @triton.jit
    def _e4m3_value(byte):
        """E4M3 bit patterns (int32 0..255) -> fp32, by bit arithmetic (see _e4m3_round for why)."""
        exponent, mantissa = (byte >> 3) & 0xF, byte & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        value = tl.where((byte & 0x80) != 0, -value, value)
        return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)

    @triton.jit
    def _to_bf16_bits(value):
        """fp32 -> bf16 bit pattern (int32, low 16 bits), nearest-even, by integer arithmetic: the CPU
        interpreter's own fp32->bf16 cast truncates; on the GPU this equals torch's .to(bfloat16)."""
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(value == value, bits, 0x7FC0) & 0xFFFF                  # keep NaN a NaN

    # Both kernels work on element *pairs*: a program holds a (BLOCKS, 8) tile of even elements
    # (2j) and one of odd elements (2j+1) of BLOCKS 16-element blocks. For bf16 a pair is one 32-bit
    # word (element 2j in the low half, little-endian), so the input is read with wide int32 loads
    # and split into two exact fp32 tiles by shifts, and the packed byte of a pair is simply
    # code(even) | code(odd) << 4: no reshapes or shuffles inside the kernel.
    @triton.jit
    def _load_pairs(x_ptr, rows, pairs, mask, X_BF16: tl.constexpr):
        if X_BF16:
            words = tl.load(x_ptr + rows[:, None] * 8 + pairs[None, :], mask=mask, other=0)  # int32 view
            even = (words << 16).to(tl.float32, bitcast=True)
            odd = (words & -65536).to(tl.float32, bitcast=True)
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
        bad = tl.max((~even_ok | ~odd_ok).to(tl.int32), axis=1) > 0            # (BLOCKS,)
        block_amax = tl.maximum(tl.max(tl.where(even_ok, tl.abs(even), 0.0), axis=1),
                                tl.max(tl.where(odd_ok, tl.abs(odd), 0.0), axis=1))
        scale = tl.math.div_rn(tl.math.div_rn(block_amax, 6.0), global_scale)
        scale = tl.minimum(tl.maximum(scale, 0.0), 448.0)
        scale = tl.where(scale == scale, scale, 0.0)                            # NaN global scale
        block_scale, scale_byte = _e4m3_round(scale)
        block_scale = tl.where(bad, float("nan"), block_scale)
        scale_byte = tl.where(bad, 0x7F, scale_byte)                            # the E4M3 NaN
        denom = block_scale * global_scale                                      # (BLOCKS,)
        ok = (denom > 0) & (denom < float("inf"))
        unit = tl.where(ok, denom, float("nan"))[:, None]  # zero/NaN blocks: every comparison false, code 0
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
        data_ptr, scale_ptr, global_scale_ptr, out_ptr,
        n_blocks, blocks_per_scale,
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
            global_scale = tl.load(global_scale_ptr + rows // blocks_per_scale, mask=in_range, other=1.0)[:, None]
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
    global_scale = _resolve_global_scale(x, global_scale).contiguous()
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
    _require_triton()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    global_scale = q.global_scale.contiguous()
    grid, n_blocks, blocks_per_scale, per_matrix = _launch_args(out, global_scale)
    _dequantize_kernel[grid](q.data.contiguous(), q.block_scale.contiguous().view(torch.uint8),
                             global_scale, _pair_view(out), n_blocks, blocks_per_scale,
                             BLOCKS=_BLOCKS_PER_PROGRAM, OUT_BF16=dtype == torch.bfloat16,
                             PER_MATRIX=per_matrix)
    return out


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
        raise ValueError(f"dequantize: expected an NVFP4Tensor, got {type(q).__name__}")
    if q.block_scale.device != q.data.device or q.global_scale.device != q.data.device:
        raise ValueError(f"dequantize: data on {q.data.device}, block_scale on {q.block_scale.device}, "
                         f"global_scale on {q.global_scale.device}: all must be on one device")
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


# ----------------------------------------------------------------------------- weights: one rule for both sides
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
