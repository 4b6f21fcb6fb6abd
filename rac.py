"""The rollout side: NVFP4 W4A4 layers with residual activation compensation (RAC), and the conversion
of a moe.py model into its rollout twin, weight sync and RAC calibration. The GEMMs they run on, with
their twins, are in w4a4.py.

A rollout layer computes y = x @ W.T, W (N, K), both operands blocked by 16 along K (G = K / 16 blocks):

    W_q = quantize_weight(W)              nvfp4.py's one weight rule: the codes qat.py trains with
    x_q = Q(x)                            NVFP4 with a dynamic global scale amax(|x|) / (6 * 448) per call
    r   = x - DQ(x_q)                     the activation's quantization residual, exact in fp32
    r_q = Q(S * r)                        S keeps whole 16-channel blocks: the round(rac_ratio * G) blocks
                                          with the largest mean |r| (calibrated), zero elsewhere
    y   = DQ(x_q) @ DQ(W_q).T + DQ(r_q) @ DQ(W_q).T  =  (DQ(x_q) + DQ(r_q)) @ DQ(W_q).T

Compensating whole blocks keeps the weight's codes and block scales valid for the residual term: the
GEMM applies both activation terms to the weight tile it already holds, so RAC never re-reads weights.
rac_ratio 0 is naive NVFP4; 1 compensates every block (QUADS uses about 0.5). The residual shares x's
global scale: a residual block is 6-16x smaller than its x block, so its E4M3 block scale still fits.
(w4a4.quantize_activation_reference is these lines in code.)

Why a dynamic global scale: in RL the weights change every step, so a calibrated static activation
scale goes stale between syncs, and anything above it saturates: exactly the outlier channels that
hurt NVFP4 most. The price is that a token's rounding depends on the largest value in its batch.

How to read this file: block selection (RACSelector), the layers (NVFP4Linear, SharedInput for q/k/v,
NVFP4Experts: each runs w4a4.py's Triton path on CUDA and its twin elsewhere), then conversion, sync
and calibration.

An attention's q/k/v_proj read one input: they share one block selection, one quantization and one
GEMM over their stacked weights, each weight's global scale on its own columns (SharedInput).

Shape letters: M rows, K reduction dim, N output features, G = K / 16 blocks, T tokens, A active
experts per token, R = T * A assignments, E experts, D model dim, I expert hidden dim.

Left out: static activation scales, a gate/up-style stacking of q/k/v in the trainer (qat.py keeps
three layers), per-expert RAC block selection (one selection per layer input), FP4 KV caches. The FP8
baseline lives in fp8.py.
"""
import warnings

import torch
import torch.nn as nn

import fp8
import moe
import nvfp4
import w4a4
from nvfp4 import BLOCK_SIZE, NVFP4Tensor

MODES = ("bf16", "fp8", "nvfp4")


# ======================================================================== input checks
def _check_ratio(rac_ratio):
    if not isinstance(rac_ratio, (int, float)) or not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio must be a number in [0, 1], got {rac_ratio!r}")


def _check_features(features, name):
    if features % BLOCK_SIZE:
        raise ValueError(f"{name}: {features} features is not a multiple of the NVFP4 block size "
                         f"{BLOCK_SIZE}")


# ======================================================================== RAC block selection
def block_residual_error(x):
    """Mean |x - DQ(Q(x))| per 16-channel block of x (M, K), with x's dynamic global scale -> (G,) fp32."""
    residual = x.float() - nvfp4.dequantize(nvfp4.quantize(x), torch.float32)          # (M, K)
    return residual.abs().reshape(-1, x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE).mean(dim=(0, 2))


