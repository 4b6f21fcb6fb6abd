"""The rollout side: NVFP4 W4A4 layers with residual activation compensation (RAC), the conversion
of a moe.py model into its rollout twin, and weight sync.

A rollout layer computes y = x @ W.T, W (N, K), both operands blocked by 16 along K (G = K / 16
blocks):

    W_q = quantize_weight(W)      nvfp4.py's one weight rule (qat.py, read next, trains with it)
    x_q = Q(x)                    NVFP4 with a dynamic global scale amax(|x|) / (6 * 448) per call
    r   = x - DQ(x_q)             the activation's quantization residual, exact in fp32
    r_q = Q(S * r)                S keeps whole 16-channel blocks: the round(rac_ratio * G) blocks
                                  with the largest mean |r| (calibrated), zero elsewhere
    y   = DQ(x_q) @ DQ(W_q).T + DQ(r_q) @ DQ(W_q).T  =  (DQ(x_q) + DQ(r_q)) @ DQ(W_q).T

Whole blocks keep the weight's codes and block scales valid for the residual term, so RAC never
re-reads weights: one W4A4 GEMM whose K is longer. rac_ratio 0 is naive NVFP4 (the selector then
chooses nothing and the residual is never computed); 1 compensates every block; QUADS uses about
0.5. The residual shares x's global scale (nvfp4.quantize_activation, the rule both sides call).
That scale is dynamic, since RL changes the weights every step, and is taken per tensor (the
paper's: a token's rounding then depends on the rows beside it in its batch) or per row
(act_scale="row": it does not). Two modes beside W4A4 separate the two error sources: "w4a16" (the
same weights and GEMMs, activations unquantized) and "w16a4" (full-precision weights on the
reference path, NVFP4 activations).

Reading order: the references (plain PyTorch, fp32), block selection, the layers (an attention's
q/k/v_proj read one input: NVFP4Attention quantizes it once for the three), conversion, sync and
calibration, what the symmetric trainers take from the rollout (InputRecorder, rac_masks; their
consumer, symmetric.py, is read after qat.py), the fast path (gpu_kernels/w4a4_*.py), and
`backend`, the one place a path is chosen. Hopper: fp16 MMAs on the FP4 weight decoded in
registers. Blackwell: `tl.dot_scaled` on the codes, numerics UNTESTED, checked against the Hopper
kernels on first use.

Nothing of a rollout's data is set on a layer from outside: what a layer records (TRACE) is handed
to its forward as an argument (moe.py's hand_offs). Two pieces of state are kept on purpose, each by
its owner: a RACSelector's mask (the calibrated selection, refreshed by calibrate_rac) and the
reference path's dequantized weight (DequantizedWeight, cleared whenever the layer loads a weight).

Shape letters: M rows, K reduction dim, N outputs, G = K / 16 blocks, T tokens, A active experts,
R = T * A, E experts, D model dim, I expert hidden. Left out: static activation scales, per-expert
RAC selection, a one-row GEMV (RL decodes whole batches), FP4 KV caches. The FP8 baseline, which
these layers' conversion also offers (mode "fp8"), is fp8.py, read after the trainer-side modules.
"""

import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8
import moe
import nvfp4
from gpu_kernels import expert_layout
from gpu_kernels.expert_layout import ExpertWeights, chunk_experts
from nvfp4 import BLOCK_SIZE, NVFP4Tensor

try:  # triton ships with CUDA builds of torch on Linux; without it the references run
    import triton
    from gpu_kernels import w4a4_blackwell, w4a4_dense, w4a4_experts, w4a4_quantize
except ImportError:
    triton = None
try:  # no Triton, or one before 3.5 (no Gluon): the experts run on the Triton kernel
    from gpu_kernels import w4a4_experts_gluon
except ImportError:
    w4a4_experts_gluon = None

MODES = ("bf16", "fp8", "nvfp4", "w4a16", "w16a4")
NVFP4_MODES = (
    "nvfp4",
    "w4a16",
    "w16a4",
)  # the NVFP4 layers' modes: W4A4, weights only, activations only
ACTIVATION_MODES = ("nvfp4", "w16a4")  # the modes with NVFP4 activations: RAC and act_scale apply
GLUON_EXPERTS_BELOW = 2048  # tokens: from here on the experts run on the Triton kernel (prefill)
KERNEL_CAPABILITY = (8, 9)  # the kernels' E4M3 conversions (cvt.*.e4m3x2) need sm_89 or later
_PARTS = ("data", "block_scale", "global_scale")  # an NVFP4 weight's three buffers
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# =================================================================== the references (plain PyTorch)
def quantize_activation_reference(x, rac_mask=None, act_scale="tensor"):
    """x (M, K) -> nvfp4.quantize_activation's (x_q, residual) (residual None without rac_mask
    (G,))."""
    _check_input(x, rac_mask, "quantize_activation_reference")
    return nvfp4.quantize_activation(x, rac_mask, act_scale)


def matmul_reference(x_q, w_q, residual=None, out_dtype=torch.bfloat16, w=None):
    """(DQ(x_q) + DQ(residual)) @ DQ(w_q).T in fp32: x_q (M, K), w_q (N, K) -> (M, N); w: DQ(w_q) if
    kept."""
    _check_operands(x_q, w_q, residual, "matmul_reference")
    w = _dequantized(w_q) if w is None else w
    return (_dequantized(x_q, residual) @ w.T).to(out_dtype)


def nvfp4_linear_reference(x, w_q, rac_mask=None):
    """The NVFP4 layer's twin: quantize x (and its RAC residual), dequantize, fp32 matmul -> (M, N)
    fp32."""
    x_q, residual = quantize_activation_reference(x, rac_mask)
    return matmul_reference(x_q, w_q, residual, out_dtype=torch.float32)


