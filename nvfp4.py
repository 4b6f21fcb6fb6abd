"""NVFP4, the 4-bit floating-point format the rollouts run in: its definition, a plain-PyTorch
reference, and the public API both sides of RL quantize through.

An NVFP4 tensor stores every value as a 4-bit float (E2M1) times two scales, x ~= code_value *
block_scale * global_scale:
- E2M1 code: sign bit 3, then 3 magnitude bits; magnitudes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6
  (fine near zero, coarse near the top). Codes 8..15 are the same magnitudes negated; code 8 is -0.
- Blocks of 16 consecutive elements along the last (K) dimension share one block scale, an FP8 E4M3
  number (max 448, no infinities, 0x7F is NaN).
- One FP32 global scale, the *decode* scale amax(|x|) / (6 * 448): the largest block scale lands on
  E4M3's maximum. One per matrix (E,) of a stack (E, N, K), or per row (M,) of an activation (M, K).
- Two codes per byte along the last dimension: element 2i in the low nibble, 2i+1 in the high one.

Quantizing x (..., K), K a multiple of 16 (G = K / 16 blocks per row):

    global_scale = amax(|x|) / 2688                                    # fp32; 2688 = 6 * 448
    block_scale  = e4m3(clamp(block_amax / 6 / global_scale, 0, 448))  # (..., G), nearest-even
    unit         = float(block_scale) * global_scale                   # (..., G), block's divisor
    code         = e2m1(x / unit)                                      # (..., K)
    dequantize   = code_value * float(block_scale) * global_scale      # fp32, then cast

Rounding. e2m1 rounds to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating beyond 6: the E4M3 rounding of the block scale can put a
block's largest element slightly above 6 units, the format's only clipping. x / unit is never
computed: the magnitude is the number of midpoints times the unit (fp32 products 0.25 * unit, ...,
5 * unit) that |x| passes, strictly where the code below the midpoint is even, inclusively where it
is odd (round-to-nearest-even of x / unit but within half an fp32 ulp of a midpoint). Every fp32
step is correctly rounded, in this order, so the reference and the kernels agree bit for bit. A code
keeps its input's sign bit (as PTX cvt.rn.satfinite.e2m1x2.f32 and torchao): -0.1 * unit is -0.

Edge cases, one behaviour each:
- zero block (all zero, or amax below about 2^-19 of the tensor's): block_scale 0, codes of
  magnitude 0 with the inputs' signs.
- all-zero tensor: global scale 1.0 (keeps dequantize exact); every block is a zero block.
- subnormal inputs are ordinary small numbers: scaled, never flushed to zero.
- NaN or +-Inf: the block's scale is the E4M3 NaN, so its 16 values dequantize to NaN; a computed
  global scale of a tensor holding one is NaN, so the whole tensor is.

The rules both sides of RL share are defined here, once. The weight rule: quantize_weight (the
rollout's packed weights) and fake_quantize_weight (the trainer's fake-quantized forward, in qat.py,
read after rac.py) share weight_global_scale, one scale per linear weight (N, K) and one per expert
of stacked (E, N, K) weights, so they agree bit for bit. The activation rule, quantize_activation:
a dynamic global scale per tensor or per row and, on the blocks a mask selects, the residual
r = x - DQ(Q(x)) quantized again (RAC's compensation, in rac.py, read after train.py).

Fast path: on CUDA tensors quantize, dequantize and fake_quantize run gpu_kernels/nvfp4_quantize.py
(Triton: one read of x, one write; fake_quantize fused), chosen in `_use_triton`. Left out: MX
formats, stochastic rounding, per-row weight scales, Blackwell's swizzled scale layout.

Shape letters: K last (reduction) dim, G = K / 16 blocks per row, M product of the leading dims."""

from dataclasses import dataclass

import torch

# triton ships with CUDA builds of torch on Linux; without it the torch twin runs
try:
    from gpu_kernels import nvfp4_quantize
except ImportError:
    nvfp4_quantize = None