class RACSelector(nn.Module):
    """Which 16-channel blocks of one layer input get residual compensation: the `mask` buffer (G,)
    bool, True on the round(rac_ratio * G) (half up) blocks with the largest mean |x - DQ(Q(x))| over
    the calibration inputs. `calibrate_rac` opens a calibration window (start / finish); a selector
    that was never calibrated calibrates from the first input it sees. Ratio 0 selects nothing."""

    def __init__(self, n_blocks, rac_ratio=0.0, device=None):
        super().__init__()
        self.n_blocks = n_blocks
        self.register_buffer("mask", torch.zeros(n_blocks, dtype=torch.bool, device=device))
        self.register_buffer("error_sum", torch.zeros(n_blocks, dtype=torch.float64, device=device),
                             persistent=False)
        self.set_ratio(rac_ratio)

    def set_ratio(self, rac_ratio):
        _check_ratio(rac_ratio)
        self.rac_ratio = float(rac_ratio)
        self.n_selected = int(self.rac_ratio * self.n_blocks + 0.5)
        self.mask.fill_(self.n_selected == self.n_blocks)
        self.calibrated = self.n_selected in (0, self.n_blocks)   # nothing to choose
        self.calibrating = False

    def start_calibration(self):
        self.error_sum.zero_()
        self.calibrating = True

    def finish_calibration(self):
        self.calibrating, self.calibrated = False, True

    @torch.no_grad()
    def forward(self, x):
        """x (M, K) -> the mask (G,) bool to use now, or None for naive NVFP4."""
        if self.n_selected == 0:
            return None
        if self.calibrating or not self.calibrated:
            self.error_sum += block_residual_error(x).double() * x.shape[0]
            self.mask.zero_()
            self.mask[torch.topk(self.error_sum, self.n_selected).indices] = True
            self.calibrated = self.calibrated or not self.calibrating
        return self.mask

    def extra_repr(self):
        return f"n_blocks={self.n_blocks}, rac_ratio={self.rac_ratio}, n_selected={self.n_selected}"


# ======================================================================== rollout layers
class DequantizedWeight:
    """DQ(W) in fp32 for a layer's twin path (the CPU's), kept while the weight's three buffers are the same
    tensors, unmodified since (their version counters): load_weight and sync_weights write into them, so
    the next call dequantizes again. Without it the twin dequantizes every fixed rollout weight at every
    decode step (a sixth of `python train.py`'s time on a CPU). Costs an fp32 copy of the weights; the
    Triton path never uses it. Inference tensors keep no version counter: those are never kept."""

    def __init__(self):
        self.tensors, self.versions, self.value = (), (), None

    def __call__(self, q):
        tensors = (q.data, q.block_scale, q.global_scale)
        if any(t.is_inference() for t in tensors):
            return nvfp4.dequantize_reference(q, torch.float32)
        versions = tuple(t._version for t in tensors)
        if not (len(self.tensors) == 3 and all(a is b for a, b in zip(tensors, self.tensors))
                and versions == self.versions):
            self.tensors, self.versions = tensors, versions  # held: their memory is not reused meanwhile
            self.value = nvfp4.dequantize_reference(q, torch.float32)
        return self.value


def _quantized_input(x2, rac_mask):
    """What a layer's GEMM takes of x2 (M, K): w4a4.layer_input on the Triton path, else the twin's codes."""
    if w4a4.use_triton(x2):
        return w4a4.layer_input(x2, rac_mask)
    return w4a4.quantize_activation_reference(x2, rac_mask)


