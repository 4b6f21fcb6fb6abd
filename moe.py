"""A small Qwen3-MoE-style transformer that also loads real Hugging Face Qwen3-MoE checkpoints.

One decoder layer, pre-norm with residuals:

    x = x + Attention(RMSNorm(x))         GQA, q/k RMSNorm per head, RoPE, causal
    x = x + MoEBlock(RMSNorm(x))          top-k router over E SwiGLU experts

Formulas (the numerics follow Hugging Face's Qwen3MoeForCausalLM, so logits match in fp32):

    RMSNorm(x)   = w * (x / sqrt(mean(x^2) + eps))     in fp32, cast back before * w
    RoPE         = x * cos + rotate_half(x) * sin      rotate_half([a, b]) = [-b, a]
                   (halves, not pairs); angle[pos, j] = pos * theta^(-2j / hd), the hd/2
                   angles repeated twice
    Attention    q = RoPE(RMSNorm_q(W_q x)), k = RoPE(RMSNorm_k(W_k x)), v = W_v x
                   (the norms run over hd, before RoPE)
                 y = W_o softmax(q k^T / sqrt(hd) + mask) v
                   (each of the Hkv key/value heads serves H/Hkv query heads)
    Router       p = softmax(W_gate x) in fp32, (w, ids) = top-A of p,
                   w <- w / sum(w) if norm_topk_prob
    Expert e     f_e(x) = W_down_e (silu(W_gate_e x) * (W_up_e x))
    MoE          y = sum_a w_a f_{ids_a}(x)

Experts run sparsely: the T*A (token, expert) assignments are sorted by expert once
(`route_tokens`), each expert multiplies its contiguous slice of rows, and the rows go back to token
order, summed with their router weights. The GEMMs are one `torch._grouped_mm` on CUDA in BF16, else
a loop over the active experts (the slow twin). Fast paths (gpu_kernels/), each chosen in one
`use_*_kernel` function: RMSNorm, q/k norm with RoPE, a decode step's routing sort, the sum of each
token's expert rows, the router's softmax + top-k (each equal to its twin bit for bit or to fp32
rounding).

Routes can be forced (R3, "rollout routing replay"): the trainer replays the experts the rollout
chose, while the mixing weights still come from its own router, so the router keeps receiving
gradients. The KV cache belongs to the sampler (rollout.py, read after grpo.py); each Attention
layer only calls `k, v = kv_cache.update(layer_idx, k, v)`. What a swapped-in layer needs for one
call beside its input (a symmetric trainer's share of the rollout, a rollout's recorder, met after
train.py) is an argument too: `hand_offs`, {module path: object}, threaded down like forced routes,
so that the layer at a named path is called `layer(x, hand_off)`; nothing is set on a layer.

For real checkpoints: `targets=` makes the forward return the targets' log-probs instead of the
logits, a chunk of positions at a time (each recomputed in the backward), so no whole fp32 logits
tensor exists; `grad_checkpoint=True` keeps only each block's input and recomputes the block in the
backward (torch.utils.checkpoint), with the plain forward's gradients.

Left out on purpose: quantization (the quantized layers of rac.py and qat.py, read after train.py,
replace these layers in place), dropout, attention bias, sliding windows, RoPE scaling, dense-MLP
layers (`mlp_only_layers`), the load-balancing loss.

Shape letters: B batch, T tokens (queries), S keys (cached + new), D model dim, H query heads, Hkv
key/value heads, hd head dim, E experts, A active experts per token, I expert hidden dim, V vocab,
L layers, N = T*A assignments.
"""

import glob
import json
import os
import re
import warnings
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# triton ships with CUDA builds of torch on Linux; without it the plain twins run
try:
    from gpu_kernels import norm as norm_kernels, routing as routing_kernels
except ImportError:
    norm_kernels = routing_kernels = None


def check(ok: bool, message: str):
    """Bad input fails early with one line that names the field and the problem."""
    if not ok:
        raise ValueError(message)


def needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------- config
@dataclass
class MoEConfig:
    vocab_size: int = 64  # V; the tiny preset's char tokenizer sets it (override per task)
    dim: int = 64  # D, width of the residual stream
    n_layers: int = 2  # L decoder layers, every one of them MoE
    n_heads: int = 4  # H query heads
    n_kv_heads: int = 2  # Hkv key/value heads; H/Hkv query heads share each (GQA); = H is plain MHA
    head_dim: int = 16  # hd; Qwen3 sets it independently of dim / n_heads
    n_experts: int = 8  # E routed experts per layer
    n_active: int = 2  # A experts each token is sent to (the router's top-k)
    expert_dim: int = 64  # I, hidden width of one SwiGLU expert
    rope_theta: float = 10000.0  # RoPE base; larger values stretch the longest wavelength
    rms_eps: float = 1e-6  # epsilon inside every RMSNorm
    norm_topk_prob: bool = True  # renormalize the A chosen router probabilities to sum to 1
    tie_embeddings: bool = False  # LM head reuses the embedding matrix
    max_seq_len: int = 256  # longest prompt + completion a forward may see (also sizes KV caches)

    def __post_init__(self):
        for name in [field.name for field in fields(self) if field.type is int]:
            value = getattr(self, name)
            check(
                isinstance(value, int) and value > 0,
                f"MoEConfig.{name} must be a positive int, got {value!r}",
            )
        check(
            self.n_heads % self.n_kv_heads == 0,
            f"MoEConfig: n_heads={self.n_heads} is not divisible by "
            f"n_kv_heads={self.n_kv_heads}; each key/value head must serve the same number "
            f"of query heads",
        )
        check(
            self.n_active <= self.n_experts,
            f"MoEConfig: n_active={self.n_active} experts per token "
            f"exceeds n_experts={self.n_experts}",
        )
        check(
            self.head_dim % 2 == 0,
            f"MoEConfig: head_dim={self.head_dim} must be even, RoPE rotates pairs of halves",
        )
        check(
            self.rope_theta > 0 and self.rms_eps > 0,
            f"MoEConfig: rope_theta={self.rope_theta} and rms_eps={self.rms_eps} must be positive",
        )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MoEConfig":
        """A named preset with some fields replaced, e.g.
        from_preset("tiny", vocab_size=len(tokenizer))."""
        check(name in PRESETS, f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS = {
    # CPU: RL on the synthetic task finishes in minutes on two cores. ~0.2M parameters with V=64.
    "tiny": MoEConfig(),
    # The default GPU experiment: ~107M parameters, ~19M active per token (+ embeddings). Every
    # width is a multiple of 64, so NVFP4's 16-element blocks and GEMM tiles divide it evenly.
    "small": MoEConfig(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        n_experts=32,
        n_active=4,
        expert_dim=256,
        max_seq_len=1024,
    ),
    # The real shapes of Qwen/Qwen3-30B-A3B (30.5B parameters, 3.3B active): benchmarks, load_hf.
    "qwen3-30b-a3b": MoEConfig(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        n_experts=128,
        n_active=8,
        expert_dim=768,
        rope_theta=1e6,
        norm_topk_prob=True,
        max_seq_len=40960,
    ),
}


# --------------------------------------------------------------------------------------- fast paths
# Where each fused kernel (gpu_kernels/norm.py, gpu_kernels/routing.py) runs: on the CUDA tensors it
# applies to, the plain twin everywhere else. A benchmark may set one to `lambda *args: False` to
# time its twin.
def use_norm_kernel(x: Tensor, weight: Tensor) -> bool:
    return (
        norm_kernels is not None
        and x.is_cuda
        and x.shape[-1] <= norm_kernels.MAX_DIM
        and x.dtype in norm_kernels.ROUNDED_DTYPES
        and weight.dtype in norm_kernels.ROUNDED_DTYPES
    )


def use_norm_rope_kernel(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor) -> bool:
    return (
        norm_kernels is not None
        and x.is_cuda
        and x.shape[-1] <= norm_kernels.MAX_DIM
        and not needs_grad(x, weight)  # training takes the composed twin
        and x.dtype == weight.dtype == cos.dtype == sin.dtype == torch.bfloat16
    )


def use_routing_kernel(expert_ids: Tensor, n_experts: int) -> bool:
    # sized for a decode step's assignments, not a prefill's
    return (
        routing_kernels is not None
        and expert_ids.is_cuda
        and n_experts <= routing_kernels.MAX_EXPERTS
        and expert_ids.numel() <= routing_kernels.MAX_ASSIGNMENTS
    )


def use_sum_rows_kernel(y_sorted: Tensor) -> bool:
    return (
        routing_kernels is not None
        and y_sorted.is_cuda
        and y_sorted.dtype in routing_kernels.ROUNDED_DTYPES
    )


def use_router_kernel(logits: Tensor) -> bool:
    return (
        routing_kernels is not None
        and logits.is_cuda
        and logits.shape[-1] <= routing_kernels.MAX_LOGITS
    )


# ------------------------------------------------------------------------------------------- layers
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Hugging Face computes it: statistics in fp32 even for BF16 activations, the cast
    back to x's dtype before the scale (so the two round identically), the product in the promoted
    dtype."""
    x_float = x.float()
    x_normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x_normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if not use_norm_kernel(x, self.weight):
            return rms_norm_reference(x, self.weight, self.eps)
        if needs_grad(x, self.weight):
            return norm_kernels.RMSNormFunction.apply(x, self.weight, self.eps, rms_norm_reference)
        return norm_kernels.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles: positions (B, T) -> two (B, 1, T, hd) tensors, one each."""
    # Recomputed each forward (hd/2 numbers) rather than stored as a buffer: a buffer would be
    # rounded to BF16 by model.to(torch.bfloat16), and BF16 frequencies are wrong after a few
    # hundred positions.
    even_dims = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (even_dims / head_dim)  # (hd/2,)
    angles = positions[..., None].float() * inv_freq  # (B, T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, hd) halves layout
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, T, hd): dimension j pairs with j + hd/2 (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def norm_rope(x: Tensor, norm: "RMSNorm", cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE(norm(x)) for queries or keys x (B, T, h, hd) -> (B, h, T, hd)."""
    if not use_norm_rope_kernel(x, norm.weight, cos, sin):
        return apply_rope(norm(x).transpose(1, 2), cos, sin)
    return norm_kernels.norm_rope(x, norm.weight, norm.eps, cos, sin)


def call_layer(layer: nn.Module, hand_offs: dict | None, name: str, *inputs):
    """layer(*inputs), or layer(*inputs, hand_offs[name]) when the caller hands this layer something
    for this call: a replaced layer's per-call argument, passed down visibly rather than set on the
    layer from outside."""
    if hand_offs is None or name not in hand_offs:
        return layer(*inputs)
    return layer(*inputs, hand_offs[name])


def hand_offs_below(hand_offs: dict | None, prefix: str) -> dict | None:
    """The entries of `hand_offs` under module path `prefix` ("layers.3."), keyed by the rest of
    their path; None when there are none (the common case: no layer takes anything)."""
    if not hand_offs:
        return None
    below = {}
    for path, value in hand_offs.items():
        if path.startswith(prefix):
            below[path[len(prefix) :]] = value
    return below or None


class Attention(nn.Module):
    """Causal GQA self-attention with Qwen3's per-head RMSNorm on q and k (before RoPE). The
    projections are called as `self.q_proj(x)` (through call_layer), so quantized modules with that
    call can replace them; a layer the caller hands something for this call is called
    `self.q_proj(x, hand_off)`. q, k and v read one input in project_qkv, which a quantized twin may
    override as a whole."""

    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        # the key rollout.py's KV cache files this layer's keys and values under
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_eps)

    def project_qkv(self, x: Tensor, hand_offs: dict | None = None):
        """q, k and v of x (B, T, D): three projections of one input. A quantized twin (rac.py's
        NVFP4Attention) overrides this to quantize x once and run one stacked GEMM."""
        q = call_layer(self.q_proj, hand_offs, "q_proj", x)  # (B, T, H*hd)
        k = call_layer(self.k_proj, hand_offs, "k_proj", x)  # (B, T, Hkv*hd)
        v = call_layer(self.v_proj, hand_offs, "v_proj", x)  # (B, T, Hkv*hd)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor | None = None,
        kv_cache=None,
        hand_offs: dict | None = None,
    ):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.project_qkv(x, hand_offs)
        q = norm_rope(q.view(B, T, H, hd), self.q_norm, cos, sin)  # (B, H, T, hd)
        k = norm_rope(k.view(B, T, Hkv, hd), self.k_norm, cos, sin)  # (B, Hkv, T, hd)
        v = v.view(B, T, Hkv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd)
        group = H // Hkv  # query heads per key/value head
        if attn_mask is None:
            # Training: expand the shared key/value heads so that SDPA's fused causal kernels
            # apply (a small copy).
            k = k.repeat_interleave(group, dim=1)  # (B, H, S, hd)
            v = v.repeat_interleave(group, dim=1)  # (B, H, S, hd)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:
            # With a mask (the sampler's cache): fold each key/value head's `group` query heads into
            # the query axis, so the cache is read in place (reshape: some SDPA results are
            # non-contiguous).
            S = k.shape[2]
            q = q.reshape(B, Hkv, group * T, hd)  # (B, Hkv, group*T, hd)
            mask = attn_mask.expand(B, 1, T, S).repeat(1, 1, group, 1)  # (B, 1, group*T, S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H*hd)
        return call_layer(self.o_proj, hand_offs, "o_proj", y)  # (B, T, D)


# ------------------------------------------------------------------------------------------ experts
class Routing(NamedTuple):
    """The T*A (token, expert) assignments grouped by expert. Assignment n = t*A + a is token t's
    a-th choice."""

    # (N,) int64: assignments sorted by expert (stable: token order within an expert)
    order: Tensor
    # (N,) int64: the token of each sorted row, for gathering the inputs
    token_ids: Tensor
    # (N,) int64: where assignment n sits in the sorted rows, for putting outputs back
    inverse_order: Tensor
    # (E,) int64: rows per expert
    counts: Tensor
    # (E,) int32: end of each expert's slice (cumulative counts); _grouped_mm's `offs`
    offsets: Tensor


def route_tokens(expert_ids: Tensor, n_experts: int) -> Routing:
    """Sort the assignments expert_ids (T, A) by expert, once per layer (the quantized experts
    share it)."""
    if use_routing_kernel(expert_ids, n_experts):
        return Routing(*routing_kernels.route_tokens(expert_ids, n_experts))
    return route_tokens_reference(expert_ids, n_experts)


def route_tokens_reference(expert_ids: Tensor, n_experts: int) -> Routing:
    """route_tokens in torch ops: a stable sort on the narrowest key, searchsorted for counts."""
    flat_ids = expert_ids.reshape(-1)  # (N,)
    # The narrowest key that holds an expert id: a radix sort costs a pass per key byte (int64 keys
    # took 27 us a layer at 512 assignments on an H200, most of the routing). The order is the same.
    key_dtype = torch.uint8 if n_experts <= 256 else torch.int32
    sorted_ids, order = torch.sort(flat_ids.to(key_dtype), stable=True)
    positions = torch.arange(order.numel(), device=order.device)
    inverse_order = torch.empty_like(order).scatter_(0, order, positions)
    # searchsorted on the sorted ids keeps every size static: no host sync, nothing torch.compile
    # must guess.
    experts = torch.arange(n_experts, device=flat_ids.device, dtype=key_dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True)  # (E,)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    token_ids = order // expert_ids.shape[-1]
    return Routing(order, token_ids, inverse_order, counts, ends.to(torch.int32))


def combine_expert_outputs(y_sorted: Tensor, routing: Routing, expert_weights: Tensor) -> Tensor:
    """y_sorted (N, D) rows in expert order -> (T, D): y[t] = sum_a expert_weights[t, a] * row
    of (t, a)."""
    T, A = expert_weights.shape
    y = y_sorted[routing.inverse_order].view(T, A, -1)  # (T, A, D)
    # A gather and a batched (1, A) @ (A, D) product instead of index_add_: deterministic on the
    # GPU (no atomics) and one rounding per token. The weights are cast to the activation dtype
    # first, as in HF.
    return torch.bmm(expert_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)  # (T, D)


def sum_expert_rows(y_sorted: Tensor, routing: Routing, n_active: int) -> Tensor:
    """y_sorted (N, D) rows in expert order, already weighted -> (T, D): each token's A rows
    added in fp32 in the order a = 0..A-1, rounded once to y_sorted's dtype. (The quantized
    expert layers apply the router weights in their GEMMs; combine_expert_outputs is the form
    that applies them.)"""
    n = routing.inverse_order.numel()
    check(
        y_sorted.dim() == 2 and y_sorted.shape[0] == n and n_active >= 1 and n % n_active == 0,
        f"sum_expert_rows: y_sorted {tuple(y_sorted.shape)} must be (N, D) with N = {n}, "
        f"the routing's assignments, a multiple of n_active={n_active}",
    )
    if use_sum_rows_kernel(y_sorted):
        return routing_kernels.sum_expert_rows(y_sorted, routing.inverse_order, n_active)
    return sum_expert_rows_reference(y_sorted, routing, n_active)


def sum_expert_rows_reference(y_sorted: Tensor, routing: Routing, n_active: int) -> Tensor:
    y = y_sorted[routing.inverse_order].view(-1, n_active, y_sorted.shape[-1]).float()  # (T, A, D)
    # a = 0, 1, ... in turn, not y.sum(1)'s order
    return sum(y.unbind(1)[1:], y[:, 0]).to(y_sorted.dtype)


def expert_swiglu_loop(
    x_sorted: Tensor, counts: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    """Slow twin: x_sorted (N, D) grouped by expert -> (N, D), one pair of matmuls per active
    expert."""
    outputs = []
    start = 0
    # Unbind once: indexing w[e] per expert would make autograd write a full-size zero gradient
    # per expert.
    gate_up_weights = gate_up_proj.unbind(0)
    down_weights = down_proj.unbind(0)
    for e, n in enumerate(counts.tolist()):  # one host sync per layer
        if n == 0:
            continue
        gate_up = F.linear(x_sorted[start : start + n], gate_up_weights[e])  # (n, 2I)
        gate, up = gate_up.chunk(2, dim=-1)  # (n, I) each
        outputs.append(F.linear(F.silu(gate) * up, down_weights[e]))  # (n, D)
        start += n
    return torch.cat(outputs) if outputs else x_sorted.new_zeros(x_sorted.shape)


def expert_swiglu_grouped(
    x_sorted: Tensor, offsets: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    """Fast path: the same computation as expert_swiglu_loop, as two grouped GEMMs without a
    host sync."""
    # torch._grouped_mm(a, b, offs) multiplies rows offs[e-1]:offs[e] of a by b[e]; b is
    # (E, K, N), so the stored (E, out, in) weights are passed transposed, which is also the
    # column-major layout it wants.
    gate_up = torch._grouped_mm(x_sorted, gate_up_proj.transpose(-2, -1), offs=offsets)  # (N, 2I)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)  # (N, D)


def expert_operands(
    x_sorted: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> tuple[Tensor, ...]:
    """Under torch.autocast, the expert GEMMs run in the autocast dtype, as F.linear would (FP32
    master weights, BF16 compute); the casts are differentiable, so gradients still reach the
    FP32 weights."""
    device = x_sorted.device.type
    if not torch.is_autocast_enabled(device):
        return x_sorted, gate_up_proj, down_proj
    dtype = torch.get_autocast_dtype(device)
    return x_sorted.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)


def use_grouped_mm(x: Tensor, expert_dim: int) -> bool:
    """The one place the expert GEMM path is chosen: torch._grouped_mm takes BF16 on CUDA
    (SM80+) with 16-byte aligned rows (D and I divisible by 8, as in every preset); else the
    loop, said once on CUDA."""
    ok = (
        x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and x.shape[-1] % 8 == expert_dim % 8 == 0
    )
    if x.is_cuda and not ok:
        warnings.warn(
            f"moe.py: experts run as a per-expert loop on CUDA (dtype {x.dtype}, D={x.shape[-1]}, "
            f"I={expert_dim}); torch._grouped_mm needs BF16 and D, I divisible by 8"
        )
    return x.is_cuda and ok


class Experts(nn.Module):
    """E SwiGLU experts in Hugging Face's fused layout: gate_up_proj (E, 2I, D), rows [0:I] gate
    and [I:2I] up; down_proj (E, D, I). forward is route, gather, expert GEMMs, combine; a
    quantized replacement keeps route_tokens and combine_expert_outputs and swaps only the GEMMs
    in the middle."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(config.n_experts, 2 * config.expert_dim, config.dim)
        )
        self.down_proj = nn.Parameter(torch.empty(config.n_experts, config.dim, config.expert_dim))

    def forward(self, x: Tensor, expert_ids: Tensor, expert_weights: Tensor) -> Tensor:
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D) in x.dtype."""
        routing = route_tokens(expert_ids, self.n_experts)
        x_sorted = x[routing.token_ids]  # (N, D)
        x_sorted, gate_up, down = expert_operands(x_sorted, self.gate_up_proj, self.down_proj)
        if use_grouped_mm(x_sorted, down.shape[-1]):
            y_sorted = expert_swiglu_grouped(x_sorted, routing.offsets, gate_up, down)  # (N, D)
        else:
            y_sorted = expert_swiglu_loop(x_sorted, routing.counts, gate_up, down)
        return combine_expert_outputs(y_sorted, routing, expert_weights)


def router_top_k_reference(
    logits: Tensor, n_active: int, norm_topk_prob: bool, routes: Tensor | None = None
):
    """The router: logits (T, E) -> (weights (T, A) fp32, ids (T, A) int64): ids its A most probable
    experts in descending order, weights theirs or those of `routes` (T, A) (R3), renormalized if
    norm_topk_prob. The softmax runs in fp32, as in HF: in BF16 close probabilities tie and top-k
    would pick arbitrarily."""
    ids = torch.softmax(logits.float(), dim=-1).topk(n_active, dim=-1).indices  # (T, A)
    return router_weights(logits, ids if routes is None else routes, norm_topk_prob), ids


def router_weights(logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
    """The fp32 router probabilities of experts ids (T, A), renormalized if norm_topk_prob (the
    reference's weights, and the fused router's backward)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) if norm_topk_prob else weights


