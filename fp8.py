"""FP8 W8A8: the accelerated baseline the NVFP4 rollout is measured against, in one short file.

FP8 E4M3 has 4 exponent bits and 3 mantissa bits: 448 is its largest value and it keeps about two
significant decimal digits everywhere in its range, so a single scale per row is enough (NVFP4, with
its 8-value grid, needs one per 16 elements). Row-wise scaling:

    scale = amax(|row|) / 448          (1.0 for an all-zero row)      fp32, one per row
    codes = e4m3(row / scale)          round to nearest even, |codes| <= 448
    row  ~= codes * scale

A linear layer y = x @ W.T quantizes its weight per output channel (a row of W (N, K), once per
weight sync) and its activation per token (a row of x (M, K), every call), so both scales factor out
of the dot product: y[m, n] = x_scale[m] * w_scale[n] * sum_k x_codes[m, k] * w_codes[n, k]: the
GEMM runs on the codes (FP8 tensor cores, sm_89+) and scales its fp32 tile once. The references
define the numbers: dequantize, multiply in fp32, round to BF16 (the experts' also apply SwiGLU and
the router weights in fp32 first, as their GEMMs' epilogues do). FP8Linear and FP8Experts replace
moe.py's layers in the rollout model through rac.py's conversion (mode "fp8"), like its NVFP4 ones.

Where it runs (`use_kernels`, the one place a path is chosen): the Triton kernels of
gpu_kernels/w8a8_quantize.py, w8a8_dense.py and w8a8_experts.py on CUDA GPUs with FP8 tensor cores
when Triton imports (one quantizer launch, or none: at decode sizes the dense GEMM quantizes x
itself; the experts as two grouped GEMMs, no host sync), the references elsewhere. The kernels
equal the references up to fp32 accumulation order (the quantizer bit for bit).

Shape letters: M rows (tokens, or assignments R), K reduction dim, N output features, E experts,
D model dim, I expert hidden dim. Left out: per-tensor or block-wise scales, E5M2, q/k/v stacking.
"""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe

try:  # triton ships with CUDA builds of torch on Linux; without it the references run
    from gpu_kernels import w8a8_dense, w8a8_experts, w8a8_quantize
except ImportError:
    w8a8_dense = None
    w8a8_experts = None
    w8a8_quantize = None

E4M3_MAX = 448.0
KERNEL_CAPABILITY = (8, 9)  # FP8 tensor cores: sm_89 (Ada) and later