def grouped_matmul_reference(
    x_q,
    w_q,
    counts,
    residual=None,
    row_ids=None,
    row_weights=None,
    swiglu=False,
    out_dtype=torch.bfloat16,
    w=None,
    row_weight_ids=None,
):
    """The experts' GEMM, a loop in fp32: rows (x_q's, or x_q[row_ids]) grouped by expert, counts
    (E,) rows each, times DQ(w_q[e]).T (w_q (E, N, K), or ExpertWeights); swiglu: silu(gate) * up of
    the [gate; up] rows. Output row r times row_weights[r], or row_weights[row_weight_ids[r]]. w:
    DQ(w_q) if kept."""
    _check_operands(x_q, w_q, residual, "grouped_matmul_reference", stacked=True)
    n_rows = row_ids.numel() if row_ids is not None else x_q.shape[0]
    _check_row_weights(row_weights, row_weight_ids, n_rows, "grouped_matmul_reference")
    x = _dequantized(x_q, residual)
    if row_ids is not None:
        x = x[row_ids]  # (R, K)
    w = _dequantized(w_q) if w is None else w  # (E, N, K)
    y = torch.cat([x_e @ w_e.T for x_e, w_e in zip(x.split(counts.tolist()), w)])  # (R, N)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up  # (R, N/2)
    if row_weights is not None:
        row_weights = row_weights if row_weight_ids is None else row_weights[row_weight_ids]  # (R,)
        y = y * row_weights.float()[:, None]
    return y.to(out_dtype)


def _dequantized(q, residual=None):
    """DQ(q) in fp32 (q NVFP4Tensor, ExpertWeights, or a float tensor: w4a16's x), plus
    DQ(residual)."""
    q = unchunk_experts(q) if isinstance(q, ExpertWeights) else q
    x = q.float() if isinstance(q, torch.Tensor) else nvfp4.dequantize_reference(q, torch.float32)
    return x if residual is None else x + nvfp4.dequantize_reference(residual, torch.float32)


# ======================================================================== RAC block selection
class RACSelector(nn.Module):
    """Which 16-channel blocks of one layer input get RAC: `mask` (G,), True on the round(rac_ratio
    * G) blocks with the largest mean |x - DQ(Q(x))| over the calibration inputs (calibrate_rac),
    else the first input."""

    def __init__(self, n_blocks, rac_ratio=0.0, device=None, act_scale="tensor"):
        super().__init__()
        self.n_blocks, self.act_scale = n_blocks, act_scale
        self.register_buffer("mask", torch.zeros(n_blocks, dtype=torch.bool, device=device))
        self.register_buffer(
            "error_sum", torch.zeros_like(self.mask, dtype=torch.float64), persistent=False
        )
        self.set_ratio(rac_ratio)

    def set_ratio(self, rac_ratio):
        _check_ratio(rac_ratio)
        self.rac_ratio = float(rac_ratio)
        self.n_selected = int(self.rac_ratio * self.n_blocks + 0.5)
        self.mask.fill_(self.n_selected == self.n_blocks)
        self.calibrated = self.n_selected in (0, self.n_blocks)  # nothing to choose
        self.calibrating = False

    def start_calibration(self):
        self.error_sum.zero_()
        self.calibrating = True

    def finish_calibration(self):
        self.calibrating, self.calibrated = False, True

    @torch.no_grad()
    def forward(self, x):
        """x (M, K) -> the mask (G,), or None when nothing is compensated (naive NVFP4)."""
        if self.n_selected == 0:
            return None
        if self.calibrating or not self.calibrated:
            # sum over inputs of M * mean |x - DQ(Q(x))| per block
            residual = x.float() - nvfp4.fake_quantize_activation(x, None, self.act_scale)  # (M, K)
            blocks = residual.abs().reshape(-1, x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)  # (M, G, 16)
            error = blocks.mean(dim=(0, 2))  # (G,)
            self.error_sum += error.double() * x.shape[0]
            self.mask.zero_()
            self.mask[torch.topk(self.error_sum, self.n_selected).indices] = True
            self.calibrated = self.calibrated or not self.calibrating
        return self.mask

    def extra_repr(self):
        return f"n_blocks={self.n_blocks}, rac_ratio={self.rac_ratio}, n_selected={self.n_selected}"


def unchunk_experts(w):
    """ExpertWeights (gpu_kernels/expert_layout.py) -> NVFP4Tensor (E, N, K): views when K is one
    chunk."""
    return NVFP4Tensor(*expert_layout.unchunk_experts(w))


# ======================================================================== rollout layers
class DequantizedWeight:
    """DQ(W) in fp32 for the reference path, computed once per weight load: dequantizing on every
    call costs a sixth of a CPU train.py. Its owner, the layer, calls clear() whenever it writes the
    weight (load_weight, load_state_dict), so a kept value never outlives the codes it came from.
    w16a4 keeps the full-precision weight itself in `full`."""

    def __init__(self):
        self.value = None
        self.full = None

    def clear(self):
        self.value = None

    def __call__(self, q):
        if self.full is not None:
            return self.full
        if self.value is None:
            self.value = _dequantized(q)
        return self.value


def _kernels(x, layer):
    """Does `layer` run the kernels on x? Not w16a4: its full-precision weight has none (an
    ablation)."""
    return use_triton(x) and layer.mode != "w16a4"


def _quantized_input(x2, rac_mask, layer, kernels):
    """What a layer's GEMM takes of x2 (M, K): the quantizer's Activation on the kernels, else the
    codes (x_q, residual); w4a16 quantizes nothing (its operand of x, or x2 itself with no
    residual)."""
    if kernels:
        quantize = layer.mode != "w4a16"
        scale = layer.act_scale
        return quantize_activation_triton(x2, rac_mask, act_scale=scale, quantize=quantize)
    if layer.mode == "w4a16":
        return (x2, None)
    return quantize_activation_reference(x2, rac_mask, layer.act_scale)