def router_top_k(logits: Tensor, n_active: int, norm_topk_prob: bool, routes: Tensor | None = None):
    """The router, trainer and rollout alike (the same weights from the same logits on both
    sides)."""
    if not use_router_kernel(logits):
        return router_top_k_reference(logits, n_active, norm_topk_prob, routes)
    if needs_grad(logits):
        return routing_kernels.RouterTopK.apply(
            logits, n_active, norm_topk_prob, routes, router_weights
        )
    return routing_kernels.router_top_k(logits, n_active, norm_topk_prob, routes)


class MoEBlock(nn.Module):
    """Router plus experts. forward(x, forced_routes) -> (y, routes): routes (..., A) int64 are the
    router's own top-k, also when forced_routes chose the experts that ran (what the replay
    overrode)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_active = config.n_active
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)  # the router (HF's name)
        self.experts = Experts(config)

    def forward(
        self, x: Tensor, forced_routes: Tensor | None = None, hand_offs: dict | None = None
    ) -> tuple[Tensor, Tensor]:
        lead_shape = x.shape[:-1]
        D = x.shape[-1]
        x = x.reshape(-1, D)  # (T, D)
        # (T, A): the experts to run where they are forced (R3), else None
        routes = None if forced_routes is None else forced_routes.reshape(-1, self.n_active)
        logits = call_layer(self.gate, hand_offs, "gate", x)  # (T, E)
        # (T, A) each: the mixing weights (of the forced experts, if any) and the router's own top-k
        weights, own = router_top_k(logits, self.n_active, self.norm_topk_prob, routes)
        chosen = own if routes is None else routes
        y = call_layer(self.experts, hand_offs, "experts", x, chosen, weights)
        return y.view(*lead_shape, D), own.view(*lead_shape, self.n_active)


# -------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.rms_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, config.rms_eps)
        self.mlp = MoEBlock(config)

    def forward(
        self, x, cos, sin, attn_mask=None, kv_cache=None, forced_routes=None, hand_offs=None
    ):
        attn_hand_offs = hand_offs_below(hand_offs, "attn.")
        mlp_hand_offs = hand_offs_below(hand_offs, "mlp.")
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, kv_cache, attn_hand_offs)
        moe_out, routes = self.mlp(self.mlp_norm(x), forced_routes, mlp_hand_offs)
        return x + moe_out, routes


# fp32 logits of one log-prob chunk: at most this many entries (256 MB)
LOGPROB_CHUNK_ELEMENTS = 2**26


def logprob_chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk of token_logprobs: 441 at Qwen3's vocabulary of 151,936, every position
    at once for the small presets' vocabularies."""
    return max(1, LOGPROB_CHUNK_ELEMENTS // vocab_size)


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        """Hugging Face's Qwen3-MoE init, to train from scratch: N(0, std) every matrix, ones the
        norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (a tied head counted once); active=True counts A of the E experts per
        layer."""
        total = sum(p.numel() for p in self.parameters())
        if active:
            c = self.config
            total -= c.n_layers * (c.n_experts - c.n_active) * 3 * c.dim * c.expert_dim
        return total

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
        kv_cache=None,
        forced_routes: Tensor | None = None,
        return_routes: bool = False,
        hand_offs: dict | None = None,
        targets: Tensor | None = None,
        temperature: float = 1.0,
        grad_checkpoint: bool = False,
        return_entropy: bool = False,
    ):
        """tokens (B, T) int64 -> logits (B, T, V) in the model's dtype (upcast before a
        log-softmax).

        positions (B, T): RoPE positions, default 0..T-1.
        attn_mask: bool, broadcastable to (B, 1, T, S), True = may attend. It replaces the causal
            default, so it must be causal itself; let padding attend to itself (a row allowed no key
            is undefined).
        kv_cache: any object with update(layer_idx, k, v) -> (k, v); needs attn_mask and positions.
        forced_routes (L, B, T, A) int64: replay these experts instead of each router's top-k.
        return_routes: also return each router's own top-k, (L, B, T, A) int64, replayed or not.
        hand_offs: {module path: object}, what a replaced layer takes for this call besides its
            input (a symmetric trainer's share of the rollout, a rollout's recorder, both met
            later); the layer at a path named here is called layer(x, hand_offs[path]), every other
            layer(x). Paths are named_modules'.
        targets (B, T) int64: return the log-probs of these tokens instead of the logits, (B, T)
            fp32, of logits / temperature, computed LOGPROB_CHUNK_ELEMENTS entries at a time
            (token_logprobs): the full-vocabulary fp32 logits never exist at once.
        return_entropy: with targets, return (log-probs, entropy) instead: each position's entropy
            of softmax(logits / temperature), (B, T) fp32, without gradient.
        grad_checkpoint: keep only each block's input for the backward and recompute the block
            there (activation checkpointing); the gradients are those of the plain forward.
        """
        c = self.config
        check(
            tokens.dim() == 2 and tokens.dtype in (torch.int64, torch.int32),
            f"tokens must be an integer tensor of shape (B, T), "
            f"got {tuple(tokens.shape)} {tokens.dtype}",
        )
        B, T = tokens.shape
        check(T <= c.max_seq_len, f"{T} tokens exceed max_seq_len={c.max_seq_len}")
        check(
            kv_cache is None or (attn_mask is not None and positions is not None),
            "with a kv_cache, pass attn_mask (B, 1, T, S) and positions (B, T): the model cannot "
            "know which cached keys each query may see, nor where the new tokens sit",
        )
        if attn_mask is not None:
            check(
                attn_mask.dtype == torch.bool and attn_mask.dim() == 4,
                f"attn_mask must be bool, broadcastable to (B, 1, T, S), "
                f"got {tuple(attn_mask.shape)} {attn_mask.dtype}",
            )
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        check(
            positions.shape == (B, T),
            f"positions must have the shape of tokens {(B, T)}, got {tuple(positions.shape)}",
        )
        if forced_routes is not None:
            expected = (c.n_layers, B, T, c.n_active)
            check(
                tuple(forced_routes.shape) == expected,
                f"forced_routes must be (L, B, T, A) = {expected}, "
                f"got {tuple(forced_routes.shape)}",
            )
            # one host sync: out-of-range ids would otherwise corrupt the output silently
            check(
                bool(forced_routes.min() >= 0) and bool(forced_routes.max() < c.n_experts),
                f"forced_routes must hold expert ids in [0, {c.n_experts})",
            )
            forced_routes = forced_routes.long()

        x = self.embed(tokens)  # (B, T, D)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)  # (B, 1, T, hd) each
        forced_per_layer = [None] * c.n_layers if forced_routes is None else forced_routes
        routes = []
        for i, layer in enumerate(self.layers):
            layer_hand_offs = hand_offs_below(hand_offs, f"layers.{i}.")
            forced = forced_per_layer[i]
            block_inputs = (x, cos, sin, attn_mask, kv_cache, forced, layer_hand_offs)
            if grad_checkpoint and torch.is_grad_enabled():
                x, layer_routes = checkpoint(layer, *block_inputs, use_reentrant=False)
            else:
                x, layer_routes = layer(*block_inputs)
            routes.append(layer_routes)  # (B, T, A)
        hidden = self.norm(x)  # (B, T, D)
        if targets is not None:
            # (B, T) fp32, and (B, T) fp32 entropies with return_entropy
            out = self.token_logprobs(hidden, targets, temperature, hand_offs, return_entropy)
        else:
            out = call_layer(self.lm_head, hand_offs, "lm_head", hidden)  # (B, T, V)
        if return_routes:
            return out, torch.stack(routes)
        return out

    def token_logprobs(
        self,
        hidden: Tensor,
        targets: Tensor,
        temperature: float = 1.0,
        hand_offs=None,
        return_entropy: bool = False,
    ):
        """log softmax(lm_head(hidden) / temperature)[target], (B, T) fp32, from hidden (B, T, D).

        The positions are taken logprob_chunk_tokens(V) at a time, so one chunk's fp32 logits are
        the most that exists; with a gradient each chunk is recomputed in the backward (checkpoint),
        so the chunks' logits are not kept for it either. Each token's value is its own row's
        logit minus its row's logsumexp: the same as on the whole tensor. return_entropy: also each
        position's entropy H = logsumexp(z) - sum softmax(z) z of z = logits / temperature, without
        gradient: -> (log-probs, entropies)."""
        B, T, D = hidden.shape
        check(
            targets.shape == (B, T),
            f"targets must have the shape of tokens {(B, T)}, got {tuple(targets.shape)}",
        )
        flat_hidden = hidden.reshape(B * T, D)
        flat_targets = targets.reshape(B * T)
        chunk = logprob_chunk_tokens(self.config.vocab_size)
        logprobs = []
        entropies = []
        for start in range(0, B * T, chunk):
            rows = (flat_hidden[start : start + chunk], flat_targets[start : start + chunk])
            args = (*rows, temperature, hand_offs, return_entropy)
            if B * T > chunk and torch.is_grad_enabled():
                piece = checkpoint(self._chunk_logprobs, *args, use_reentrant=False)
            else:
                piece = self._chunk_logprobs(*args)
            if return_entropy:
                piece, entropy = piece
                entropies.append(entropy)
            logprobs.append(piece)
        logprobs = torch.cat(logprobs).view(B, T)
        if return_entropy:
            return logprobs, torch.cat(entropies).view(B, T)
        return logprobs

    def _chunk_logprobs(self, hidden, targets, temperature, hand_offs, with_entropy):
        """(n, D), (n,) -> (n,) fp32 log-probs, one chunk's; with_entropy: and (n,) fp32
        entropies (a softmax over the vocabulary more, so only when asked)."""
        logits = call_layer(self.lm_head, hand_offs, "lm_head", hidden)  # (n, V)
        logits = logits.float() / max(temperature, 1e-6)
        chosen = logits.gather(-1, targets[:, None]).squeeze(-1)
        log_normalizer = logits.logsumexp(-1)
        if not with_entropy:
            return chosen - log_normalizer
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            # -inf logits have p = 0: their terms are 0, not NaN
            expected = torch.where(probs > 0, probs * logits, 0.0).sum(-1)
            entropy = log_normalizer - expected
        return chosen - log_normalizer, entropy


