"""FP8 W8A8: the accelerated baseline the NVFP4 rollout is measured against, in one short file.

FP8 E4M3 has 4 exponent bits and 3 mantissa bits: 448 is its largest value and it keeps about two
significant decimal digits everywhere in its range, so a single scale per row is enough (NVFP4, with
its 8-value grid, needs one per 16 elements). Row-wise scaling:

    scale = amax(|row|) / 448          (1.0 for an all-zero row)      fp32, one per row
    codes = e4m3(row / scale)          round to nearest even, |codes| <= 448
    row  ~= codes * scale

A linear layer y = x @ W.T quantizes its weight per output channel (a row of W (N, K), once per weight
sync) and its activation per token (a row of x (M, K), every call), so both scales factor out of the
dot product: y[m, n] = x_scale[m] * w_scale[n] * sum_k x_codes[m, k] * w_codes[n, k]. That is what
torch._scaled_mm computes on GPUs with FP8 tensor cores (sm_89+: fp8 row-major x fp8 column-major,
fp32 scales (M, 1) and (1, N)), and torch._scaled_grouped_mm for the experts (rows grouped by expert).
Elsewhere the twin dequantizes both operands and multiplies in fp32; it rounds to BF16 like the GPU op.

Shape letters: M rows (tokens, or token-expert assignments R), K reduction dim, N output features,
E experts, D model dim, I expert hidden dim. Left out: per-tensor or block-wise FP8 scales, E5M2, a
Triton kernel of our own (the torch ops are the baseline as the field runs it).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe

E4M3_MAX = 448.0


def quantize_rowwise(x):
    """x (..., K) -> (codes (..., K) float8_e4m3fn, scale (..., 1) fp32) with x ~ codes * scale."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_weight(w):
    """The FP8 weight rule, per output channel: w (..., N, K) -> (codes (..., N, K), scale (..., N) fp32)."""
    codes, scale = quantize_rowwise(w)
    return codes, scale.squeeze(-1)


def linear_reference(x_codes, x_scale, w_codes, w_scale):
    """Twin of the FP8 GEMM: dequantize both operands, matmul in fp32, round to BF16."""
    x = x_codes.float() * x_scale
    w = w_codes.float() * w_scale.float()[:, None]
    return (x @ w.T).to(torch.bfloat16)


def _has_scaled_mm(x, *dims):
    # torch._scaled_mm with row-wise scales needs CUDA sm_89+ and K, N multiples of 16
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and all(d % 16 == 0 for d in dims))


def linear(x, w_codes, w_scale):
    """x (M, K) @ (w_codes * w_scale[:, None]).T, x quantized per token -> (M, N) BF16."""
    x_codes, x_scale = quantize_rowwise(x)
    if _has_scaled_mm(x, *w_codes.shape):
        return torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                                out_dtype=torch.bfloat16)
    return linear_reference(x_codes, x_scale, w_codes, w_scale)


def grouped_linear(x_sorted, routing, w_codes, w_scale):
    """x_sorted (R, K), rows grouped by expert (moe.Routing) @ weight (E, N, K) per expert -> (R, N) BF16."""
    x_codes, x_scale = quantize_rowwise(x_sorted)
    E, N, K = w_codes.shape
    if _has_scaled_mm(x_sorted, N, K) and x_sorted.shape[0] > 0:
        return torch._scaled_grouped_mm(x_codes, w_codes.transpose(-2, -1), x_scale.view(-1), w_scale,
                                        offs=routing.offsets, out_dtype=torch.bfloat16)
    outputs, start = [], 0
    for e, n in enumerate(routing.counts.tolist()):  # the twin: one host sync, a loop over experts
        outputs.append(linear_reference(x_codes[start:start + n], x_scale[start:start + n], w_codes[e],
                                        w_scale[e]))
        start += n
    return torch.cat(outputs) if outputs else x_sorted.new_zeros((0, N), dtype=torch.bfloat16)


def check_layer_input(x, in_features, device, name):
    """A rollout layer's input: a float tensor with the layer's in_features, on the weights' device (one
    line naming the layer otherwise); rac.py's NVFP4 layers check theirs with it too."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected a bfloat16/float16/float32 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-1] != in_features:
        raise ValueError(f"{name}: expected last dim {in_features}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: input on {x.device} but weights on {device}")


class FP8Linear(nn.Module):
    """W8A8 replacement for nn.Linear: per-output-channel FP8 weights, per-token FP8 activations."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8",
                             torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_float(cls, linear_layer):
        layer = cls(linear_layer.in_features, linear_layer.out_features, bias=linear_layer.bias is not None,
                    device=linear_layer.weight.device)
        layer.load_weight(linear_layer.weight, linear_layer.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"FP8Linear: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        codes, scale = quantize_weight(weight)
        self.weight_fp8.copy_(codes)
        self.weight_scale.copy_(scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        check_layer_input(x, self.in_features, self.weight_fp8.device, "FP8Linear")
        y = linear(x.reshape(-1, self.in_features), self.weight_fp8, self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class FP8Experts(nn.Module):
    """W8A8 replacement for moe.Experts: two grouped FP8 GEMMs around SwiGLU, routing as moe.Experts."""

    def __init__(self, n_experts, dim, expert_dim, device=None):
        super().__init__()
        self.n_experts, self.dim, self.expert_dim = n_experts, dim, expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):
            self.register_buffer(f"{name}_fp8",
                                 torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_scale", torch.ones(E, N, dtype=torch.float32, device=device))

    @classmethod
    def from_float(cls, experts):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, device=experts.gate_up_proj.device)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            target = getattr(self, f"{name}_fp8")
            if tuple(w.shape) != tuple(target.shape):
                raise ValueError(f"FP8Experts: {name} weight shape {tuple(w.shape)} != {tuple(target.shape)}")
            codes, scale = quantize_weight(w)
            target.copy_(codes)
            getattr(self, f"{name}_scale").copy_(scale)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A), expert_weights (T, A) -> (T, D) in x.dtype, as moe.Experts."""
        check_layer_input(x, self.dim, self.gate_up_fp8.device, "FP8Experts")
        routing = moe.route_tokens(expert_ids, self.n_experts)
        x_sorted = x[routing.token_ids]                                                      # (R, D)
        gate, up = (grouped_linear(x_sorted, routing, self.gate_up_fp8, self.gate_up_scale)    # (R, 2I)
                    .to(x.dtype).chunk(2, -1))
        y_sorted = (grouped_linear(F.silu(gate) * up, routing, self.down_fp8, self.down_scale)  # (R, D)
                    .to(x.dtype))
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)