class NVFP4Linear(nn.Module):
    """W4A4 nn.Linear: NVFP4 weights (`weight_q`), activations quantized per call, RAC where `rac`
    picks. mode "w4a16": activations unquantized; "w16a4": full-precision weights (the twin path),
    NVFP4 inputs."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=False,
        rac_ratio=0.0,
        device=None,
        mode="nvfp4",
        act_scale="tensor",
    ):
        super().__init__()
        _check_blocks("NVFP4Linear", in_features)
        _check_mode(mode, rac_ratio, act_scale, NVFP4_MODES)
        self.in_features = in_features
        self.out_features = out_features
        self.mode = mode
        self.act_scale = act_scale
        G = in_features // BLOCK_SIZE
        codes = torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        block_scale = torch.zeros(out_features, G, dtype=torch.float8_e4m3fn, device=device)
        global_scale = torch.ones((), dtype=torch.float32, device=device)
        self.register_buffer("weight_data", codes)
        self.register_buffer("weight_block_scale", block_scale)
        self.register_buffer("weight_global_scale", global_scale)
        self.bias = None
        if bias:
            zeros = torch.zeros(out_features, device=device)
            self.bias = nn.Parameter(zeros, requires_grad=False)
        self.rac = RACSelector(G, rac_ratio, device=device, act_scale=act_scale)
        # the reference path's DQ(W) (w16a4: W itself), cleared whenever the weight is written
        self.weight_fp32 = DequantizedWeight()

    weight_q = property(
        lambda self: NVFP4Tensor(*(getattr(self, f"weight_{part}") for part in _PARTS))
    )

    @classmethod
    def from_float(cls, linear, rac_ratio=0.0, mode="nvfp4", act_scale="tensor"):
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            rac_ratio=rac_ratio,
            device=linear.weight.device,
            mode=mode,
            act_scale=act_scale,
        )
        layer.load_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        """Quantize a master weight (N, K) with nvfp4.quantize_weight, in place (the trainer's
        rule)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"NVFP4Linear: weight shape {tuple(weight.shape)} != "
                f"{(self.out_features, self.in_features)}"
            )
        q = nvfp4.quantize_weight(weight.detach())
        for part in _PARTS:
            getattr(self, f"weight_{part}").copy_(getattr(q, part))
        self.weight_fp32.clear()
        if self.mode == "w16a4":
            self.weight_fp32.full = weight.detach().float().clone()
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def _load_from_state_dict(self, *args, **kwargs):
        # a state dict writes the weight's buffers too: the kept DQ(W) must go with the old codes
        super()._load_from_state_dict(*args, **kwargs)
        self.weight_fp32.clear()

    def share_input(self, selector, weight_views):
        """Read the input of a group (NVFP4Attention's q/k/v): the group's one RACSelector, and
        weight buffers that become `weight_views`, views of the group's stacked weight."""
        self.rac = selector
        self.weight_data, self.weight_block_scale, self.weight_global_scale = weight_views

    def forward(self, x, record=None):
        """x (..., K) -> (..., N). record: a RecordSlot (InputRecorder) that keeps what this layer
        quantizes, handed to this call by the caller (TRACE's rollout), else None."""
        fp8.check_layer_input(x, self.in_features, self.weight_data.device, "NVFP4Linear")
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if record is not None:
            record.record(0, x2)
        act = _quantized_input(x2, self.rac(x2), self, _kernels(x2, self))
        y = self._matmul(x2, act)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, x2, act):
        """x2 (M, K) @ DQ(W).T in x2's dtype, on act = _quantized_input(x2, rac_mask)."""
        w_q = self.weight_q
        if isinstance(act, Activation):
            return layer_matmul(act, w_q, x2.dtype)
        x_q, residual = act  # the twin's codes
        y = matmul_reference(x_q, w_q, residual, torch.float32, self.weight_fp32(w_q))
        return y.to(x2.dtype)

    def extra_repr(self):
        return (
            f"in={self.in_features}, out={self.out_features}, rac={self.rac.rac_ratio}, "
            f"{self.mode}, {self.act_scale}"
        )


def stack_weights(weights):
    """NVFP4 weights (N_i, K) as one (sum N_i, K) NVFP4Tensor with (len(weights),) global scales:
    splits."""
    return NVFP4Tensor(
        torch.cat([w.data for w in weights]),
        torch.cat([w.block_scale for w in weights]),
        torch.stack([w.global_scale.reshape(()) for w in weights]),
    )


class NVFP4Attention(moe.Attention):
    """moe.Attention whose q/k/v_proj (NVFP4Linear) read their one input once: one RACSelector, one
    quantization and, on the kernels, one GEMM over a stacked weight (three global scales) whose
    views are the three layers' own buffers, so weight sync and state dicts see three ordinary
    layers."""

    @classmethod
    def from_float(cls, attention):
        """A twin of `attention` whose q/k/v_proj are already NVFP4Linear; the same submodules."""
        layer = moe.same_state_as(cls, attention)
        layer.qkv = (layer.q_proj, layer.k_proj, layer.v_proj)
        layer.splits = [proj.out_features for proj in layer.qkv]
        layer.weight_q = stack_weights([proj.weight_q for proj in layer.qkv])
        q = layer.weight_q
        views = zip(q.data.split(layer.splits), q.block_scale.split(layer.splits), q.global_scale)
        for proj, weight_views in zip(layer.qkv, views):
            proj.share_input(layer.q_proj.rac, weight_views)
        return layer

    def _stacked(self):
        """The stacked weight; None if a layer's buffers are no longer views of it (moved or
        replaced after conversion), then each layer multiplies alone, with one warning."""
        for proj in self.qkv:
            for part in _PARTS:
                view = getattr(proj, f"weight_{part}")
                whole = getattr(self.weight_q, part)
                if view.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
                    warnings.warn(
                        "rac.NVFP4Attention: q/k/v_proj's weights are no longer views of their "
                        "stacked weight: running three GEMMs",
                        stacklevel=3,
                    )
                    return None
        return self.weight_q

    def project_qkv(self, x, hand_offs=None):
        """q, k and v of x (B, T, D), from one quantization of x; hand_offs: TRACE's RecordSlot for
        the group (under any of the three paths), else None."""
        x2 = x.reshape(-1, x.shape[-1])  # (M, D)
        record = None
        if hand_offs is not None:
            record = hand_offs.get("q_proj")
        if record is not None:
            record.record(0, x2)
        kernels = _kernels(x2, self.q_proj)
        act = _quantized_input(x2, self.q_proj.rac(x2), self.q_proj, kernels)
        stacked = None
        if kernels:
            stacked = self._stacked()
        if stacked is not None:
            outputs = layer_matmul(act, stacked, x2.dtype, self.splits)
        else:
            outputs = [proj._matmul(x2, act) for proj in self.qkv]
        results = []
        for proj, y in zip(self.qkv, outputs):
            if proj.bias is not None:
                y = y + proj.bias.to(y.dtype)
            results.append(y.view(*x.shape[:-1], proj.out_features))
        return tuple(results)


