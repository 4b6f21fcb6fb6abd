"""Trainer side: quantization-aware training with NVFP4 weights and a straight-through gradient, and the
symmetric recipes that quantize the trainer's activations too.

The rollout runs NVFP4 W4A4. If the trainer runs plain BF16, the two compute different functions and
their log-probs of the same tokens drift apart. The asymmetric recipe (QUADS) removes the weight half
of that difference: the trainer's forward uses the weights *as the rollout will see them*,

    Wq = fake_quantize_weight(W) = dequantize(quantize_weight(W))     nvfp4.py's one weight rule

bit for bit the values rac.py loads (sync_weights quantizes the same master W with the same function),
while activations stay BF16 (W4A16 in training, W4A4 in rollout). The gradient is straight-through:
dWq/dW is taken as the identity, so the optimizer updates the BF16/fp32 master weight W.

    forward   y      = x_eff @ Wq.T              x_eff = x (qat), or x's fake-quantized form (below)
    backward  grad_x = grad_y @ Wq               the quantized weight, as the forward used
              grad_W = grad_y.T @ x_eff          applied to the master W (straight-through)

Wq is computed afresh at every forward of the model, for all its layers together (`fake_quantize_weights`:
one multi-tensor amax, nvfp4's global-scale rule applied once, then one fused kernel per weight); the
training loop runs one forward per optimizer step, so there is nothing a cache could reuse. Layers that
read one input with the same settings (q, k, v) quantize it once per forward.

Modes (`convert_for_training(model, mode)`), for the attention projections q/k/v/o and the experts:
- `bf16`: no change.
- `qat`:  the asymmetric recipe above.
- `w4a4`: the symmetric alternative: every layer input is fake-quantized as the rollout quantizes it,
  fq(x) with a dynamic per-tensor global scale amax(|x|) / (6 * 448), straight-through to x.
  QUADS reports that this gives a *larger* train/rollout mismatch than `qat`.
- `moeresq`: symmetric recovery (MoEResQ): `w4a4` plus exactly the rollout's residual compensation,
      x_q = Q(x),  r = x - DQ(x_q),  x_eff = DQ(x_q) + DQ(Q(S * r))       S = the rollout's block mask
  with r quantized at x's global scale, as rac.py does. The mask is not chosen here: `rac_masks` holds
  the rollout's own RACSelector mask tensors (train.py hands them over), so both sides compensate the
  same blocks and a recalibration of the rollout is the trainer's too. On the same input, a moeresq layer
  computes what the rollout layer's torch twin computes, up to fp32 accumulation order (tested).
- `trace`: rollout-guided rounding (TRACE): `w4a4`, except that where the rollout recorded what it
  used for a row (`rollout_codes`: its codes, block scales and global scale), each element takes the
  rollout's value when x lies within one E2M1 step of it on the rollout's grid, else its own rounding:
      s = x / (block_scale_r * global_scale_r)           x in units of the rollout's block grid
      lo, hi = the E2M1 grid points just below and just above s (both = s on a grid point, +-6 beyond)
      x_eff = value_r            where value_r / unit_r is lo or hi        the rollout's decision
              fq(x)              elsewhere (and on rows the rollout did not record)
  So a value that the two sides see on either side of a rounding midpoint rounds the rollout's way;
  one that moved by more than a grid step keeps the trainer's own rounding. What TRACE's paper leaves
  unsaid (its text was not available to us) was chosen here: the rollout's block scales are used where
  its code is taken (the trainer's value is then exactly the rollout's), the grid test is done in fp32,
  and blocks the rollout stored as zero blocks (scale 0) fall back to the trainer's own rounding.
The router, embeddings, norms and LM head stay in full precision (the router and the LM head can be
quantized too: `quantize_router`, `quantize_lm_head`; embeddings and norms never are).

Recording for `trace` (RolloutRecorder): the rollout's quantized layers are fed by hooks that train.py
registers; each decode step the recorder re-quantizes every quantized layer input with nvfp4.quantize
(the rollout's own rule, so the same codes) and keeps them; after the rollout it keeps only the
completion tokens (the ones trained on) and keys them by the trainer's (row, column) position, and for
the experts' down projection by (position, expert): that input exists only for the experts the rollout
chose, so a (token, expert) pair that only the trainer routes to keeps its own rounding (a forward on a
mini-batch of the sequences takes `RolloutCodes.select_rows`, via `use_rollout_codes(..., rows)`).
Prompt tokens are not recorded (they come from the prefill): the trainer rounds them itself. Memory per
completion token and layer input of width K: K/2 bytes of codes + K/16 of block scales + 4 (fp32 global
scale) + 8 (int64 key); the down projection has A such rows per token, and q, k and v share one record.
Per token and layer: 240 B on the tiny preset (D = I = 64, A = 2), 1.5 KB on the small one (D = 512,
I = 256, A = 4; 12 KB over its 8 layers). During the rollout every decode step is kept for all N rows
(finished ones too) until the completion tokens are picked out, so the peak is N * max_new_tokens times
that (small preset, 256 rows x 128 tokens: 400 MB); everything is freed after the optimizer step. Hooks
do not run when a CUDA graph replays, so a `trace` rollout decodes eagerly.

The quantized modules subclass the ones they replace (`QATLinear(nn.Linear)`, `QATExperts(moe.Experts)`)
and keep the *same* Parameter objects under the same names (`weight`; `gate_up_proj`, `down_proj`):
state dicts, an optimizer built before conversion, and rac.sync_weights all keep working.
`bf16_forward(model)` switches every QAT layer back to plain full-precision computation for a while
(e.g. to evaluate the BF16 policy of a QAT-trained model). Under autocast a layer input is cast to the
autocast dtype before it is quantized: the rollout (a BF16 model) quantizes BF16 values too.

On CUDA the fake quantization runs nvfp4.py's fused Triton kernel (nvfp4 picks it by device).

Shape letters: T tokens (all leading dims flattened), K in-features, N out-features, G = K / 16 blocks,
E experts, A active experts per token, D model dim, I expert hidden dim, R = T*A (token, expert) rows,
M rows of a layer input, S decode steps, B trainer rows (sequences), W trainer columns.

Deliberately left out: quantized gradients (the backward GEMMs run in the activation dtype, as in
QUADS' W4A16 training), learned or per-channel scales, recording the prompt tokens for `trace`,
and a selection of compensated blocks of the trainer's own (moeresq uses the rollout's).
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe
import nvfp4

MODES = ("bf16", "qat", "w4a4", "moeresq", "trace")
SYMMETRIC = ("w4a4", "moeresq", "trace")  # the modes that quantize activations


# ----------------------------------------------------------------------------- straight-through
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


def _compute_dtype(x):
    """The dtype a GEMM on x runs in: autocast's, if enabled (the rollout model is BF16), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# ----------------------------------------------------------------------------- the weights, once per forward
