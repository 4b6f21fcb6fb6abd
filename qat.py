"""Trainer side: asymmetric quantization-aware training (QAT), NVFP4 weights and BF16 activations.

The rollout (rac.py) runs NVFP4 W4A4. A plain BF16 trainer computes another function, so the
log-probs of the same tokens drift apart between the two sides. Asymmetric QAT removes the weight
half of that difference: the trainer's forward multiplies by the weight *as the rollout will hold
it*, while its activations stay BF16,

    Wq = nvfp4.fake_quantize_weight(W) = DQ(quantize_weight(W))   bit for bit what rac.py loads
    forward   y      = x @ Wq.T
    backward  grad_x = grad_y @ Wq          the quantized weight, as the forward used it
              grad_W = grad_y.T @ x         to the master W: straight-through, d Wq / d W = identity

The master weights stay FP32 (the optimizer's); only the forward sees Wq. The straight-through
estimator is a custom autograd function whose forward returns the quantized value and whose backward
passes the gradient unchanged to the master weight. The rollout's weight sync (rac.sync_weights)
quantizes the same master weights with the same rule (nvfp4.quantize_weight), so after every step
both sides hold bit-identical FP4 weights and what still differs is the activations' rounding, which
RAC attacks on the rollout side. QUADS is this trainer with a RAC rollout.

Converted (convert_for_training): moe.Attention's projections (QATLinear) and moe.Experts
(QATExperts, one global scale per expert), optionally the routers and the LM head; the embeddings
and norms stay in full precision. The quantized layers subclass the ones they replace and keep the
*same* Parameter objects, so state dicts, an optimizer built before conversion and rac.sync_weights
keep working. Each layer fake-quantizes its weights inside its own forward (all of a layer's
matrices from one amax launch: fake_quantize_weights), so a sharded trainer (FSDP2 per block)
quantizes each block's weights while they are gathered. Under autocast the forward's GEMMs run in
BF16 like the rest.

The competing *symmetric* recipes, which fake-quantize the trainer's activations as well (W4A4, and
MoEResQ's and TRACE's refinements of it), build on these layers: symmetric.py, read next.

Shape letters: T tokens, K in-features, N out-features, E experts, A active experts, D model dim,
I expert hidden dim, R = T * A (token, expert) rows.
Left out: quantized gradients (the backward GEMMs run in the activation dtype, as in QUADS' W4A16
training), learned or per-channel scales.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe
import nvfp4


# ----------------------------------------------------------------------------- straight-through
class _StraightThrough(torch.autograd.Function):
    """Forward: `value` (computed without autograd from `source`). Backward: the identity to
    `source`."""

    @staticmethod
    def forward(ctx, source, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(source, value):
    """`value` in the forward; in the backward its gradient goes to `source` unchanged."""
    return _StraightThrough.apply(source, value)


def fake_quantize_weights(weights):
    """[nvfp4.fake_quantize_weight(w) for w in weights], bit for bit, each straight-through to w.

    A stack of expert weights (E, N, K) gets one global scale per expert, as the rollout's. All
    global scales come from one multi-tensor amax (torch._foreach_norm with p = inf, exact: it is a
    max) rather than one small launch per matrix, which dominated a QAT step on the GPU."""
    with torch.no_grad():
        matrices = []
        for w in weights:
            if w.dim() >= 3:
                matrices.extend(w.detach().unbind(0))
            else:
                matrices.append(w.detach())
        amax = torch.stack(torch._foreach_norm(matrices, float("inf"))).float()
        scales = nvfp4.compute_global_scale(amax.view(-1, 1, 1), per_matrix=True)  # nvfp4's rule
        counts = [w.shape[0] if w.dim() >= 3 else 1 for w in weights]
        scales = scales.split(counts)
    quantized = []
    for w, scale in zip(weights, scales):
        quantized.append(nvfp4.fake_quantize(w, scale.reshape(w.shape[:-2])))
    return quantized


# ----------------------------------------------------------------------------- dense layers
class QATLinear(nn.Linear):
    """nn.Linear whose forward uses the NVFP4 fake-quantized weight, straight-through to `weight`:
    y = x @ fq(W).T (+ bias, in full precision)."""

    @classmethod
    def from_float(cls, linear):
        """A QATLinear holding `linear`'s own Parameter objects (an existing optimizer keeps
        working)."""
        has_bias = linear.bias is not None
        layer = cls(linear.in_features, linear.out_features, bias=has_bias, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer.train(linear.training)

    def master_weights(self):
        return (self.weight,)

    def forward(self, x):
        (weight,) = fake_quantize_weights(self.master_weights())
        y = F.linear(x, weight)  # (..., N)
        if self.bias is not None:
            y = y + self.bias
        return y


# ----------------------------------------------------------------------------- experts
class QATExperts(moe.Experts):
    """moe.Experts computing with fake-quantized stacked weights (one global scale per expert).

    The quantized weights enter moe.py's own expert path, so per expert e (rows x_e of the tokens
    routed to it) autograd runs:

        forward   h_e = x_e @ fq(Wgu_e).T                  (R_e, 2I)
                  y_e = (silu(gate) * up) @ fq(Wd_e).T     (R_e, D)
        backward  grad_x_e = grad_h_e @ fq(Wgu_e)
                  grad_Wgu_e = grad_h_e.T @ x_e  -> the master gate_up_proj[e]
                  (likewise down_proj, whose input is silu(gate) * up)

    On CUDA in BF16 these are torch._grouped_mm calls, elsewhere a loop over experts."""

    @classmethod
    def from_float(cls, experts):
        """A QATExperts holding `experts`' own Parameter objects (an existing optimizer keeps
        working)."""
        return moe.same_state_as(cls, experts)

    def master_weights(self):
        return (self.gate_up_proj, self.down_proj)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D), as
        moe.Experts."""
        gate_up, down = fake_quantize_weights(self.master_weights())  # (E, 2I, D), (E, D, I)
        routing = moe.route_tokens(expert_ids, self.n_experts)
        x_sorted = x[routing.token_ids]  # (R, D)
        x_sorted, gate_up, down = moe.expert_operands(x_sorted, gate_up, down)
        if moe.use_grouped_mm(x_sorted, down.shape[-1]):
            y_sorted = moe.expert_swiglu_grouped(x_sorted, routing.offsets, gate_up, down)
        else:
            y_sorted = moe.expert_swiglu_loop(x_sorted, routing.counts, gate_up, down)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)  # (T, D)


# ----------------------------------------------------------------------------- conversion
def convert_for_training(model, *, quantize_router=False, quantize_lm_head=False):
    """Swap moe.py's layers for QAT layers in place; returns the model. Converted: moe.Attention's
    projections and moe.Experts; with the flags the routers and the LM head. Parameters are reused,
    not copied (an existing optimizer keeps working). Layers already converted are left as they
    are."""
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, (QATLinear, QATExperts)):
            continue
        if isinstance(child, moe.Experts):
            setattr(parent, name, QATExperts.from_float(child))
        else:
            setattr(parent, name, QATLinear.from_float(child))
    return model


@torch.no_grad()
def quantized_weights(layer):
    """What a QAT layer's forward uses, without autograd: (fq(W),), or (fq(gate_up_proj),
    fq(down_proj))."""
    return tuple(nvfp4.fake_quantize_weight(w.detach()) for w in layer.master_weights())