class NVFP4Experts(nn.Module):
    """W4A4 moe.Experts: NVFP4 weights, two grouped GEMMs, RAC on each input; modes as
    NVFP4Linear's."""

    def __init__(
        self,
        n_experts,
        dim,
        expert_dim,
        rac_ratio=0.0,
        device=None,
        mode="nvfp4",
        act_scale="tensor",
    ):
        super().__init__()
        _check_blocks("NVFP4Experts (model dim)", dim)
        _check_blocks("NVFP4Experts (expert dim)", expert_dim)
        _check_mode(mode, rac_ratio, act_scale, NVFP4_MODES)
        self.n_experts, self.dim, self.expert_dim = E, D, I = n_experts, dim, expert_dim
        self.mode, self.act_scale = mode, act_scale
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):  # in ExpertWeights' layout
            empty = NVFP4Tensor(
                torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device),
                torch.zeros(E, N, K // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(E, dtype=torch.float32, device=device),
            )
            for part, buffer in zip(_PARTS, chunk_experts(empty)):
                self.register_buffer(f"{name}_{part}", buffer)
        self.rac_gate_up = RACSelector(
            D // BLOCK_SIZE, rac_ratio, device=device, act_scale=act_scale
        )
        self.rac_down = RACSelector(I // BLOCK_SIZE, rac_ratio, device=device, act_scale=act_scale)
        self.gate_up_fp32, self.down_fp32 = (
            DequantizedWeight(),
            DequantizedWeight(),
        )  # the twin path's (w16a4: W)

    gate_up_w = property(
        lambda self: ExpertWeights(*(getattr(self, f"gate_up_{part}") for part in _PARTS))
    )
    down_w = property(
        lambda self: ExpertWeights(*(getattr(self, f"down_{part}") for part in _PARTS))
    )

    @classmethod
    def from_float(cls, experts, rac_ratio=0.0, mode="nvfp4", act_scale="tensor"):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, rac_ratio, experts.gate_up_proj.device, mode, act_scale)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        """Quantize the master stacks with nvfp4.quantize_weight (per-expert global scales), in
        place."""
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            expected = getattr(self, f"{name}_w").shape
            if tuple(w.shape) != expected:
                raise ValueError(
                    f"NVFP4Experts: {name} weight shape {tuple(w.shape)} does not match {expected}"
                )
            q = chunk_experts(nvfp4.quantize_weight(w.detach()))
            for part in _PARTS:
                getattr(self, f"{name}_{part}").copy_(getattr(q, part))
            getattr(self, f"{name}_fp32").clear()
            if self.mode == "w16a4":
                getattr(self, f"{name}_fp32").full = w.detach().float().clone()

    def _load_from_state_dict(self, *args, **kwargs):
        # a state dict writes the weights' buffers too: the kept DQ(W) must go with the old codes
        super()._load_from_state_dict(*args, **kwargs)
        self.gate_up_fp32.clear()
        self.down_fp32.clear()

    def forward(self, x, expert_ids, expert_weights, record=None):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) -> (T, D) in x.dtype, as
        moe.Experts. record: a RecordSlot (InputRecorder) keeping both quantized inputs, or None."""
        fp8.check_layer_input(x, self.dim, self.gate_up_data.device, "NVFP4Experts")
        routing = moe.route_tokens(expert_ids, self.n_experts)
        if record is not None:
            record.record(0, x)
            record = RouteSlot(record, routing, expert_ids)
        if _kernels(x, self):
            forward = self._forward_triton
        else:
            forward = self._forward_reference
        y_sorted = forward(x, routing, expert_weights.reshape(-1), record)  # (R, D), weighted
        return moe.sum_expert_rows(y_sorted, routing, expert_ids.shape[1]).to(x.dtype)

    def _forward_triton(self, x, routing, expert_weights, record=None):
        """x (T, D), routing, expert_weights (T * A,) -> (R, D): each sorted row times its router
        weight. record: a RouteSlot for the down input, or None."""
        T = x.shape[0]  # the layer's token count chooses the experts' kernel, not its R rows
        act = _quantized_input(x, self.rac_gate_up(x), self, kernels=True)
        hidden = grouped_matmul_triton(
            act,
            self.gate_up_w,
            routing.counts,
            row_ids=routing.token_ids,
            swiglu=True,
            out_dtype=x.dtype,
            tokens=T,
        )  # (R, I)
        if record is not None:
            record.record(1, hidden)
        act = _quantized_input(hidden, self.rac_down(hidden), self, kernels=True)
        return grouped_matmul_triton(
            act,
            self.down_w,
            routing.counts,
            row_weights=expert_weights,
            row_weight_ids=routing.order,
            out_dtype=x.dtype,
            tokens=T,
        )  # (R, D)

    def _forward_reference(self, x, routing, expert_weights, record=None):
        """The twin: the same quantization steps, dequantized, a loop of fp32 matmuls over
        experts."""
        gate_up_w, down_w = self.gate_up_w, self.down_w
        x_q, residual = _quantized_input(x, self.rac_gate_up(x), self, kernels=False)
        hidden = grouped_matmul_reference(
            x_q,
            gate_up_w,
            routing.counts,
            residual,
            row_ids=routing.token_ids,
            swiglu=True,
            out_dtype=x.dtype,
            w=self.gate_up_fp32(gate_up_w),
        )
        if record is not None:
            record.record(1, hidden)
        h_q, residual = _quantized_input(hidden, self.rac_down(hidden), self, kernels=False)
        return grouped_matmul_reference(
            h_q,
            down_w,
            routing.counts,
            residual,
            row_weights=expert_weights,
            out_dtype=torch.float32,
            w=self.down_fp32(down_w),
            row_weight_ids=routing.order,
        )

    def extra_repr(self):
        return (
            f"n_experts={self.n_experts}, dim={self.dim}, expert_dim={self.expert_dim}, "
            f"rac_ratio={self.rac_gate_up.rac_ratio}, mode={self.mode}, act_scale={self.act_scale}"
        )


def selectors(layer):
    """A layer's RACSelectors, one per quantized input: (rac,), (gate/up, down) of experts, or
    ()."""
    if isinstance(layer, NVFP4Linear):
        return (layer.rac,)
    if isinstance(layer, NVFP4Experts):
        return (layer.rac_gate_up, layer.rac_down)
    return ()


# ==================================================================== conversion, sync, calibration
def convert_for_rollout(
    model, mode, rac_ratio=0.0, quantize_router=False, quantize_lm_head=False, act_scale="tensor"
):
    """Swap a moe.py model's layers for rollout layers in place; returns the model.

    mode: "bf16" (unchanged), "fp8" (fp8.py), "nvfp4" (W4A4, RAC on round(rac_ratio * G) blocks,
    act_scale "tensor" or "row"), "w4a16" or "w16a4" (NVFP4 weights or activations alone). Swapped:
    the attention projections and experts, with the flags the routers and the LM head; an attention
    whose q/k/v_proj are all NVFP4Linear becomes an NVFP4Attention (one quantization of its
    input)."""
    _check_mode(mode, rac_ratio, act_scale)
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        experts = isinstance(child, moe.Experts)
        if mode in NVFP4_MODES and experts:
            layer = NVFP4Experts.from_float(child, rac_ratio, mode, act_scale)
        elif mode in NVFP4_MODES:
            layer = NVFP4Linear.from_float(child, rac_ratio, mode, act_scale)
        elif experts:
            layer = fp8.FP8Experts.from_float(child)
        else:
            layer = fp8.FP8Linear.from_float(child)
        setattr(parent, name, layer)
    for parent, name, attention in list(_attention_modules(model)):
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        if all(isinstance(proj, NVFP4Linear) for proj in projections):
            setattr(parent, name, NVFP4Attention.from_float(attention))
    return model


def _attention_modules(model):
    """(parent, attribute, moe.Attention) for every attention block not yet an NVFP4Attention."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, moe.Attention) and not isinstance(child, NVFP4Attention):
                yield parent, name, child