def same_state_as(cls: type, module: nn.Module) -> nn.Module:
    """A `cls` (a subclass of module's class) holding module's own plain attributes, Parameter
    objects, buffers and submodules, not copies: how a swapped-in layer takes over the one it
    replaces, so that an optimizer built before the swap and the state dict's keys keep working."""
    twin = cls.__new__(cls)
    nn.Module.__init__(twin)
    for name, value in vars(module).items():  # plain attributes such as n_experts, layer_idx
        if not name.startswith("_") and name != "training":
            setattr(twin, name, value)
    for name, param in module.named_parameters(recurse=False):
        setattr(twin, name, param)
    for name, buffer in module.named_buffers(recurse=False):
        twin.register_buffer(name, buffer)
    for name, child in module.named_children():
        setattr(twin, name, child)
    return twin.train(module.training)


def swappable_layers(model: nn.Module, include_router: bool = False, include_lm_head: bool = False):
    """[(parent, attribute, module)] for every layer the quantized recipes replace in place (rac.py,
    qat.py: read after train.py): each Attention's nn.Linear projections and every Experts block,
    optionally the routers (MoEBlock.gate) and the LM head. Chosen by isinstance, never by name;
    listed up front so callers can setattr while walking it."""
    layers = []
    for parent in model.modules():
        linears = (
            isinstance(parent, Attention)
            or (include_router and isinstance(parent, MoEBlock))
            or (include_lm_head and isinstance(parent, MoETransformer))
        )
        for name, child in parent.named_children():
            if isinstance(child, Experts) or (linears and isinstance(child, nn.Linear)):
                layers.append((parent, name, child))
    return layers


