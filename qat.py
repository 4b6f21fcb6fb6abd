"""Trainer side: quantization-aware training with NVFP4 weights and a straight-through gradient.

The rollout runs NVFP4 W4A4. If the trainer runs plain BF16, the two compute different functions and
their log-probs of the same tokens drift apart. The asymmetric recipe (QUADS) removes the weight half
of that difference: the trainer's forward uses the weights *as the rollout will see them*,

    Wq = fake_quantize_weight(W) = dequantize(quantize_weight(W))     nvfp4.py's one weight rule

bit for bit the values rac.py loads (sync_weights quantizes the same master W with the same function),
while activations stay BF16 (W4A16 in training, W4A4 in rollout). The gradient is straight-through:
dWq/dW is taken as the identity, so the optimizer updates the BF16/fp32 master weight W.

    forward   y      = x @ Wq.T
    backward  grad_x = grad_y @ Wq           the quantized weight, as the forward used
              grad_W = grad_y.T @ x          applied to the master W (straight-through)

Modes (`convert_for_training(model, mode)`):
- `bf16`: no change.
- `qat`:  the asymmetric recipe above, for the attention projections q/k/v/o and the experts.
- `w4a4`: the symmetric alternative, for comparison: the layer inputs are fake-quantized too,
  with a dynamic per-tensor global scale, amax(|x|) / (6 * 448), and a straight-through gradient.
  With `rac_ratio > 0` it mimics the rollout's residual compensation: r = x - fq(x), and on the
  rac_ratio * G (rounded half up) 16-channel blocks with the largest mean |r| over the batch, fq(r) is added
  back (r of those blocks has its own dynamic global scale). Unlike rac.py, which appends fq(r) along
  K inside one GEMM with fp32 accumulation and uses blocks calibrated once, this sums fq(x) + fq(r)
  in fp32, rounds the sum once to the activation dtype, and reselects the blocks every forward.
  QUADS reports that this symmetric recipe gives a *larger* train/rollout mismatch than `qat`.
The router, embeddings, norms and LM head stay in full precision (the router and the LM head can be
quantized too: `quantize_router`, `quantize_lm_head`; embeddings and norms never are).

The quantized modules subclass the ones they replace (`QATLinear(nn.Linear)`, `QATExperts(moe.Experts)`)
and keep the *same* Parameter objects under the same names (`weight`; `gate_up_proj`, `down_proj`):
state dicts, an optimizer built before conversion, and rac.sync_weights all keep working.
`bf16_forward(model)` switches every QAT layer back to plain full-precision computation for a while
(e.g. to evaluate the BF16 policy of a QAT-trained model).

Caching. Weights change only when the optimizer steps, so each layer keeps its fake-quantized weight
and recomputes it only when the master weight may have changed: the cache key is the parameter's
version counter (bumped by every in-place write through the parameter: optimizer updates, load_state_dict,
copy_ under no_grad), its data pointer (a replaced tensor, model.to()), its dtype, and a count of
optimizer steps (a global `torch.optim` step hook: the fused Adam/AdamW kernels update parameters in
place *without* bumping their version counter). Writes through `param.data` bypass all of these;
call `clear_weight_cache(model)` after such a write. The cache costs one extra copy of the quantized
weights in the parameter dtype.

On CUDA the fake quantization runs nvfp4.py's fused Triton kernel (nvfp4 picks it by device).

Shape letters: T tokens (all leading dims flattened), K in-features, N out-features, G = K / 16 blocks,
E experts, A active experts per token, D model dim, I expert hidden dim, R = T*A (token, expert) rows.

Deliberately left out: quantized gradients (the backward GEMMs run in the activation dtype, as in
QUADS' W4A16 training), TRACE's rollout-guided rounding, learned or per-channel scales, autocast (cast
the model to BF16 instead), and torch.compile of the cache check (it reads Python-side state).
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

import moe
import nvfp4

MODES = ("bf16", "qat", "w4a4")


# ----------------------------------------------------------------------------- the weight cache
class WeightCache:
    """fake_quantize_weight(w), recomputed only when w may have changed (see the module docstring)."""

    optimizer_steps = 0  # every torch.optim step anywhere increments it (hook registered below)

    def __init__(self):
        self.key, self.value = None, None

    def get(self, weight):
        key = (weight._version, weight.data_ptr(), weight.device, weight.dtype, WeightCache.optimizer_steps)
        if key != self.key:
            # A fresh tensor each time, never written in place: a backward still pending holds the old one.
            # Outside inference mode, so that a cache filled under torch.inference_mode can later be
            # saved for backward.
            with torch.inference_mode(False), torch.no_grad():
                self.value = nvfp4.fake_quantize_weight(weight.detach())
            self.key = key
        return self.value

    def clear(self):
        self.key, self.value = None, None


def _count_optimizer_step(optimizer, args, kwargs):
    WeightCache.optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


# ----------------------------------------------------------------------------- autograd
class QATLinearFunction(torch.autograd.Function):
    """y = x @ Wq.T with a straight-through gradient to the master weight W.

    Operands:
        x   (..., K)  the layer input as the forward sees it: BF16 activations in `qat` (W4A16), or
                      activations already fake-quantized to NVFP4 by the caller in `w4a4` (W4A4)
        W   (N, K)    the master weight (BF16 or fp32), only a recipient of the gradient here
        Wq  (N, K)    fake_quantize_weight(W): NVFP4 values (E2M1 code * E4M3 block scale * per-tensor
                      global scale) stored in W's dtype, computed once per optimizer step by the caller

    GEMMs:
        forward   y      = x @ Wq.T                     (T, N)   the weight quantized, x as given
        backward  grad_x = grad_y @ Wq                  (T, K)   the same quantized weight the forward used
                  grad_W = grad_y.T @ x                 (N, K)   straight-through (dWq/dW := I): this is the
                                                                 gradient w.r.t. Wq, applied to the master W
    grad_y is not quantized, so both backward GEMMs run in the activation dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, weight_q):
        if torch.is_autocast_enabled(x.device.type):  # compute as autocast's F.linear would, saved as used
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight_q = x.to(dtype), weight_q.to(dtype)
        ctx.save_for_backward(x, weight_q)
        ctx.weight_dtype = weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight_q)                                               # (..., N)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight_q = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y @ weight_q                                                 # (..., K)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (N, K)
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_x, grad_weight, None