@torch.no_grad()
def sync_weights(rollout_model, trainer_model):
    """Reload every rollout weight in place from the trainer's: quantized layers re-quantize (NVFP4
    with nvfp4.quantize_weight: the trainer's QAT codes bit for bit), the rest is copied by name.
    The RAC block selection is left alone: calibrate_rac refreshes it."""
    params = dict(trainer_model.named_parameters(remove_duplicate=False))

    def master(path, name):
        key = f"{path}.{name}" if path else name
        if key not in params:
            raise ValueError(
                f"sync_weights: the trainer model has no parameter {key!r} (rollout layer {path!r})"
            )
        return params[key]

    quantized = {
        path
        for path, m in rollout_model.named_modules()
        if isinstance(m, (NVFP4Linear, NVFP4Experts, fp8.FP8Linear, fp8.FP8Experts))
    }
    for path, module in rollout_model.named_modules():
        if isinstance(module, (NVFP4Linear, fp8.FP8Linear)):
            module.load_weight(
                master(path, "weight"), master(path, "bias") if module.bias is not None else None
            )
        elif isinstance(module, (NVFP4Experts, fp8.FP8Experts)):
            module.load_weights(master(path, "gate_up_proj"), master(path, "down_proj"))
    for name, param in rollout_model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        if path not in quantized:  # a quantized layer's bias was loaded above
            param.copy_(master(path, leaf))


@torch.no_grad()
def calibrate_rac(rollout_model, tokens):
    """Choose each NVFP4 layer input's compensated blocks from one forward pass on `tokens` (B, T),
    each selector on what its layer receives (upstream ones already on their fresh selection);
    returns the model."""
    selectors = [m for m in rollout_model.modules() if isinstance(m, RACSelector)]
    for selector in selectors:
        selector.start_calibration()
    try:
        rollout_model(tokens)
    finally:
        for selector in selectors:
            selector.finish_calibration()
    return rollout_model


def rac_masks(rollout_model):
    """A snapshot of every NVFP4 layer's RAC block masks, {layer path: (mask (G,) bool, ...)}, one
    per quantized input (a linear: one; experts: gate/up, down), cloned: the rollout's selection at
    the time of the call, unchanged by a later calibrate_rac. MoEResQ's trainer takes it
    (symmetric.py)."""
    masks = {}
    for path, layer in rollout_model.named_modules():
        layer_selectors = selectors(layer)
        if layer_selectors:
            masks[path] = tuple(selector.mask.clone() for selector in layer_selectors)
    return masks


# ===================================================================== TRACE: recording the rollout
class RecordedCodes(NamedTuple):
    """What the rollout's quantizer produced for some rows of one layer input, one record per
    row."""

    # (M',) int64, ascending: trainer row b * W + w (down input: row * E + expert)
    keys: torch.Tensor
    data: torch.Tensor  # (M', K/2) uint8 packed E2M1 codes, low nibble first
    block_scale: torch.Tensor  # (M', G) float8_e4m3fn
    global_scale: torch.Tensor  # (M',) fp32
    n_experts: int = 1  # E for an experts layer's down input (keys row * E + expert), else 1