# ------------------------------------------------------------------------------------------ loading
# (checkpoint name pattern, this module's name); per-expert weights are handled separately
_HF_RENAMES = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    (
        r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj|[qk]_norm)\.weight",
        r"layers.\1.attn.\2.weight",
    ),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.mlp.gate.weight"),
    # experts already fused, (E, 2I, D) and (E, D, I), as transformers keeps them
    (r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", r"layers.\1.mlp.experts.\2"),
]
_HF_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)


def config_from_hf(hf_config) -> MoEConfig:
    """MoEConfig from a transformers Qwen3MoeConfig; anything this module does not implement is an
    error."""
    check(
        hf_config.model_type == "qwen3_moe",
        f"load_hf reads Qwen3-MoE checkpoints (model_type 'qwen3_moe'), "
        f"got model_type {hf_config.model_type!r}",
    )
    # transformers 5 keeps RoPE settings in rope_parameters; 4.x had rope_theta and rope_scaling
    # (None)
    rope = (
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "mlp_only_layers (dense MLP layers)": list(
            getattr(hf_config, "mlp_only_layers", None) or []
        ),
        "decoder_sparse_step != 1": getattr(hf_config, "decoder_sparse_step", 1) != 1,
        "attention_bias": getattr(hf_config, "attention_bias", False),
        "use_sliding_window": getattr(hf_config, "use_sliding_window", False),
        "hidden_act other than silu": getattr(hf_config, "hidden_act", "silu") != "silu",
        f"rope_type {rope_type!r}": rope_type != "default",
    }
    problems = [name for name, present in unsupported.items() if present]
    check(
        not problems,
        f"this Qwen3-MoE checkpoint uses features moe.py does not implement: {', '.join(problems)}",
    )
    # a config without head_dim means dim / n_heads
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return MoEConfig(
        vocab_size=hf_config.vocab_size,
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or default_head_dim,
        n_experts=hf_config.num_experts,
        n_active=hf_config.num_experts_per_tok,
        expert_dim=hf_config.moe_intermediate_size,
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        rms_eps=hf_config.rms_norm_eps,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        max_seq_len=hf_config.max_position_embeddings,
    )