class _StraightThrough(torch.autograd.Function):
    """Forward: `value` (computed without autograd from `source`). Backward: the identity to `source`."""

    @staticmethod
    def forward(ctx, source, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(source, value):
    """`value` in the forward, with d value / d source taken as the identity in the backward."""
    return _StraightThrough.apply(source, value)


# ----------------------------------------------------------------------------- activations (w4a4)
def fake_quantize_activation(x, rac_ratio=0.0):
    """The `w4a4` recipe's activation rule, with a straight-through gradient to x (..., K).

    fq(x) with a dynamic per-tensor global scale. With rac_ratio > 0, the residual r = x - fq(x) of the
    rac_ratio * G channel blocks (rounded half up) with the largest mean |r| over all tokens is
    fake-quantized (with its own per-tensor global scale) and added: x_eff = fq(x) + fq(r[blocks]).
    """
    with torch.no_grad():
        x_q = nvfp4.fake_quantize(x.detach())                                          # (..., K)
        n_groups = x.shape[-1] // nvfp4.BLOCK_SIZE                                     # G
        n_compensated = int(rac_ratio * n_groups + 0.5)
        if n_compensated > 0:
            residual = x.float() - x_q.float()                                         # exact in fp32
            block_error = residual.abs().reshape(-1, n_groups, nvfp4.BLOCK_SIZE).mean(dim=(0, 2))  # (G,)
            blocks = block_error.topk(n_compensated).indices
            columns = (blocks[:, None] * nvfp4.BLOCK_SIZE
                       + torch.arange(nvfp4.BLOCK_SIZE, device=x.device)).flatten()    # (16 * n_compensated,)
            compensation = nvfp4.fake_quantize(residual.index_select(-1, columns))
            # summed in fp32, rounded once to x's dtype
            x_q = x_q.float().index_add_(-1, columns, compensation).to(x.dtype)
    return straight_through(x, x_q)


def _check_settings(mode, rac_ratio, layer=False):
    if layer and mode == "bf16":
        raise ValueError("a QAT layer's mode is 'qat' or 'w4a4'; use bf16_forward for full precision")
    if mode not in MODES:
        raise ValueError(f"unknown QAT mode {mode!r}; choose one of {list(MODES)}")
    if not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio must be in [0, 1], got {rac_ratio}")
    if rac_ratio > 0 and mode != "w4a4":
        raise ValueError(f"rac_ratio={rac_ratio} compensates quantized activations, which only the 'w4a4' "
                         f"mode has; mode {mode!r} keeps activations in full precision")


# ----------------------------------------------------------------------------- dense layers
class QATLinear(nn.Linear):
    """nn.Linear whose forward uses the NVFP4 fake-quantized weight (straight-through to `weight`).

    mode "qat": y = x @ fq(W).T; mode "w4a4": y = fq_act(x) @ fq(W).T. `fake_quant=False` (see
    bf16_forward) makes it a plain nn.Linear again. The bias, if any, stays in full precision.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, mode="qat", rac_ratio=0.0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.configure(mode, rac_ratio)
        self.fake_quant = True
        self.weight_cache = WeightCache()

    def configure(self, mode, rac_ratio=0.0):
        _check_settings(mode, rac_ratio, layer=True)
        self.mode, self.rac_ratio = mode, rac_ratio

    def clear_cache(self):
        self.weight_cache.clear()

    @classmethod
    def from_float(cls, linear, mode="qat", rac_ratio=0.0):
        """A QATLinear holding `linear`'s own Parameter objects (an existing optimizer keeps working)."""
        qat = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  mode=mode, rac_ratio=rac_ratio)
        qat.weight, qat.bias = linear.weight, linear.bias
        return qat.train(linear.training)

    def quantized_weight(self):
        """fq(W): the weight the forward uses, (N, K) in the weight's dtype, no autograd (cached)."""
        return self.weight_cache.get(self.weight)

    def forward(self, x):
        if not self.fake_quant:
            return super().forward(x)
        if self.mode == "w4a4":
            x = fake_quantize_activation(x, self.rac_ratio)
        y = QATLinearFunction.apply(x, self.weight, self.quantized_weight())         # (..., N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"{super().extra_repr()}, mode={self.mode}, rac_ratio={self.rac_ratio}, fake_quant={self.fake_quant}"