def fake_quantize_weights(weights):
    """[nvfp4.fake_quantize_weight(w) for w in weights], bit for bit, with the same straight-through
    gradients, but with the global scales of all of them computed together: one multi-tensor amax and one
    application of nvfp4's scale rule, instead of about ten small launches per weight. A training step
    on the GPU waits on launches, not on this arithmetic (RESULTS.md)."""
    with torch.no_grad():
        matrices = [m for w in weights for m in (w.detach().unbind(0) if w.dim() >= 3 else (w.detach(),))]
        amax = torch.stack(torch._foreach_norm(matrices, float("inf"))).float()        # exact: a max
        # nvfp4's own rule, applied to each matrix's amax (the inf-norm of one value is that value)
        scales = nvfp4.compute_global_scale(amax.view(-1, 1, 1), per_matrix=True)
        scales = scales.split([w.shape[0] if w.dim() >= 3 else 1 for w in weights])
    return [nvfp4.fake_quantize(w, s.reshape(w.shape[:-2])) for w, s in zip(weights, scales)]


def _refresh_weights(model, args):
    """Forward pre-hook of a converted model: every QAT layer's fake-quantized weights for this forward."""
    layers = [m for m in _qat_layers(model) if m.fake_quant]
    weights = [w for m in layers for w in m.master_weights()]
    if not weights:
        return
    values, input_memo = iter(fake_quantize_weights(weights)), {}
    for layer in layers:
        layer.weights_q = tuple(next(values) for _ in layer.master_weights())
        layer.input_memo = input_memo