def _read_hf_tensors(directory: str, dtype: torch.dtype) -> tuple[dict[str, Tensor], list[str]]:
    """Every tensor of a checkpoint directory under this module's names (per-expert weights fused
    per layer), and the checkpoint names that map to nothing here."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    check(bool(files), f"no *.safetensors files in {directory}")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: read only the shards the index names
        with open(index) as f:
            files = sorted(
                {os.path.join(directory, name) for name in json.load(f)["weight_map"].values()}
            )

    tensors = {}
    per_expert = {}  # (layer, expert, projection) -> one expert's matrix
    unexpected = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                match = _HF_PER_EXPERT.fullmatch(name)
                if match:
                    key = (int(match[1]), int(match[2]), match[3])
                    per_expert[key] = f.get_tensor(name).to(dtype)
                    continue
                for pattern, ours in _HF_RENAMES:
                    if re.fullmatch(pattern, name):
                        tensors[re.sub(pattern, ours, name)] = f.get_tensor(name).to(dtype)
                        break
                else:
                    unexpected.append(name)

    # Hub checkpoints (and save_pretrained) store one gate/up/down matrix per expert; stack them
    # into the fused (E, 2I, D) and (E, D, I) tensors. A missing expert leaves the fused name
    # missing.
    for layer in sorted({layer for layer, _, _ in per_expert}):
        n_experts = 1 + max(e for other_layer, e, _ in per_expert if other_layer == layer)
        parts = [
            [per_expert.pop((layer, e, p), None) for e in range(n_experts)]
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        if any(t is None for part in parts for t in part):
            unexpected.append(f"model.layers.{layer}.mlp.experts.*: incomplete per-expert tensors")
            continue
        gate, up, down = (torch.stack(part) for part in parts)
        gate_up = torch.cat((gate, up), dim=1)  # (E, 2I, D)
        tensors[f"layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        tensors[f"layers.{layer}.mlp.experts.down_proj"] = down  # (E, D, I)
    return tensors, unexpected


def load_hf(path_or_repo_id: str, dtype: torch.dtype = torch.float32):
    """A Hugging Face Qwen3-MoE checkpoint (a local directory or a hub repository) ->
    (MoETransformer, tokenizer or None). Experts load from per-expert matrices (the hub's and
    save_pretrained's layout) or from transformers' fused tensors (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`)."""
    from transformers import AutoConfig, AutoTokenizer

    directory = path_or_repo_id
    if not os.path.isdir(directory):
        from huggingface_hub import snapshot_download

        directory = snapshot_download(
            path_or_repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt"]
        )
    config = config_from_hf(AutoConfig.from_pretrained(directory, trust_remote_code=False))

    tensors, unexpected = _read_hf_tensors(directory, dtype)
    if config.tie_embeddings:  # a tied head is usually absent from the file and, if present, a copy
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):  # no memory for weights that are about to be replaced
        model = MoETransformer(config)
    expected = {
        name: p.shape
        for name, p in model.state_dict().items()
        if not (config.tie_embeddings and name == "lm_head.weight")
    }
    unexpected += [name for name in tensors if name not in expected]
    missing = [name for name in expected if name not in tensors]
    wrong_shape = [
        f"{name}: {tuple(tensors[name].shape)} != {tuple(shape)}"
        for name, shape in expected.items()
        if name in tensors and tensors[name].shape != shape
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"checkpoint {path_or_repo_id} does not match a {config}:\n"
            f"  missing: {missing}\n  unexpected: {unexpected}\n  wrong shape: {wrong_shape}"
        )
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight

    has_tokenizer = any(
        os.path.exists(os.path.join(directory, name))
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    )
    tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else None
    return model, tokenizer