class InputRecorder:
    """The NVFP4 codes of every quantized layer input at each decode step of one rollout, for
    TRACE's trainer (symmetric.py), which rounds towards them.

    Made for one rollout: `hand_offs()` gives each NVFP4 layer a RecordSlot, which rollout.generate
    passes to the decode steps' forward (moe.py's hand_offs: an argument of the call, as the KV
    cache is); the layer records the input it quantizes; `codes(out)` then returns the completion
    tokens' records, keyed by the trainer's (row, column). The input is re-quantized with
    nvfp4.quantize and the rollout's act_scale, which gives the rollout's own codes. Per token and
    input of width K: K/2 + K/16 + 12 bytes (1.5 KB per token and layer on the small preset), held
    from the rollout to the update."""

    def __init__(self, rollout_model, act_scale="tensor"):
        self.act_scale = act_scale  # the rollout's: one global scale per tensor or per row
        self.steps = {}  # (paths, index) -> [(data, block_scale, global_scale) per decode step]
        self.experts = {}  # (paths, index) -> [expert_ids (T, A) per decode step]
        self.n_experts = {}  # (paths, index) -> E
        self.slots = record_slots(rollout_model, self)

    def hand_offs(self):
        """{layer path: RecordSlot}: what the decode steps' forward hands each NVFP4 layer."""
        return dict(self.slots)

    @torch.no_grad()
    def record(self, paths, index, x, routes=None):
        """x (M, K): input `index` of the layers at `paths` at this decode step; index 1 (the
        experts' down input, rows sorted by expert) with routes = (moe.Routing, expert_ids (T,
        A))."""
        q = nvfp4.quantize(x, nvfp4.activation_global_scale(x, self.act_scale))
        data = q.data
        block_scale = q.block_scale.view(torch.uint8)
        global_scale = q.global_scale.float().expand(x.shape[0])  # (M,)
        if index == 1:  # rows sorted by expert -> assignment order t * A + a
            routing, expert_ids = routes
            data = data.index_copy(0, routing.order, data)
            block_scale = block_scale.index_copy(0, routing.order, block_scale)
            global_scale = global_scale.index_copy(0, routing.order, global_scale)
            self.experts.setdefault((paths, index), []).append(expert_ids)
            self.n_experts[paths, index] = routing.counts.numel()
        self.steps.setdefault((paths, index), []).append((data, block_scale, global_scale))

    @torch.no_grad()
    def codes(self, out):
        """{layer path: (RecordedCodes or None, ...)} of the completion tokens of `out` (a
        rollout.Rollout), one entry per quantized input, keyed by the trainer's position b * W + w:
        completion token t of row b sits at column prompt_lengths[b] + t of right-padded rows of
        width W; the experts' down inputs by (b * W + w) * E + expert."""
        completion_mask, prompt_lengths = out.completion_mask, out.prompt_lengths
        width = int((out.prompt_lengths + out.completion_lengths).max())  # the trainer's W
        B, T = completion_mask.shape
        b, t = completion_mask.nonzero(as_tuple=True)  # (n,) each, ascending
        position = b * width + prompt_lengths[b] + t  # (n,) trainer rows
        by_path = {}
        for (paths, index), records in self.steps.items():
            if len(records) < T:
                raise ValueError(
                    f"InputRecorder: {paths[0]!r} saw {len(records)} decode steps, "
                    f"the rollout has {T} tokens"
                )
            columns = list(zip(*records[:T]))
            # (B[*A], T, .)
            data, block_scale, global_scale = (torch.stack(c, dim=1) for c in columns)
            if index == 1:
                experts = torch.stack(self.experts[paths, index][:T], dim=1)  # (B, T, A)
                E = self.n_experts[paths, index]
                A = experts.shape[-1]
                data = data.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)  # (n * A, K/2)
                block_scale = block_scale.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)
                global_scale = global_scale.view(B, A, T).transpose(1, 2)[b, t].flatten()  # (n*A,)
                keys = (position[:, None] * E + experts[b, t]).flatten()  # (n * A,)
                order = keys.argsort()
                block_scale = block_scale[order].view(torch.float8_e4m3fn)
                codes = RecordedCodes(keys[order], data[order], block_scale, global_scale[order], E)
            else:
                block_scale = block_scale[b, t].view(torch.float8_e4m3fn)
                codes = RecordedCodes(position, data[b, t], block_scale, global_scale[b, t])
            for path in paths:
                by_path.setdefault(path, {})[index] = codes
        result = {}
        for path, sites in by_path.items():
            result[path] = tuple(sites.get(i) for i in range(max(sites) + 1))
        return result


def record_slots(rollout_model, recorder):
    """{layer path: RecordSlot} for every NVFP4 layer of `rollout_model`, each writing to `recorder`
    (any object with record(paths, index, x, routes)): q, k and v read one input, so they share one
    slot named by their three paths."""
    groups = []
    grouped = set()
    for path, layer in rollout_model.named_modules():
        if isinstance(layer, NVFP4Attention):
            paths = [f"{path}.{name}" for name in ("q_proj", "k_proj", "v_proj")]
            groups.append(paths)
            grouped.update(paths)
    for path, layer in rollout_model.named_modules():
        if isinstance(layer, (NVFP4Linear, NVFP4Experts)) and path not in grouped:
            groups.append([path])
    slots = {}
    for paths in groups:
        slot = RecordSlot(recorder, tuple(paths))
        for path in paths:
            slots[path] = slot
    return slots


class RecordSlot(NamedTuple):
    """What an NVFP4 layer is handed to record its quantized inputs: the recorder and the layers'
    paths (q, k and v share one input, so one slot). index 0: a linear's or the experts' gate/up
    input; 1: the experts' down input, with routes = (moe.Routing, expert_ids)."""

    recorder: object
    paths: tuple

    def record(self, index, x, routes=None):
        self.recorder.record(self.paths, index, x, routes)