def _forget_weights(model, args, output):
    for layer in _qat_layers(model):
        layer.weights_q = layer.input_memo = None  # the backward holds what it needs


# ----------------------------------------------------------------------------- trace: rollout-guided rounding
@dataclass
class RolloutCodes:
    """What the rollout's quantizer produced for some rows of one layer input, keyed by row: codes, block
    scales and global scale per row (the rollout quantizes a whole decode step at one global scale)."""
    keys: torch.Tensor          # (M',) int64, ascending: trainer row b * W + w (down: row * E + expert)
    data: torch.Tensor          # (M', K/2) uint8 packed E2M1 codes, low nibble first
    block_scale: torch.Tensor   # (M', G) float8_e4m3fn
    global_scale: torch.Tensor  # (M',) fp32
    n_experts: int = 1          # E for an experts layer's down input (its keys are row * E + expert), else 1

    def nbytes(self):
        tensors = (self.keys, self.data, self.block_scale, self.global_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def select_rows(self, rows, width):
        """The records of trainer rows `rows` (R',) int64, keyed as a forward on tokens[rows] (width W)
        sees them: for a mini-batch of the rollout's sequences."""
        position, expert = self.keys // self.n_experts, self.keys % self.n_experts
        row, column = position // width, position % width
        size = max(int(row.max()) if row.numel() else 0, int(rows.max()) if rows.numel() else 0) + 1
        new_row = torch.full((size,), -1, dtype=torch.int64, device=self.keys.device)
        new_row[rows] = torch.arange(rows.numel(), device=rows.device)                  # -1: not selected
        row = new_row[row]
        index = (row >= 0).nonzero().squeeze(1)
        keys = (row[index] * width + column[index]) * self.n_experts + expert[index]
        order = keys.argsort()
        index = index[order]
        return RolloutCodes(keys[order], self.data[index], self.block_scale[index], self.global_scale[index],
                            self.n_experts)


# The signed E2M1 grid, ascending: the 15 distinct values a code can take.
_SIGNED_GRID = tuple(sorted({s * v for v in nvfp4.E2M1_VALUES for s in (-1.0, 1.0)}))


def takes_rollout_code(scaled, rollout_value):
    """Bool mask: is the rollout's grid value (in E2M1 units) one of the grid points that bracket
    `scaled` (x in units of the rollout's block grid)? lo = the largest grid value <= s, hi = the smallest
    >= s (both s itself on a grid point; +-6 beyond the range); NaN never takes."""
    grid = torch.tensor(_SIGNED_GRID, dtype=torch.float32, device=scaled.device)
    scaled = scaled.contiguous()
    lo = grid[(torch.searchsorted(grid, scaled, right=True) - 1).clamp(min=0)]
    hi = grid[torch.searchsorted(grid, scaled).clamp(max=len(_SIGNED_GRID) - 1)]
    return ((rollout_value == lo) | (rollout_value == hi)) & ~torch.isnan(scaled)


@torch.no_grad()
def guided_values(x, codes, row_keys, own):
    """Rollout-guided rounding of the rows of x (M, K) that `codes` recorded (matched by row_keys (M,)).
    own: x's own fake-quantized values (M, K), returned with the guided rows replaced (a new tensor)."""
    if codes is None or codes.keys.numel() == 0:
        return own
    # every row is looked up and computed, the rows without a record masked out at the end: no host sync
    index = torch.searchsorted(codes.keys, row_keys).clamp(max=codes.keys.numel() - 1)  # (M,)
    found = (codes.keys[index] == row_keys)[:, None]                                    # (M, 1)
    block_scale = codes.block_scale[index].float().repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)  # (M, K)
    global_scale = codes.global_scale[index, None]                                     # (M, 1)
    unit = block_scale * global_scale                                                   # its grid step
    rollout_code_value = nvfp4.decode_e2m1(nvfp4.unpack_codes(codes.data[index]))      # (M, K), E2M1 units
    take = (takes_rollout_code(x.float() / unit, rollout_code_value) & (unit > 0) & torch.isfinite(unit)
            & found)
    rollout_value = rollout_code_value * block_scale * global_scale  # nvfp4.dequantize's order: bit for bit
    return torch.where(take, rollout_value, own.float()).to(own.dtype)