class NVFP4Linear(nn.Module):
    """W4A4 replacement for nn.Linear: NVFP4 weights (nvfp4.quantize_weight), activations quantized
    per call, RAC on the blocks its RACSelector picks. `weight_q` is the packed NVFP4Tensor."""

    def __init__(self, in_features, out_features, bias=False, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(in_features, "NVFP4Linear")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_data", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                        device=device))
        self.register_buffer("weight_block_scale", torch.zeros(out_features, in_features // BLOCK_SIZE,
                                                               dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones((), dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
                     if bias else None)
        self.rac = RACSelector(in_features // BLOCK_SIZE, rac_ratio, device=device)
        self.weight_fp32 = DequantizedWeight()  # the twin path's DQ(W)
        self.shared_input = None  # a SharedInput when layers read the same input (convert_for_rollout)

    @property
    def weight_q(self):
        return NVFP4Tensor(self.weight_data, self.weight_block_scale, self.weight_global_scale)

    @classmethod
    def from_float(cls, linear, rac_ratio=0.0):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    rac_ratio=rac_ratio, device=linear.weight.device)
        layer.load_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        """Quantize a master weight (N, K) with nvfp4.quantize_weight, in place (the trainer's rule)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"NVFP4Linear: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        q = nvfp4.quantize_weight(weight.detach())
        self.weight_data.copy_(q.data)
        self.weight_block_scale.copy_(q.block_scale)
        self.weight_global_scale.copy_(q.global_scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        fp8.check_layer_input(x, self.in_features, self.weight_data.device, "NVFP4Linear")
        x2 = x.reshape(-1, self.in_features)                                             # (M, K)
        if self.shared_input is not None:
            y = self.shared_input.output(self, x, x2)
        else:
            rac_mask = self.rac(x2)
            y = self._matmul(x2, rac_mask, _quantized_input(x2, rac_mask))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, x2, rac_mask, act):
        """x2 (M, K) @ DQ(W).T in x2's dtype, on act = _quantized_input(x2, rac_mask)."""
        if w4a4.use_triton(x2):
            return w4a4.layer_matmul(x2, self.weight_q, rac_mask, act, x2.dtype)
        x_q, residual = act                                                              # the twin's codes
        w_q = self.weight_q
        return w4a4.matmul_reference(x_q, w_q, residual, torch.float32, self.weight_fp32(w_q)).to(x2.dtype)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, rac_ratio={self.rac.rac_ratio}"


class SharedInput:
    """One input read by several NVFP4Linear layers (an attention's q_proj, k_proj and v_proj, which share
    one RACSelector). The first layer to read an input computes every layer's output and keeps the
    others' until each has read it once or another input arrives. On the Triton path that is one GEMM:
    the layers' weight buffers are views of one stacked NVFP4 weight (N_q + N_k + N_v rows), each
    weight's global scale applied to its own columns; equal to three GEMMs up to fp32 accumulation order.
    The twin path quantizes x once and runs each layer's own matmul: bit for bit unshared layers.
    Reuse needs the very tensor object, unmodified since (its version counter), so it is always of the
    values the layer would see itself. Inference tensors keep no version counter: each layer then runs
    alone."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.splits = [layer.out_features for layer in self.layers]
        self.input, self.version, self.outputs, self.waiting, self.warned = None, None, None, (), False
        self.weight_q = w4a4.stack_weights([layer.weight_q for layer in self.layers])
        start = 0
        for i, (layer, rows) in enumerate(zip(self.layers, self.splits)):  # the buffers become views of it
            layer.weight_data = self.weight_q.data[start:start + rows]
            layer.weight_block_scale = self.weight_q.block_scale[start:start + rows]
            layer.weight_global_scale = self.weight_q.global_scale[i]
            start += rows
        self.offsets = self._offsets()

    def _offsets(self):
        q = self.weight_q
        return [mine.data_ptr() - stacked.data_ptr() for layer in self.layers
                for mine, stacked in ((layer.weight_data, q.data), (layer.weight_block_scale, q.block_scale),
                                      (layer.weight_global_scale, q.global_scale))]

    def _stacked(self):
        """The stacked weight, or None (and one warning) if a layer's buffers are no longer views of it."""
        if self._offsets() == self.offsets:
            return self.weight_q
        if not self.warned:
            warnings.warn("rac.SharedInput: q/k/v_proj's weights are no longer views of their stacked weight "
                          "(the model moved or a buffer was replaced after convert_for_rollout?): running "
                          "three GEMMs; convert after moving the model to keep one")
            self.warned = True
        return None

    def output(self, layer, x, x2):
        """`layer`'s output on x (x2: x as (M, K)), computed now or kept from the first reader of x."""
        if self.input is x and x._version == self.version and layer in self.waiting:
            self.waiting = tuple(other for other in self.waiting if other is not layer)
            y = self.outputs[self.layers.index(layer)]
            if not self.waiting:  # everyone has read it: keep nothing alive
                self.input = self.outputs = None
            return y
        rac_mask = layer.rac(x2)
        act = _quantized_input(x2, rac_mask)
        if x.is_inference():
            return layer._matmul(x2, rac_mask, act)
        stacked = self._stacked() if w4a4.use_triton(x2) else None
        if stacked is not None:
            outputs = w4a4.layer_matmul(x2, stacked, rac_mask, act, x2.dtype, self.splits)
        else:
            outputs = [other._matmul(x2, rac_mask, act) for other in self.layers]
        self.input, self.version, self.outputs = x, x._version, outputs
        self.waiting = tuple(other for other in self.layers if other is not layer)
        return outputs[self.layers.index(layer)]


class NVFP4Experts(nn.Module):
    """W4A4 replacement for moe.Experts: stacked NVFP4 weights (one global scale per expert, the
    trainer's rule), two grouped GEMMs, RAC on each GEMM's input (one block selection per input)."""

    def __init__(self, n_experts, dim, expert_dim, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(dim, "NVFP4Experts (model dim)")
        _check_features(expert_dim, "NVFP4Experts (expert dim)")
        self.n_experts, self.dim, self.expert_dim = n_experts, dim, expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):
            self.register_buffer(f"{name}_data", torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_block_scale",
                                 torch.zeros(E, N, K // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_global_scale", torch.ones(E, dtype=torch.float32, device=device))
        self.rac_gate_up = RACSelector(D // BLOCK_SIZE, rac_ratio, device=device)
        self.rac_down = RACSelector(I // BLOCK_SIZE, rac_ratio, device=device)
        self.gate_up_fp32, self.down_fp32 = DequantizedWeight(), DequantizedWeight()  # the twin path's

    @property
    def gate_up_q(self):
        return NVFP4Tensor(self.gate_up_data, self.gate_up_block_scale, self.gate_up_global_scale)

    @property
    def down_q(self):
        return NVFP4Tensor(self.down_data, self.down_block_scale, self.down_global_scale)

    @classmethod
    def from_float(cls, experts, rac_ratio=0.0):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, rac_ratio, device=experts.gate_up_proj.device)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        """Quantize the master stacks with nvfp4.quantize_weight (per-expert global scales), in place."""
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            target = getattr(self, f"{name}_data")
            if tuple(w.shape) != (*target.shape[:-1], target.shape[-1] * 2):
                raise ValueError(f"NVFP4Experts: {name} weight shape {tuple(w.shape)} does not match "
                                 f"{(*target.shape[:-1], target.shape[-1] * 2)}")
            q = nvfp4.quantize_weight(w.detach())
            target.copy_(q.data)
            getattr(self, f"{name}_block_scale").copy_(q.block_scale)
            getattr(self, f"{name}_global_scale").copy_(q.global_scale)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) -> (T, D) in x.dtype, as moe.Experts."""
        fp8.check_layer_input(x, self.dim, self.gate_up_data.device, "NVFP4Experts")
        T, A = expert_ids.shape
        routing = moe.route_tokens(expert_ids, self.n_experts)
        row_weights = expert_weights.reshape(-1)[routing.order].float()                  # (R,)
        forward = self._forward_triton if w4a4.use_triton(x) else self._forward_reference
        y_sorted = forward(x, routing, row_weights)                                      # (R, D), weighted
        return y_sorted[routing.inverse_order].view(T, A, -1).sum(dim=1).to(x.dtype)

    def _forward_triton(self, x, routing, row_weights):
        native = w4a4.gemm_backend(x.device) == "native"  # codes for tl.dot_scaled, else the fp16 operand
        act = w4a4.quantize_activation_triton(x, self.rac_gate_up(x), codes=native, operand=not native)
        hidden = w4a4.grouped_matmul_triton(act, self.gate_up_q, routing.counts, row_ids=routing.token_ids,
                                            swiglu=True, out_dtype=x.dtype)              # (R, I)
        act = w4a4.quantize_activation_triton(hidden, self.rac_down(hidden), codes=native,
                                              operand=not native)
        return w4a4.grouped_matmul_triton(act, self.down_q, routing.counts, row_weights=row_weights,
                                          out_dtype=x.dtype)                             # (R, D)

    def _forward_reference(self, x, routing, row_weights):
        """The twin: the same quantization steps, dequantized, a loop of fp32 matmuls over experts."""
        gate_up_q, down_q = self.gate_up_q, self.down_q
        x_q, residual = w4a4.quantize_activation_reference(x, self.rac_gate_up(x))
        hidden = w4a4.grouped_matmul_reference(x_q, gate_up_q, routing.counts, residual,
                                               row_ids=routing.token_ids, swiglu=True, out_dtype=x.dtype,
                                               w=self.gate_up_fp32(gate_up_q))
        h_q, residual = w4a4.quantize_activation_reference(hidden, self.rac_down(hidden))
        return w4a4.grouped_matmul_reference(h_q, down_q, routing.counts, residual, row_weights=row_weights,
                                             out_dtype=torch.float32, w=self.down_fp32(down_q))

    def extra_repr(self):
        return (f"n_experts={self.n_experts}, dim={self.dim}, expert_dim={self.expert_dim}, "
                f"rac_ratio={self.rac_gate_up.rac_ratio}")


# ======================================================================== conversion, sync, calibration
def convert_for_rollout(model, mode, rac_ratio=0.0, quantize_router=False, quantize_lm_head=False):
    """Swap a moe.py model's layers for rollout layers in place; returns the model.

    mode "bf16": unchanged. "fp8": W8A8 (fp8.FP8Linear, fp8.FP8Experts). "nvfp4": W4A4 (NVFP4Linear,
    NVFP4Experts) with residual compensation on round(rac_ratio * G) blocks of each layer input.
    Converted: every moe.Attention's nn.Linear projections and every moe.Experts (a qat.py model's
    layers subclass those, so it converts too); with the flags also the routers and the LM head. An
    attention's q/k/v_proj read one input: in nvfp4 mode they share its selection, its quantization and
    one GEMM (SharedInput).
    Embeddings and norms stay in full precision. The weights are quantized from the model's own.
    """
    if mode not in MODES:
        raise ValueError(f"unknown rollout mode {mode!r}; choose one of {list(MODES)}")
    _check_ratio(rac_ratio)
    if rac_ratio > 0 and mode != "nvfp4":
        raise ValueError(f"rac_ratio={rac_ratio} compensates NVFP4 activations; mode {mode!r} has none")
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        experts = isinstance(child, moe.Experts)
        if mode == "nvfp4":
            new = (NVFP4Experts if experts else NVFP4Linear).from_float(child, rac_ratio)
        else:
            new = (fp8.FP8Experts if experts else fp8.FP8Linear).from_float(child)
        setattr(parent, name, new)
    for attention in model.modules():
        layers = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if isinstance(attention, moe.Attention) and all(isinstance(m, NVFP4Linear) for m in layers):
            shared = SharedInput(layers)  # one input x: one block selection, quantization and GEMM
            for layer in layers:
                layer.rac, layer.shared_input = layers[0].rac, shared
    return model


_QUANTIZED_LAYERS = (NVFP4Linear, NVFP4Experts, fp8.FP8Linear, fp8.FP8Experts)


@torch.no_grad()
def sync_weights(rollout_model, trainer_model):
    """Reload every rollout weight in place from the trainer's master weights.

    Quantized layers re-quantize the trainer's `weight` / `gate_up_proj` / `down_proj` (NVFP4 through
    nvfp4.quantize_weight, the function qat.py's fake quantization uses, so the rollout's codes are
    the trainer's QAT weights bit for bit; FP8 through its per-channel rule). Everything else in full
    precision (embeddings, norms, routers, LM head, bf16-mode layers) is copied by parameter name.
    The RAC block selection is left alone: call calibrate_rac when it should be refreshed.
    """
    params = dict(trainer_model.named_parameters(remove_duplicate=False))

    def master(path, name):
        key = f"{path}.{name}" if path else name
        if key not in params:
            raise ValueError(f"sync_weights: the trainer model has no parameter {key!r} "
                             f"(rollout layer {path!r})")
        return params[key]

    quantized = set()
    for path, module in rollout_model.named_modules():
        if isinstance(module, (NVFP4Linear, fp8.FP8Linear)):
            module.load_weight(master(path, "weight"),
                               master(path, "bias") if module.bias is not None else None)
        elif isinstance(module, (NVFP4Experts, fp8.FP8Experts)):
            module.load_weights(master(path, "gate_up_proj"), master(path, "down_proj"))
        if isinstance(module, _QUANTIZED_LAYERS):
            quantized.add(path)
    for name, param in rollout_model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        if path not in quantized:  # a quantized layer's bias was loaded above
            param.copy_(master(path, leaf))


@torch.no_grad()
def calibrate_rac(rollout_model, tokens):
    """Choose each NVFP4 layer input's compensated blocks from one forward pass on `tokens` (B, T).

    Each selector sees the activations its layer actually receives (upstream layers already run with
    their fresh selection) and keeps the blocks with the largest mean |x - DQ(Q(x))|. Call it after
    sync_weights, or every N steps: the caller decides. A selector's ratio is its own (RACSelector.set_ratio
    changes it). Returns the model.
    """
    selectors = [m for m in rollout_model.modules() if isinstance(m, RACSelector)]
    for selector in selectors:
        selector.start_calibration()
    try:
        rollout_model(tokens)
    finally:
        for selector in selectors:
            selector.finish_calibration()
    return rollout_model