def quantize_rowwise(x):
    """x (..., K) -> (codes (..., K) float8_e4m3fn, scale (..., 1) fp32) with x ~ codes * scale."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    # a tensor divisor: CUDA turns division by a Python scalar into a reciprocal multiply (not the
    # CPU's bits)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_weight(w):
    """The FP8 weight rule, per output channel: w (..., N, K) -> (codes (..., N, K), scale (..., N)
    fp32)."""
    codes, scale = quantize_rowwise(w)
    return codes, scale.squeeze(-1)


def linear_reference(x_codes, x_scale, w_codes, w_scale):
    """Twin of the FP8 GEMM: dequantize both operands, matmul in fp32, round to BF16."""
    x = x_codes.float() * x_scale
    w = w_codes.float() * w_scale.float()[:, None]
    return (x @ w.T).to(torch.bfloat16)


def grouped_linear_reference(
    x_codes,
    x_scale,
    counts,
    w_codes,
    w_scale,
    swiglu=False,
    row_weights=None,
    out_dtype=torch.bfloat16,
):
    """Twin of the experts' GEMM: rows grouped by expert (counts (E,)) times their weight (E, N, K)
    in fp32 (a loop, one host sync); swiglu: silu(gate) * up; each row times row_weights (R,);
    rounded once to out_dtype."""
    x = x_codes.float() * x_scale  # (R, K)
    w = w_codes.float() * w_scale.float()[..., None]  # (E, N, K)
    y = torch.cat([x_e @ w_e.T for x_e, w_e in zip(x.split(counts.tolist()), w)])  # (R, N)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up  # (R, N/2)
    if row_weights is not None:
        y = y * row_weights.float()[:, None]
    return y.to(out_dtype)


def use_kernels(x):
    """Do the FP8 layers run the gpu_kernels/w8a8_*.py kernels on x? Yes on CUDA GPUs with FP8
    tensor cores (sm_89+) when Triton imports; the references elsewhere (the kernel tests run the
    kernels on the CPU themselves)."""
    return w8a8_dense is not None and x.is_cuda and _capability(x.device) >= KERNEL_CAPABILITY


_capability = functools.lru_cache(maxsize=None)(torch.cuda.get_device_capability)


def linear(x, w_codes, w_scale):
    """x (M, K) @ (w_codes * w_scale[:, None]).T, x quantized per token -> (M, N) BF16."""
    if use_kernels(x):
        return w8a8_dense.linear(x, w_codes, w_scale)
    return linear_reference(*quantize_rowwise(x), w_codes, w_scale)


def grouped_linear(
    x, counts, w_codes, w_scale, row_ids=None, swiglu=False, row_weights=None, row_weight_ids=None
):
    """x (T, K), quantized per row; rows x[row_ids] (or x's own) grouped by expert, counts (E,) rows
    each, times weight (E, N, K) -> (R, N or N/2) BF16. swiglu and row_weights (read at
    row_weight_ids if given) as in grouped_linear_reference."""
    if use_kernels(x):
        return w8a8_experts.grouped_linear(
            *w8a8_quantize.quantize_rows(x),
            w_codes,
            w_scale,
            counts,
            row_ids,
            row_weights,
            row_weight_ids,
            swiglu,
        )
    x_codes, x_scale = quantize_rowwise(x)
    if row_ids is not None:  # quantizing rows, then gathering them, is gathering, then quantizing
        x_codes, x_scale = x_codes[row_ids], x_scale[row_ids]
    if row_weight_ids is not None:
        row_weights = row_weights[row_weight_ids]
    return grouped_linear_reference(x_codes, x_scale, counts, w_codes, w_scale, swiglu, row_weights)


def check_layer_input(x, in_features, device, name):
    """A rollout layer's input: a float tensor with the layer's in_features, on the weights' device
    (one line naming the layer otherwise); rac.py's NVFP4 layers check theirs with it too."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"{name}: expected a bfloat16/float16/float32 tensor, got {type(x).__name__}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected a bfloat16/float16/float32 tensor, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"{name}: expected last dim {in_features}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: input on {x.device} but weights on {device}")


class FP8Linear(nn.Module):
    """W8A8 replacement for nn.Linear: per-output-channel FP8 weights, per-token FP8 activations."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight_fp8",
            torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer(
            "weight_scale", torch.ones(out_features, dtype=torch.float32, device=device)
        )
        self.bias = None
        if bias:
            zeros = torch.zeros(out_features, device=device)
            self.bias = nn.Parameter(zeros, requires_grad=False)

    @classmethod
    def from_float(cls, linear_layer):
        layer = cls(
            linear_layer.in_features,
            linear_layer.out_features,
            bias=linear_layer.bias is not None,
            device=linear_layer.weight.device,
        )
        layer.load_weight(linear_layer.weight, linear_layer.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"FP8Linear: weight shape {tuple(weight.shape)} != "
                f"{(self.out_features, self.in_features)}"
            )
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
    """W8A8 moe.Experts: two grouped FP8 GEMMs, SwiGLU in the first, the router weights in the
    second."""

    def __init__(self, n_experts, dim, expert_dim, device=None):
        super().__init__()
        self.n_experts = n_experts
        self.dim = dim
        self.expert_dim = expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):
            self.register_buffer(
                f"{name}_fp8", torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=device)
            )
            self.register_buffer(
                f"{name}_scale", torch.ones(E, N, dtype=torch.float32, device=device)
            )

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
                raise ValueError(
                    f"FP8Experts: {name} weight shape {tuple(w.shape)} != {tuple(target.shape)}"
                )
            codes, scale = quantize_weight(w)
            target.copy_(codes)
            getattr(self, f"{name}_scale").copy_(scale)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A), expert_weights (T, A) -> (T, D) in x.dtype, as
        moe.Experts."""
        check_layer_input(x, self.dim, self.gate_up_fp8.device, "FP8Experts")
        routing = moe.route_tokens(expert_ids, self.n_experts)
        y_sorted = self.sorted_rows(x, routing, expert_weights.reshape(-1))
        return moe.sum_expert_rows(y_sorted, routing, expert_ids.shape[1]).to(x.dtype)

    def sorted_rows(self, x, routing, expert_weights):
        """x (T, D), routing, expert_weights (T * A,) -> (R, D) BF16: each sorted row times its
        router weight."""
        # (R, I): gate_up's rows gathered from x, SwiGLU applied
        hidden = grouped_linear(
            x,
            routing.counts,
            self.gate_up_fp8,
            self.gate_up_scale,
            row_ids=routing.token_ids,
            swiglu=True,
        )
        # (R, D): each row times its router weight, read in the assignments' order
        return grouped_linear(
            hidden,
            routing.counts,
            self.down_fp8,
            self.down_scale,
            row_weights=expert_weights,
            row_weight_ids=routing.order,
        )