class RouteSlot(NamedTuple):
    """A RecordSlot with the experts' routes of this call, which the down input's record needs."""

    slot: RecordSlot
    routing: moe.Routing
    expert_ids: torch.Tensor

    def record(self, index, x):
        self.slot.record(index, x, (self.routing, self.expert_ids))


# ============================================================ the fast path (gpu_kernels/w4a4_*.py)
class Activation(NamedTuple):
    """An activation quantized for the W4A4 GEMMs (the fields a path does not need are None)."""

    x_q: NVFP4Tensor | None  # codes and block scales of x, with the global scale
    residual: (
        NVFP4Tensor | None
    )  # RAC residual codes (zero blocks where not compensated), same global scale
    operand: (
        torch.Tensor | None
    )  # (2, M, K/2) fp16 planes of (DQ(x_q) + DQ(residual)) / global_scale * 2^-6
    global_scale: torch.Tensor  # () fp32

    codes = property(
        lambda self: (
            self.x_q.data,
            self.x_q.block_scale,
            *(  # as the Blackwell kernels take them
                (None, None)
                if self.residual is None
                else (self.residual.data, self.residual.block_scale)
            ),
        )
    )


def quantize_activation_triton(
    x, rac_mask=None, codes=None, operand=None, act_scale="tensor", quantize=True
):
    """x (M, K) -> Activation: the codes of x and its RAC residual (codes=True:
    quantize_activation_reference bit for bit), the Hopper GEMMs' fp16 operand (operand=True); None:
    what this device's GEMMs take."""
    _check_input(x, rac_mask, "quantize_activation_triton", kernel=True)
    native = backend(x.device) == "native" and quantize  # W4A16's operand goes to the Hopper GEMMs
    codes, operand = (
        native if codes is None else codes,
        (not native) if operand is None else operand,
    )
    extra = (
        {}
        if (act_scale, quantize) == ("tensor", True)
        else dict(row_scale=act_scale == "row", quantize=quantize)
    )
    data, scale, r_data, r_scale, planes, global_scale = w4a4_quantize.quantize_activation(
        x, rac_mask, codes, operand, **extra
    )
    return Activation(
        NVFP4Tensor(data, scale, global_scale) if codes else None,
        NVFP4Tensor(r_data, r_scale, global_scale) if r_data is not None else None,
        planes,
        global_scale,
    )


def layer_matmul(act, w_q, out_dtype, splits=None):
    """The dense GEMM on a quantized activation: (M, N), or one (M, n) per stacked weight
    (splits)."""
    w = (w_q.data, w_q.block_scale, w_q.global_scale, out_dtype, splits)
    if act.operand is None:
        return w4a4_blackwell.dense_matmul(*act.codes, act.global_scale, *w)
    return w4a4_dense.dense_matmul(act.operand, act.global_scale, *w)


def nvfp4_linear_triton(x, w_q, rac_mask=None, out_dtype=torch.bfloat16, splits=None):
    """The NVFP4 layer's fast path x (M, K) -> (M, N); splits: w_q stacks up to 3 weights (q/k/v)
    along N."""
    _check_input(x, rac_mask, "nvfp4_linear", kernel=True)
    _check_kernel_call(out_dtype)
    if x.shape[1] != w_q.shape[1] or x.device != w_q.device:
        raise ValueError(
            f"nvfp4_linear: x {tuple(x.shape)} on {x.device} does not match the weight "
            f"{tuple(w_q.shape)} on {w_q.device}"
        )
    if splits is not None and not (1 <= len(splits) <= 3 and sum(splits) == w_q.shape[0]):
        raise ValueError(
            f"nvfp4_linear: splits {tuple(splits)} must be 1 to 3 row counts adding up to the "
            f"weight's N = {w_q.shape[0]}"
        )
    n_scales = 1
    if splits is not None:
        n_scales = len(splits)
    if w_q.global_scale.numel() != n_scales:
        raise ValueError(
            f"nvfp4_linear: the weight has {w_q.global_scale.numel()} global scales; "
            f"expected {n_scales} (one per stacked weight)"
        )
    return layer_matmul(quantize_activation_triton(x, rac_mask), w_q, out_dtype, splits)


def grouped_matmul_triton(
    act,
    w,
    counts,
    row_ids=None,
    row_weights=None,
    swiglu=False,
    out_dtype=torch.bfloat16,
    row_weight_ids=None,
    tokens=None,
):
    """grouped_matmul_reference's fast path (no host sync): Blackwell's kernel on codes; Gluon's
    where `backend` says so (K % 64 == 0) below GLUON_EXPERTS_BELOW tokens (the layer's; None: act's
    rows); else Triton's."""
    _check_kernel_call(out_dtype)
    if not isinstance(w, ExpertWeights):
        raise ValueError(
            f"grouped_matmul_triton: w must be ExpertWeights (rac.chunk_experts of the stacked "
            f"NVFP4Tensor), got {type(w).__name__}"
        )
    act_rows = act.operand.shape[1] if act.operand is not None else act.x_q.shape[0]
    n_rows = row_ids.numel() if row_ids is not None else act_rows
    _check_row_weights(row_weights, row_weight_ids, n_rows, "grouped_matmul_triton")
    args = (
        w.data,
        w.block_scale,
        w.global_scale,
        counts,
        out_dtype,
        row_ids,
        row_weights,
        row_weight_ids,
        swiglu,
    )
    if act.operand is None:  # codes only: the native kernel
        return w4a4_blackwell.grouped_matmul(*act.codes, act.global_scale, *args)
    # H200, gate/up + down, Gluon vs Triton, us: 64 tokens 123 / 139, 1,024 tokens 421 / 486,
    # 4,096 tokens 1987 / 1269
    decode = (act_rows if tokens is None else tokens) < GLUON_EXPERTS_BELOW
    gluon_here = backend(w.device) == "gluon" and w.shape[2] % 64 == 0 and decode
    kernel = w4a4_experts_gluon if gluon_here else w4a4_experts
    return kernel.grouped_matmul(act.operand, act.global_scale, *args)