BLOCK_SIZE = 16
ACT_SCALES = ("tensor", "row")  # an activation's global scale: one per tensor, or one per row
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# 2688: the tensor's amax maps onto the largest block scale
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX
# Magnitudes of the 8 E2M1 codes; code c (0..15) decodes to
# sign(c & E2M1_SIGN) * E2M1_VALUES[c & 7].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN = 8
# Midpoints between neighbouring magnitudes. A value exactly on a midpoint goes to the even code:
# up when the code below is odd (ROUND_UP_AT_TIE), down when it is even.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
ROUND_UP_AT_TIE = (False, True, False, True, False, True, False)


@dataclass
class NVFP4Tensor:
    """A quantized tensor: packed codes plus the two levels of scale. `shape` is the logical
    shape."""

    data: torch.Tensor  # uint8 (..., K/2): two E2M1 codes per byte, low nibble first
    block_scale: torch.Tensor  # float8_e4m3fn (..., K/16)
    global_scale: torch.Tensor  # float32 decode scale: a scalar, or one per matrix (shape[:-2])

    @property
    def shape(self):
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    @property
    def device(self):
        return self.data.device

    def dequantize(self, dtype=torch.bfloat16):
        return dequantize(self, dtype)


# -------------------------------------------------------------------------------- codes and packing
def _encode_blocks(x, unit):
    """E2M1 codes (uint8 0..15) of x measured in units of `unit` (its block's divisor, broadcast
    against x): the number of midpoints m * unit (fp32 products) that |x| passes, strictly where the
    code below the midpoint is even and inclusively where it is odd (round-to-nearest, ties to
    even), with x's sign bit as bit 3. A NaN unit passes no midpoint: magnitude 0."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(E2M1_MIDPOINTS, ROUND_UP_AT_TIE):
        threshold = mid * unit
        code += (mag >= threshold) if up else (mag > threshold)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def encode_e2m1(x):
    """Round already-scaled values to E2M1 codes (uint8 in 0..15), ties to even, saturating at
    +-6."""
    return _encode_blocks(x, torch.ones((), dtype=torch.float32, device=x.device))


_DECODE_TABLES = {}  # (dtype, device) -> the 16 signed values, built once


def decode_e2m1(code, dtype=torch.float32):
    """E2M1 codes (uint8 in 0..15) to their values (code 8 to -0.0): one lookup in the 16 signed
    values (codes 8..15 are 0..7 negated), five times faster on a CPU than building the table per
    call."""
    table = _DECODE_TABLES.get((dtype, code.device))
    if table is None:
        signed = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
        table = torch.tensor(signed, dtype=dtype, device=code.device)
        _DECODE_TABLES[dtype, code.device] = table
    index = (code.reshape(-1) & 15).int()  # bits above 3 ignored
    return table.index_select(0, index).view(code.shape)


def pack_codes(code):
    """(..., K) codes in 0..15 -> (..., K/2) bytes, element 2i in the low nibble, 2i+1 in the
    high."""
    if code.shape[-1] % 2:
        raise ValueError(f"pack_codes: code's last dim must be even, got shape {tuple(code.shape)}")
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_codes(packed):
    """(..., K/2) bytes -> (..., K) codes; the exact inverse of pack_codes."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# -------------------------------------------------------------------------- scales and input checks
def _check_input(x, name="quantize"):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: x must be float32, float16 or bfloat16, got dtype {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(
            f"{name}: x must be non-empty with at least one dim, got shape {tuple(x.shape)}"
        )
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{name}: x's last dim must be a multiple of the block size {BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )


def compute_global_scale(x, per_matrix=False):
    """amax(|x|) / (6 * 448) in float32; 1.0 where x is all zero; NaN where x holds NaN/Inf.

    A scalar, or with per_matrix=True one scale per matrix of a stack (..., N, K): shape
    x.shape[:-2].
    """
    if per_matrix and x.dim() < 3:
        raise ValueError(
            f"compute_global_scale: per_matrix=True needs x of shape (..., N, K), "
            f"got shape {tuple(x.shape)}"
        )
    # torch's inf-norm reads x once with no |x| temporary; on the GPU it is as fast as a Triton
    # atomic-max kernel (README), so it is the one path
    dims = (-2, -1) if per_matrix else None
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=dims).float()
    # divide by a tensor, not a Python scalar: CUDA turns scalar division into a reciprocal
    # multiply, which would differ from the CPU in the last bit
    scale = amax / torch.full_like(amax, GLOBAL_SCALE_DIVISOR)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _resolve_global_scale(x, global_scale, name="quantize"):
    """The caller's global scale as a float32 tensor (a scalar, one per matrix or one per row), or a
    computed one."""
    if global_scale is None:
        return compute_global_scale(x)
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), device=x.device)
    if global_scale.device != x.device:
        raise ValueError(f"{name}: global_scale is on {global_scale.device} but x is on {x.device}")
    if global_scale.numel() == 1:
        return global_scale.reshape(()).float()
    per_matrix_shape = tuple(x.shape[:-2]) if x.dim() >= 3 else None
    per_row_shape = tuple(x.shape[:-1])
    if tuple(global_scale.shape) in (per_matrix_shape, per_row_shape):
        return global_scale.float()
    raise ValueError(
        f"{name}: global_scale must be a scalar, one per matrix (shape {tuple(x.shape[:-2])}) "
        f"or one per row (shape {tuple(x.shape[:-1])}), got shape {tuple(global_scale.shape)} "
        f"for x of shape {tuple(x.shape)}"
    )