# ----------------------------------------------------------------------------- experts
def _grouped_linear(x_sorted, routing, weight, grouped):
    """x_sorted (R, K) grouped by expert, weight (E, N, K) -> (R, N): rows of expert e times weight[e].T."""
    if grouped:
        return torch._grouped_mm(x_sorted, weight.transpose(-2, -1), offs=routing.offsets)
    outputs, start, weights = [], 0, weight.unbind(0)  # unbind: one gradient buffer, not one per expert
    for e, n in enumerate(routing.counts.tolist()):  # the slow twin: one host sync, a loop over experts
        outputs.append(F.linear(x_sorted[start:start + n], weights[e]))
        start += n
    return torch.cat(outputs)


class QATExperts(moe.Experts):
    """moe.Experts computing with fake-quantized stacked weights (one global scale per expert).

    The weights enter moe.py's own expert path through a straight-through function, so per expert e
    (rows x_e of the tokens routed to it) autograd runs exactly the GEMMs of QATLinearFunction:

        forward   h_e = x_e @ fq(Wgu_e).T      (R_e, 2I)     y_e = (silu(gate) * up) @ fq(Wd_e).T   (R_e, D)
        backward  grad_x_e = grad_h_e @ fq(Wgu_e),  grad_Wgu_e = grad_h_e.T @ x_e  -> master gate_up_proj[e]
                  (and likewise for down_proj with input silu(gate) * up)

    On CUDA in BF16 these are moe.py's torch._grouped_mm calls, elsewhere its per-expert loop.
    In `w4a4` mode the inputs of both GEMMs (x and silu(gate) * up) are fake-quantized as well,
    each with one dynamic global scale over all R rows.
    """

    def configure(self, mode, rac_ratio=0.0):
        _check_settings(mode, rac_ratio, layer=True)
        self.mode, self.rac_ratio = mode, rac_ratio

    def clear_cache(self):
        self.gate_up_cache.clear()
        self.down_cache.clear()

    @classmethod
    def from_float(cls, experts, mode="qat", rac_ratio=0.0):
        """A QATExperts holding `experts`' own Parameter objects (an existing optimizer keeps working)."""
        qat = cls.__new__(cls)
        nn.Module.__init__(qat)
        for name, value in vars(experts).items():  # plain attributes such as n_experts
            if not name.startswith("_") and name != "training":
                setattr(qat, name, value)
        for name, param in experts.named_parameters(recurse=False):
            setattr(qat, name, param)
        qat.configure(mode, rac_ratio)
        qat.fake_quant = True
        qat.gate_up_cache, qat.down_cache = WeightCache(), WeightCache()
        return qat.train(experts.training)

    def quantized_weights(self):
        """(fq(gate_up_proj) (E, 2I, D), fq(down_proj) (E, D, I)), no autograd (cached)."""
        return self.gate_up_cache.get(self.gate_up_proj), self.down_cache.get(self.down_proj)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D), as moe.Experts."""
        if not self.fake_quant:
            return super().forward(x, expert_ids, expert_weights)
        gate_up_q, down_q = self.quantized_weights()
        gate_up = straight_through(self.gate_up_proj, gate_up_q)                      # (E, 2I, D)
        down = straight_through(self.down_proj, down_q)                               # (E, D, I)
        routing = moe.route_tokens(expert_ids, self.n_experts)
        x_sorted, gate_up, down = moe.expert_operands(x[routing.token_ids], gate_up, down)  # (R, D)
        grouped = moe.use_grouped_mm(x_sorted, self.down_proj.shape[-1])
        if self.mode == "qat":  # moe.py's own path, only the weights swapped
            if grouped:
                y_sorted = moe.expert_swiglu_grouped(x_sorted, routing.offsets, gate_up, down)
            else:
                y_sorted = moe.expert_swiglu_loop(x_sorted, routing.counts, gate_up, down)
        else:  # w4a4: the same two GEMMs with a fake-quantized input each
            h = _grouped_linear(fake_quantize_activation(x_sorted, self.rac_ratio), routing, gate_up, grouped)
            gate, up = h.chunk(2, dim=-1)                                             # (R, I) each
            hidden = fake_quantize_activation(F.silu(gate) * up, self.rac_ratio)
            y_sorted = _grouped_linear(hidden, routing, down, grouped)                # (R, D)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)

    def extra_repr(self):
        return f"mode={self.mode}, rac_ratio={self.rac_ratio}, fake_quant={self.fake_quant}"


# ----------------------------------------------------------------------------- conversion
def _qat_layers(model):
    return [m for m in model.modules() if isinstance(m, (QATLinear, QATExperts))]


def convert_for_training(model, mode, rac_ratio=0.0, quantize_router=False, quantize_lm_head=False):
    """Swap moe.py's layers for QAT layers in place and return the model.

    mode: "bf16" (no change), "qat" (NVFP4 weights, full-precision activations) or "w4a4" (NVFP4
    weights and activations; rac_ratio in [0, 1] adds residual compensation on that fraction of blocks).
    Converted: every moe.Attention's nn.Linear projections and every moe.Experts; with the flags, the
    routers (moe.MoEBlock's nn.Linear) and the LM head (moe.MoETransformer's nn.Linear). Layers already
    converted are reconfigured to the new mode. Parameters are reused, not copied, so an optimizer
    created before the conversion still updates the weights the QAT layers use.
    """
    _check_settings(mode, rac_ratio)
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, (QATLinear, QATExperts)):
            child.configure(mode, rac_ratio)
        elif isinstance(child, moe.Experts):
            setattr(parent, name, QATExperts.from_float(child, mode, rac_ratio))
        else:
            setattr(parent, name, QATLinear.from_float(child, mode, rac_ratio))
    return model


@contextlib.contextmanager
def bf16_forward(model):
    """Within the block every QAT layer of `model` computes in plain full precision (its master
    weights, unquantized activations): the exact outputs of the unconverted model. Restored on exit."""
    layers = _qat_layers(model)
    previous = [layer.fake_quant for layer in layers]
    for layer in layers:
        layer.fake_quant = False
    try:
        yield model
    finally:
        for layer, fake_quant in zip(layers, previous):
            layer.fake_quant = fake_quant


def clear_weight_cache(model):
    """Forget every cached fake-quantized weight (needed only after writes through `param.data`)."""
    for layer in _qat_layers(model):
        layer.clear_cache()