# =================================================================== the one place a path is chosen
_BACKENDS = {}  # CUDA device index -> its backend, decided once


def backend(device):
    """Which path the W4A4 layers take on `device`:
    'reference'  the plain-PyTorch references: CPU tensors, no Triton, or a GPU before sm_89
                 (one warning)
    'gluon'      sm_89 / sm_90 with Gluon: quantizer, tiled dense GEMM, Gluon experts (decode sizes)
    'triton'     the same with the Triton experts: no Gluon, the interpreter, or a failed
                 Blackwell check
    'native'     sm_100+: tl.dot_scaled, once it matched the Hopper kernels
                 (w4a4_blackwell.disagreement)"""
    if device.type != "cuda" or triton is None:
        return "reference"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BACKENDS:
        capability, path = torch.cuda.get_device_capability(index), "triton"
        if capability < KERNEL_CAPABILITY:
            need, have = ".".join(map(str, KERNEL_CAPABILITY)), ".".join(map(str, capability))
            warnings.warn(
                f"rac: the W4A4 kernels need compute capability {need}+ (this GPU: {have}); the "
                "NVFP4 layers run their references (correct, slow)",
                stacklevel=2,
            )
            path = "reference"
        elif capability >= (10, 0):
            problem = w4a4_blackwell.disagreement(torch.device("cuda", index))  # None: they agree
            if problem:
                warnings.warn(f"rac: {problem}; using the Hopper kernels", stacklevel=2)
            path = "triton" if problem else "native"
        elif w4a4_experts_gluon is not None and not w4a4_quantize.INTERPRET:
            path = "gluon"
        _BACKENDS[index] = path
    return _BACKENDS[index]


def use_triton(x):
    """Do the layers run the kernels on x (a CUDA tensor of a GPU the kernels compile for)?"""
    return backend(x.device) != "reference"


# ===================================================================== input checks (one line each)
def _check_kernel_call(out_dtype=None):
    if triton is None:
        raise RuntimeError(
            "the W4A4 kernels need the `triton` package; use the *_reference functions instead"
        )
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be bfloat16/float16/float32, got {out_dtype}")


def _check_ratio(rac_ratio):
    if not isinstance(rac_ratio, (int, float)) or not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio must be a number in [0, 1], got {rac_ratio!r}")


def _check_mode(mode, rac_ratio, act_scale, modes=MODES):
    if mode not in modes:
        raise ValueError(f"unknown rollout mode {mode!r}; choose one of {list(modes)}")
    if act_scale not in nvfp4.ACT_SCALES:
        raise ValueError(f"act_scale must be one of {list(nvfp4.ACT_SCALES)}, got {act_scale!r}")
    for name, value, default in (("rac_ratio", rac_ratio, 0), ("act_scale", act_scale, "tensor")):
        if value != default and mode not in ACTIVATION_MODES:
            raise ValueError(f"{name}={value!r} concerns NVFP4 activations; mode {mode!r} has none")


def _check_blocks(name, n, label="{} features"):
    if n % BLOCK_SIZE:
        raise ValueError(
            f"{name}: {label.format(n)} is not a multiple of the NVFP4 block size {BLOCK_SIZE}"
        )


def _check_input(x, rac_mask, name, kernel=False):
    if kernel:
        _check_kernel_call()
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a 2-D tensor (M, K), got {shape}")
    if x.dtype not in _FLOATS:
        raise ValueError(
            f"{name}: expected bfloat16/float16/float32 activations, got dtype {x.dtype}"
        )
    _check_blocks(name, x.shape[-1], "K={}")
    G, mask = x.shape[-1] // BLOCK_SIZE, rac_mask
    if mask is not None and not (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.shape == (G,)
        and mask.device == x.device
    ):
        got = (
            f"{mask.dtype} {tuple(mask.shape)} on {mask.device}"
            if isinstance(mask, torch.Tensor)
            else mask
        )
        raise ValueError(
            f"rac_mask must be a bool tensor of shape (G,) = ({G},) on {x.device}, got {got}"
        )


def _check_operands(x_q, w_q, residual, name, stacked=False):
    for label, q, other in (
        ("x_q", x_q, torch.Tensor),
        ("w_q", w_q, ExpertWeights if stacked else NVFP4Tensor),
        ("residual", residual, NVFP4Tensor),
    ):  # x_q: a float tensor in mode w4a16
        if q is not None and not isinstance(q, (NVFP4Tensor, other)):
            raise ValueError(
                f"{name}: {label} must be an NVFP4Tensor or {other.__name__}, "
                f"got {type(q).__name__}"
            )
    if len(x_q.shape) != 2 or len(w_q.shape) != 2 + stacked or x_q.shape[-1] != w_q.shape[-1]:
        raise ValueError(
            f"{name}: expected x_q (M, K) and w_q {'(E, N, K)' if stacked else '(N, K)'}, K "
            f"differs: x_q {x_q.shape} vs w_q {w_q.shape}"
        )
    if (
        x_q.device != w_q.device
        or residual is not None
        and (residual.shape, residual.device) != (x_q.shape, x_q.device)
    ):
        raise ValueError(
            f"{name}: x_q, w_q and residual must be on one device, the residual x_q's shape"
        )
    if residual is not None and not torch.equal(residual.global_scale, x_q.global_scale):
        raise ValueError(f"{name}: the residual must share x_q's global scale")


def _check_row_weights(row_weights, row_weight_ids, n_rows, name):
    weights = None if row_weights is None else tuple(row_weights.shape)
    if row_weight_ids is not None and (weights is None or row_weight_ids.shape != (n_rows,)):
        raise ValueError(
            f"{name}: row_weight_ids must index row_weights with one id per row ({n_rows},), "
            f"got {tuple(row_weight_ids.shape)} and row_weights {weights}"
        )
    if weights is not None and row_weight_ids is None and weights != (n_rows,):
        raise ValueError(
            f"{name}: row_weights must hold one weight per row ({n_rows},), got {weights}"
        )