def _broadcastable(global_scale, ndim):
    """View a global scale (a scalar, x.shape[:-2] or x.shape[:-1]) with trailing 1s up to ndim
    dims."""
    return global_scale.reshape(*global_scale.shape, *([1] * (ndim - global_scale.dim())))


# ---------------------------------------------------------------------------- reference (slow twin)
def quantize_reference(x, global_scale=None):
    """Plain-PyTorch NVFP4 quantization; the definition the Triton kernel must match bit for bit."""
    _check_input(x)
    global_scale = _resolve_global_scale(x, global_scale)
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)  # (..., G, 16)
    block_amax = blocks.abs().amax(dim=-1)  # (..., G), NaN if any is
    non_finite = ~torch.isfinite(block_amax)  # (..., G) blocks with NaN/Inf
    global_view = _broadcastable(global_scale, x.dim())  # (..., 1, 1), (..., 1) or ()
    six = torch.full_like(block_amax, E2M1_MAX)  # a tensor divisor: true division on CUDA too
    scale = (block_amax / six / global_view).clamp(0.0, E4M3_MAX).to(torch.float8_e4m3fn).float()
    block_scale = torch.where(non_finite, torch.full_like(scale, float("nan")), scale)
    block_scale = block_scale.to(torch.float8_e4m3fn)  # (..., G)
    denom = block_scale.float() * global_view  # (..., G)
    ok = (denom > 0) & torch.isfinite(denom)
    # zero and NaN blocks get a NaN unit, which passes no midpoint: magnitude 0
    unit = torch.where(ok, denom, torch.full_like(denom, float("nan")))
    code = _encode_blocks(blocks, unit.unsqueeze(-1)).reshape(x.shape)
    return NVFP4Tensor(pack_codes(code), block_scale, global_scale)


def dequantize_reference(q, dtype=torch.bfloat16):
    """Plain-PyTorch dequantization: code_value * block_scale * global_scale in fp32, then cast."""
    values = decode_e2m1(unpack_codes(q.data))  # (..., K)
    values = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE)  # (..., G, 16)
    global_view = _broadcastable(q.global_scale, values.dim())
    out = values * q.block_scale.float().unsqueeze(-1) * global_view  # (..., G, 16)
    return out.reshape(q.shape).to(dtype)


# --------------------------------------------------------------------------------------- public API
def _use_triton(x):
    # The one place the fast path is chosen: Triton on CUDA tensors, the torch twin elsewhere.
    return nvfp4_quantize is not None and x.is_cuda


def quantize(x, global_scale=None):
    """Quantize a float tensor (..., K), K % 16 == 0, to NVFP4.

    global_scale: optional caller-supplied decode scale (float or scalar tensor), so that several
    tensors (fused q/k/v, gate/up) can share one; values beyond 6 * 448 * global_scale saturate.
    For a stack of matrices (..., N, K) it may be a tensor of shape x.shape[:-2]: one per matrix
    (see compute_global_scale(x, per_matrix=True)), as the experts' stacked weights use.
    """
    _check_input(x)
    if _use_triton(x):
        global_scale = _resolve_global_scale(x, global_scale).contiguous()
        return NVFP4Tensor(*nvfp4_quantize.quantize(x, global_scale), global_scale)
    return quantize_reference(x, global_scale)


