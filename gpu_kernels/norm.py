"""RMSNorm, and the per-head RMSNorm + RoPE of queries and keys, as Triton kernels.

Twins (in moe.py): rms_norm_reference, and apply_rope(rms_norm(x).transpose(1, 2), cos, sin).

RMSNorm: y = w * cast(x * rsqrt(mean(x^2) + eps)), statistics in fp32. One program per row holds the
row in registers (D <= MAX_DIM): its sum of squares in fp32, in another order than torch's reduction
(so equal to fp32 rounding, not bit for bit), then the twin's two casts (x_normed back to x's dtype,
then the product in the promoted dtype). Eight small launches per call become one; a decode step
calls RMSNorm four times a layer.

Norm + RoPE: one program per (token, head) row takes the row's statistics and casts exactly as the
RMSNorm kernel does (same load, _inv_rms and _scaled, same warps), then makes every rounding torch's
BF16 ops make in RoPE, y = x * cos + rotate_half(x) * sin (each product, their sum): bit for bit the
composition on the GPU. The element rotate_half brings to position j is loaded a second time
(from L1) rather than shuffled. One launch where the norm and RoPE took six (mul, neg, cat, mul,
add).

Roundings are made by integer arithmetic (rounding.round_to), for BF16 and FP32 only: the
interpreter's own cast truncates, and the compiler cannot fuse a rounding it does not see. FP16 is
refused.

Shape letters: B batch, T tokens, h heads, hd head dim, D row width.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.rounding import ROUNDED_DTYPES, round_to

MAX_DIM = 16384  # a whole row sits in one program's registers


@triton.jit
def _inv_rms(x, D, eps):
    """1 / rms of a row held in fp32 (masked lanes 0): the one reduction both norm kernels use."""
    return tl.math.rsqrt(tl.sum(x * x, axis=0) * (1.0 / D) + eps)  # * 1/D, as torch's mean


@triton.jit
def _scaled(x, inv_rms, weight, x_dtype: tl.constexpr, y_dtype: tl.constexpr):
    """weight * x_normed with the twin's casts: x_normed to x's dtype first, then the product."""
    return round_to(weight * round_to(x * inv_rms, x_dtype), y_dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _scaled(x, _inv_rms(x, D, eps), weight, x_ptr.dtype.element_ty, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    """Warps per row of the norm kernels: 1 for head-sized rows, 4 up to 2048 elements, 8 above. The
    sum of squares' order follows from it, so _norm_rope_kernel must take the same as
    _rms_norm_kernel."""
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x, weight, eps):
    """The fused RMSNorm (forward only): x (..., D) -> (..., D), in the dtype of weight * x."""
    if x.dtype not in ROUNDED_DTYPES or weight.dtype not in ROUNDED_DTYPES:
        raise ValueError(
            f"rms_norm: x and weight must be bfloat16 or float32, got {x.dtype} and {weight.dtype}"
        )
    x2 = x.contiguous().view(-1, x.shape[-1])  # (rows, D)
    y = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), y, x2.shape[1], eps, BLOCK=block, num_warps=_norm_warps(block)
        )
    return y.view(x.shape)


class RMSNormFunction(torch.autograd.Function):
    """Forward through the fused kernel; backward through `reference`'s own graph, recomputed (the
    caller passes moe.rms_norm_reference: the gradient of the same function, whose forward values
    differ from the kernel's by fp32 rounding only). apply(x, weight, eps, reference)."""

    @staticmethod
    def forward(ctx, x, weight, eps, reference):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.reference = eps, reference
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, weight_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = ctx.reference(x_, weight_, ctx.eps)
        grad_x, grad_weight = torch.autograd.grad(y, (x_, weight_), grad)
        return grad_x, grad_weight, None, None


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    T,
    H,
    HD,
    stride_cos_b,
    stride_cos_t,
    eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # x (B*T, H, hd) row-major: row pid
    token, head = pid // H, pid % H
    b, t = token // T, token % T
    cols = tl.arange(0, BLOCK)
    mask = cols < HD
    half = HD // 2
    rotated = tl.where(cols < half, cols + half, cols - half)  # rotate_half([a, b]) = [-b, a]
    x = tl.load(x_ptr + pid * HD + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = _inv_rms(x, HD, eps)
    x_rot = tl.load(x_ptr + pid * HD + rotated, mask=mask, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight_rot = tl.load(w_ptr + rotated, mask=mask, other=0.0).to(tl.float32)
    normed = _scaled(x, inv_rms, weight, dtype, dtype)
    normed_rot = _scaled(x_rot, inv_rms, weight_rot, dtype, dtype)
    normed_rot = tl.where(cols < half, -normed_rot, normed_rot)
    angle = b * stride_cos_b + t * stride_cos_t + cols
    cos = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    y = round_to(round_to(normed * cos, dtype) + round_to(normed_rot * sin, dtype), dtype)
    # y (B, H, T, hd)
    tl.store(y_ptr + ((b * H + head) * T + t) * HD + cols, y.to(dtype), mask=mask)


def norm_rope(x, weight, eps, cos, sin):
    """The fused per-head RMSNorm + RoPE (forward only): x (B, T, h, hd), weight (hd,) and cos, sin
    (B, 1, T, hd), all BF16 -> (B, h, T, hd) contiguous."""
    if not x.dtype == weight.dtype == cos.dtype == sin.dtype == torch.bfloat16:
        raise ValueError(
            f"norm_rope: x, weight, cos and sin must all be bfloat16, got {x.dtype}, "
            f"{weight.dtype}, {cos.dtype} and {sin.dtype}"
        )
    B, T, heads, hd = x.shape
    x = x.contiguous()
    cos, sin = cos.expand(B, 1, T, hd), sin.expand(B, 1, T, hd)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(B, heads, T, hd, dtype=x.dtype, device=x.device)
    if y.numel():
        block = triton.next_power_of_2(hd)
        _norm_rope_kernel[(B * T * heads,)](
            x,
            weight.contiguous(),
            cos,
            sin,
            y,
            T,
            heads,
            hd,
            cos.stride(0),
            cos.stride(2),
            eps,
            BLOCK=block,
            num_warps=_norm_warps(block),
        )
    return y