# ----------------------------------------------------------------------------- the activation rule, per mode
def quantize_input(x, mode, rac_mask=None, codes=None, row_keys=None):
    """A layer input x (M, K) as the symmetric modes' forward sees it, in the GEMM's dtype, with a
    straight-through gradient to x: fq(x) (w4a4), the rollout's RAC (moeresq), rollout-guided (trace)."""
    dtype = _compute_dtype(x)
    with torch.no_grad():
        source = x.detach().to(dtype)
        if mode == "moeresq":
            values = nvfp4.fake_quantize_activation(source, rac_mask).to(dtype)
        else:
            values = nvfp4.fake_quantize(source)
            if mode == "trace":
                keys = torch.arange(x.shape[0], device=x.device) if row_keys is None else row_keys
                values = guided_values(source, codes, keys, values)
    return straight_through(x, values)


def _quantized_input_of(layer, x, mode, mask, codes):
    """quantize_input for a dense layer's input x (..., K), computed once per model forward for layers
    that read the same tensor with the same settings (q, k and v): the model's pre-hook hands every layer
    one memo (a dict); entries hold x itself, so no other tensor can take its id before the forward ends."""
    memo = layer.input_memo
    key = (id(x), x._version, mode, id(mask) if mode == "moeresq" else None,
           id(codes) if mode == "trace" else None, torch.is_grad_enabled())
    if memo is not None and key in memo:
        return memo[key][1]
    result = quantize_input(x.reshape(-1, x.shape[-1]), mode, mask, codes).view(x.shape)  # (..., K)
    if memo is not None:
        memo[key] = (x, result)
    return result


def _check_settings(mode, layer=False):
    if layer and mode == "bf16":
        raise ValueError("a QAT layer's mode is one of 'qat', 'w4a4', 'moeresq', 'trace'; "
                         "use bf16_forward for full precision")
    if mode not in MODES:
        raise ValueError(f"unknown QAT mode {mode!r}; choose one of {list(MODES)}")


def _check_masks(layer, masks, inputs):
    if layer.mode == "moeresq" and masks is None:
        raise ValueError(f"{type(layer).__name__} in mode 'moeresq' has no RAC selection: set its rac_masks "
                         f"to the rollout layer's RACSelector masks (train.py does), one per input: {inputs}")