def dequantize(q, dtype=torch.bfloat16):
    """NVFP4Tensor -> dense tensor of `dtype`: code_value * block_scale * global_scale in fp32."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"dequantize: q must be an NVFP4Tensor, got {type(q).__name__}")
    if q.block_scale.device != q.data.device or q.global_scale.device != q.data.device:
        raise ValueError(
            f"dequantize: q.data is on {q.data.device}, q.block_scale on "
            f"{q.block_scale.device}, q.global_scale on {q.global_scale.device}: "
            "all must be on one device"
        )
    if _use_triton(q.data):
        return nvfp4_quantize.dequantize(q.data, q.block_scale, q.global_scale, dtype)
    return dequantize_reference(q, dtype)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(x)) in x's dtype. Backward: identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, global_scale):
        if _use_triton(x):
            global_scale = _resolve_global_scale(x, global_scale, "fake_quantize").contiguous()
            return nvfp4_quantize.fake_quantize(x, global_scale)
        return dequantize_reference(quantize_reference(x, global_scale), x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None


def fake_quantize(x, global_scale=None):
    """Quantize then dequantize, in x's dtype, with a straight-through (identity) gradient."""
    _check_input(x, "fake_quantize")
    return _FakeQuantize.apply(x, global_scale)


def weight_global_scale(w):
    """The global-scale rule for weights, shared by the trainer's QAT and the rollout's packed
    weights (qat.py and rac.py, read after train.py): one scale per tensor for a linear layer's
    (N, K) weight, one per expert for stacked (E, N, K) expert weights (the fused gate/up rows of an
    expert share theirs)."""
    return compute_global_scale(w, per_matrix=w.dim() >= 3)


def quantize_weight(w):
    """The rollout's packed weight: quantize(w, weight_global_scale(w))."""
    return quantize(w, weight_global_scale(w))


def fake_quantize_weight(w):
    """The trainer's QAT weight: bit-identical to dequantize(quantize_weight(w), w.dtype), with a
    straight-through gradient to w."""
    return fake_quantize(w, weight_global_scale(w).detach())


# ------------------------------------------------------------------------------ the activation rule
def activation_global_scale(x, act_scale="tensor"):
    """The dynamic global scale of an activation x (M, K): amax(|x|) / 2688 over the tensor ()
    ("tensor", the paper's), or over each row (M,) ("row": a row's rounding then does not depend on
    its batch)."""
    if act_scale not in ACT_SCALES:
        raise ValueError(f"act_scale must be one of {list(ACT_SCALES)}, got {act_scale!r}")
    if act_scale == "tensor":
        return compute_global_scale(x)
    return compute_global_scale(x[:, None], per_matrix=True)  # each row a (1, K) matrix


def quantize_activation(x, rac_mask=None, act_scale="tensor"):
    """The activation rule both sides of RL share: x (M, K) -> (x_q, residual_q).

    x_q = quantize(x) with the dynamic global scale activation_global_scale(x, act_scale). With
    rac_mask (G,) bool, the residual r = x - DQ(x_q) (exact in fp32) is kept on the selected blocks,
    zeroed elsewhere, and quantized with x_q's global scale: residual_q. Without a mask residual_q
    is None.
    """
    x_q = quantize(x, activation_global_scale(x, act_scale))
    if rac_mask is None:
        return x_q, None
    M, K = x.shape
    residual = x.float() - dequantize(x_q, torch.float32)  # (M, K), exact
    residual_blocks = residual.view(M, -1, BLOCK_SIZE)  # (M, G, 16)
    residual = torch.where(rac_mask[None, :, None], residual_blocks, 0.0).view(M, K)
    return x_q, quantize(residual, x_q.global_scale)


def fake_quantize_activation(x, rac_mask=None, act_scale="tensor"):
    """DQ(x_q) + DQ(residual_q) of quantize_activation(x, rac_mask, act_scale), in fp32, no
    gradient: the values a W4A4 GEMM multiplies (the residual term only where rac_mask selects)."""
    with torch.no_grad():
        x_q, residual_q = quantize_activation(x, rac_mask, act_scale)
        values = dequantize(x_q, torch.float32)
        return values if residual_q is None else values + dequantize(residual_q, torch.float32)