# ----------------------------------------------------------------------------- dense layers
class QATLinear(nn.Linear):
    """nn.Linear whose forward uses the NVFP4 fake-quantized weight (straight-through to `weight`).

    mode "qat": y = x @ fq(W).T; the symmetric modes: y = x_eff @ fq(W).T with x_eff from
    quantize_input. `rac_masks` = (mask,) for moeresq, `rollout_codes` = (RolloutCodes or None,) for
    trace; both set from outside. `fake_quant=False` (see bf16_forward) makes it a plain nn.Linear again.
    The bias, if any, stays in full precision.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, mode="qat"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.configure(mode)
        self.fake_quant = True
        self.rac_masks = self.rollout_codes = self.weights_q = self.input_memo = None

    def configure(self, mode):
        _check_settings(mode, layer=True)
        self.mode = mode

    def master_weights(self):
        return (self.weight,)

    @classmethod
    def from_float(cls, linear, mode="qat"):
        """A QATLinear holding `linear`'s own Parameter objects (an existing optimizer keeps working)."""
        qat = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  mode=mode)
        qat.weight, qat.bias = linear.weight, linear.bias
        return qat.train(linear.training)

    @torch.no_grad()
    def quantized_weight(self):
        """fq(W): the weight the forward uses, (N, K) in the weight's dtype, without autograd."""
        return nvfp4.fake_quantize_weight(self.weight.detach())

    def forward(self, x):
        if not self.fake_quant:
            return super().forward(x)
        if self.mode in SYMMETRIC:
            _check_masks(self, self.rac_masks, "(mask,)")
            mask = self.rac_masks[0] if self.rac_masks is not None else None
            codes = self.rollout_codes[0] if self.rollout_codes is not None else None
            x = _quantized_input_of(self, x, self.mode, mask, codes)
        # the model's pre-hook fake-quantized every layer's weight together; a layer called alone does its own
        if self.weights_q is not None:
            weight_q = self.weights_q[0]
        else:
            weight_q = nvfp4.fake_quantize_weight(self.weight)
        y = F.linear(x, weight_q)                                                       # (..., N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"{super().extra_repr()}, mode={self.mode}, fake_quant={self.fake_quant}"


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
    (rows x_e of the tokens routed to it) autograd runs:

        forward   h_e = x_e @ fq(Wgu_e).T      (R_e, 2I)     y_e = (silu(gate) * up) @ fq(Wd_e).T   (R_e, D)
        backward  grad_x_e = grad_h_e @ fq(Wgu_e),  grad_Wgu_e = grad_h_e.T @ x_e  -> master gate_up_proj[e]
                  (and likewise for down_proj with input silu(gate) * up)

    On CUDA in BF16 these are torch._grouped_mm calls, elsewhere a per-expert loop. In the symmetric
    modes both GEMM inputs are quantized as the rollout quantizes them: x (T, D) before it is gathered
    (one global scale over the T tokens) and silu(gate) * up (R, I) (one over all R rows). `rac_masks` =
    (gate_up mask, down mask) for moeresq; `rollout_codes` = (gate_up codes keyed by token, down codes
    keyed by token * E + expert) for trace.
    """

    def configure(self, mode):
        _check_settings(mode, layer=True)
        self.mode = mode

    @classmethod
    def from_float(cls, experts, mode="qat"):
        """A QATExperts holding `experts`' own Parameter objects (an existing optimizer keeps working)."""
        qat = cls.__new__(cls)
        nn.Module.__init__(qat)
        for name, value in vars(experts).items():  # plain attributes such as n_experts
            if not name.startswith("_") and name != "training":
                setattr(qat, name, value)
        for name, param in experts.named_parameters(recurse=False):
            setattr(qat, name, param)
        qat.configure(mode)
        qat.fake_quant = True
        qat.rac_masks = qat.rollout_codes = qat.weights_q = qat.input_memo = None
        return qat.train(experts.training)

    def master_weights(self):
        return (self.gate_up_proj, self.down_proj)

    @torch.no_grad()
    def quantized_weights(self):
        """(fq(gate_up_proj) (E, 2I, D), fq(down_proj) (E, D, I)), without autograd."""
        return (nvfp4.fake_quantize_weight(self.gate_up_proj.detach()),
                nvfp4.fake_quantize_weight(self.down_proj.detach()))

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D), as moe.Experts."""
        if not self.fake_quant:
            return super().forward(x, expert_ids, expert_weights)
        if self.weights_q is not None:
            gate_up, down = self.weights_q                                             # (E, 2I, D), (E, D, I)
        else:
            gate_up, down = (nvfp4.fake_quantize_weight(w) for w in self.master_weights())
        routing = moe.route_tokens(expert_ids, self.n_experts)
        if self.mode == "qat":  # moe.py's own path, only the weights swapped
            x_sorted, gate_up, down = moe.expert_operands(x[routing.token_ids], gate_up, down)  # (R, D)
            if moe.use_grouped_mm(x_sorted, down.shape[-1]):
                y_sorted = moe.expert_swiglu_grouped(x_sorted, routing.offsets, gate_up, down)
            else:
                y_sorted = moe.expert_swiglu_loop(x_sorted, routing.counts, gate_up, down)
            return moe.combine_expert_outputs(y_sorted, routing, expert_weights)
        # symmetric modes: the same two GEMMs with each input quantized as the rollout quantizes it
        _check_masks(self, self.rac_masks, "(gate_up mask, down mask)")
        masks = self.rac_masks or (None, None)
        codes = self.rollout_codes or (None, None)
        x_eff = quantize_input(x, self.mode, masks[0], codes[0])                       # (T, D)
        dtype = x_eff.dtype
        gate_up, down = gate_up.to(dtype), down.to(dtype)
        x_sorted = x_eff[routing.token_ids]                                            # (R, D)
        grouped = moe.use_grouped_mm(x_sorted, down.shape[-1])
        gate, up = _grouped_linear(x_sorted, routing, gate_up, grouped).chunk(2, dim=-1)  # (R, I) each
        down_keys = None
        if codes[1] is not None:  # which (token, expert) pair each sorted row is
            down_keys = routing.token_ids * self.n_experts + expert_ids.reshape(-1)[routing.order]
        hidden = quantize_input(F.silu(gate) * up, self.mode, masks[1], codes[1], down_keys)
        y_sorted = _grouped_linear(hidden, routing, down, grouped)                     # (R, D)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)

    def extra_repr(self):
        return f"mode={self.mode}, fake_quant={self.fake_quant}"


# ----------------------------------------------------------------------------- conversion
def _qat_layers(model):
    return [m for m in model.modules() if isinstance(m, (QATLinear, QATExperts))]


def convert_for_training(model, mode, quantize_router=False, quantize_lm_head=False):
    """Swap moe.py's layers for QAT layers in place and return the model.

    mode: one of MODES (module docstring). Converted: every moe.Attention's nn.Linear projections and
    every moe.Experts; with the flags, the routers (moe.MoEBlock's nn.Linear) and the LM head
    (moe.MoETransformer's nn.Linear). Layers already converted are reconfigured to the new mode.
    Parameters are reused, not copied, so an optimizer created before the conversion still updates the
    weights the QAT layers use. moeresq layers need their rac_masks set before their first forward.
    """
    _check_settings(mode)
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, (QATLinear, QATExperts)):
            child.configure(mode)
        elif isinstance(child, moe.Experts):
            setattr(parent, name, QATExperts.from_float(child, mode))
        else:
            setattr(parent, name, QATLinear.from_float(child, mode))
    if not getattr(model, "_qat_hooks", None):
        model._qat_hooks = (model.register_forward_pre_hook(_refresh_weights),
                            model.register_forward_hook(_forget_weights))
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


# ----------------------------------------------------------------------------- trace: recording the rollout
class RolloutRecorder:
    """Collects what the rollout's quantizers used at each decode step, for `trace` (module docstring).

    The caller (train.py) feeds it from hooks on the rollout model: `begin_forward(decoding)` at every
    model forward, `route(path, expert_ids, n_experts)` at every experts layer, `record(path, index, x)`
    at every quantized layer input (x (M, K) exactly as the quantizer sees it; index 0 for a linear layer
    and an experts layer's gate/up input, 1 for the experts' down input, whose rows come sorted by expert
    as moe.route_tokens sorts them). Nothing is kept outside `start()` ... `stop()`, nor during prefills.
    `codes(...)` then gives each layer path its tuple of RolloutCodes, as the trainer's layers take them.
    """

    def __init__(self):
        self.active = self.decoding = False
        self.start()
        self.active = False

    def start(self):
        self.steps, self.experts, self.order, self.n_experts, self._memo = {}, {}, {}, {}, {}
        self.active = True

    def stop(self):
        self.active = self.decoding = False
        self._memo = {}

    def begin_forward(self, decoding):
        self.decoding = bool(decoding)
        self._memo = {}

    @torch.no_grad()
    def route(self, path, expert_ids, n_experts):
        """An experts layer's routes (T, A) at this step, which fix the order of its down input's rows."""
        if self.active and self.decoding:
            self.order[path] = moe.route_tokens(expert_ids, n_experts).order
            self.experts.setdefault(path, []).append(expert_ids)
            self.n_experts[path] = n_experts

    @torch.no_grad()
    def record(self, path, index, x):
        """x (M, K): input `index` of the layer at `path`, at this decode step."""
        if not (self.active and self.decoding):
            return
        # q, k and v quantize one tensor: record it once. The memo holds x, so that no other tensor can
        # take its address before the next forward.
        memo_key = (x.data_ptr(), tuple(x.shape), x.dtype, index)
        if memo_key not in self._memo:
            q = nvfp4.quantize(x)
            data, block_scale = q.data, q.block_scale.view(torch.uint8)
            if index == 1:  # rows sorted by expert -> assignment order t * A + a
                order = self.order[path]
                data = data.index_copy(0, order, data)
                block_scale = block_scale.index_copy(0, order, block_scale)
            self._memo[memo_key] = (x, (data, block_scale, q.global_scale.reshape(()).float()))
        self.steps.setdefault((path, index), []).append(self._memo[memo_key][1])

    @torch.no_grad()
    def codes(self, completion_mask, prompt_lengths, width):
        """{layer path: (RolloutCodes, ...)} for the completion tokens only, keyed by trainer position
        b * W + w, where completion token t of row b sits at column prompt_lengths[b] + t (right-padded
        rows of width W); the experts' down inputs by (b * W + w) * E + expert. completion_mask (B, T)."""
        B, T = completion_mask.shape
        b, t = completion_mask.nonzero(as_tuple=True)                                   # (n,) each, ascending
        position = b * width + prompt_lengths[b] + t                                    # (n,) trainer rows
        stacked, by_path = {}, {}

        def stack(records, i):  # T steps of (B[*A], ...) -> (B[*A], T, ...), once per recorded tensor
            key = (id(records[0][i]), i)
            if key not in stacked:
                stacked[key] = torch.stack([r[i] for r in records[:T]], dim=1)
            return stacked[key]

        shared = {}  # sites that recorded one tensor (q, k, v) get one RolloutCodes object
        for (path, index), records in self.steps.items():
            if (id(records[0]), index) in shared:
                by_path.setdefault(path, {})[index] = shared[(id(records[0]), index)]
                continue
            if len(records) < T:
                raise ValueError(f"RolloutRecorder: {path!r} saw {len(records)} decode steps, "
                                 f"the rollout has {T} tokens")
            data, block_scale = stack(records, 0), stack(records, 1)
            global_scale = torch.stack([r[2] for r in records[:T]])                     # (T,)
            if index == 1:
                experts = torch.stack(self.experts[path][:T], dim=1)                   # (B, T, A)
                A = experts.shape[-1]
                data = data.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)      # (n * A, K/2)
                block_scale = block_scale.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)
                keys = (position[:, None] * self.n_experts[path] + experts[b, t]).flatten()  # (n * A,)
                order = keys.argsort()
                codes = RolloutCodes(keys[order], data[order], block_scale[order].view(torch.float8_e4m3fn),
                                     global_scale[t].repeat_interleave(A)[order], self.n_experts[path])
            else:
                codes = RolloutCodes(position, data[b, t], block_scale[b, t].view(torch.float8_e4m3fn),
                                     global_scale[t])
            by_path.setdefault(path, {})[index] = shared[(id(records[0]), index)] = codes
        return {path: tuple(sites.get(i) for i in range(max(sites) + 1)) for path, sites in by_path.items()}


def use_rollout_codes(layers_by_path, codes_by_path, rows=None, width=None):
    """Hand the recorded codes to the trainer's trace layers: codes_by_path maps a layer's path to its
    tuple of RolloutCodes (one per input); None clears every layer (free the memory after the step).
    rows (R',), width W: the next forward sees only those sequences of the rollout (a mini-batch)."""
    selected = {}  # one selection per record: layers sharing one (q, k, v) share its mini-batch too, so
    #                _quantized_input_of's memo still serves them together

    def select(c):
        if c is not None and id(c) not in selected:
            selected[id(c)] = c.select_rows(rows, width)
        return None if c is None else selected[id(c)]

    for path, layer in layers_by_path.items():
        if isinstance(layer, (QATLinear, QATExperts)):
            codes = None if codes_by_path is None else codes_by_path.get(path)
            if codes is not None and rows is not None:
                codes = tuple(select(c) for c in codes)
            layer.rollout_codes = codes
