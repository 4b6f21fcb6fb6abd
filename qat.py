"""Trainer side: quantization-aware training with NVFP4 weights and a straight-through gradient, and the
symmetric recipes that quantize the trainer's activations too.

The rollout runs NVFP4 W4A4; a plain BF16 trainer computes another function, and the log-probs of the same
tokens drift apart. The asymmetric recipe (QUADS) removes the weight half of that difference: the trainer's
forward uses the weights *as the rollout will see them*, activations staying BF16,

    Wq = nvfp4.fake_quantize_weight(W) = dequantize(quantize_weight(W))    bit for bit what rac.py loads
    forward   y      = x_eff @ Wq.T              x_eff = x (qat), or x's fake-quantized form (below)
    backward  grad_x = grad_y @ Wq               the quantized weight, as the forward used
              grad_W = grad_y.T @ x_eff          to the master W (straight-through: dWq/dW = identity)

Modes (`convert_for_training(model, mode)`), for the attention projections and experts:
- `bf16`: no change.   `qat`: the asymmetric recipe above.
- `w4a4`: every layer input is fake-quantized as the rollout quantizes it (a dynamic per-tensor global
  scale), straight-through to x. QUADS reports a *larger* mismatch than `qat`.
- `moeresq` (MoEResQ): `w4a4` plus the rollout's residual compensation, nvfp4's one activation rule,
      x_eff = DQ(Q(x)) + DQ(Q(S * (x - DQ(Q(x)))))          S = the rollout's own block mask
- `trace` (TRACE): `w4a4`, except where the rollout recorded what it used for a row (RolloutCodes): with
  s = x / (block_scale_r * global_scale_r) and lo, hi the E2M1 grid points around s, an element takes the
  rollout's value when that value is lo or hi, else its own rounding. Choices TRACE's text leaves open:
  the rollout's block scales are used where its code is taken, the grid test is in fp32, and zero blocks
  (scale 0) keep the trainer's rounding.
The symmetric modes scale activations per tensor or per row, as the rollout (act_scale). The router,
embeddings, norms and LM head stay in full precision (`quantize_router`, `quantize_lm_head`).

What the trainer takes from the rollout is an argument of one forward: `with sharing(model, state):`,
state = SharedState(masks, codes) per layer path; within it all weights are fake-quantized together. trace's
codes are recorded on the rollout side (RolloutRecorder), keyed by the trainer's (row, column), for the
experts' down input by (position, expert). The quantized modules subclass the ones they replace and keep
the *same* Parameter objects: state dicts, an optimizer built before conversion and rac.sync_weights keep
working. Under autocast an input is cast to the autocast dtype before it is quantized, as the rollout's.

Shape letters: T tokens, K in-features, N out-features, G = K / 16 blocks, E experts, A active experts,
D model dim, I expert hidden dim, R = T*A (token, expert) rows, M rows of a layer input, W trainer columns.
Left out: quantized gradients (the backward GEMMs run in the activation dtype, as in QUADS' W4A16
training), learned or per-channel scales, recording prompt tokens for `trace`, a trainer-side selection
for moeresq (it uses the rollout's).
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


straight_through = (
    _StraightThrough.apply
)  # straight_through(source, value): value, d value / d source = 1


# ----------------------------------------------------------------------------- trace: rollout-guided rounding
@dataclass
class RolloutCodes:
    """What the rollout's quantizer produced for some rows of one layer input: codes and scales, by row."""

    keys: torch.Tensor  # (M',) int64, ascending: trainer row b * W + w (down: row * E + expert)
    data: torch.Tensor  # (M', K/2) uint8 packed E2M1 codes, low nibble first
    block_scale: torch.Tensor  # (M', G) float8_e4m3fn
    global_scale: torch.Tensor  # (M',) fp32
    n_experts: int = (
        1  # E for an experts layer's down input (its keys are row * E + expert), else 1
    )

    def select_rows(self, rows, width):
        """The records of trainer rows `rows` (R',) int64, keyed as a forward on tokens[rows] (width W)
        sees them: for a mini-batch of the rollout's sequences."""
        position, expert = self.keys // self.n_experts, self.keys % self.n_experts
        row, column = position // width, position % width
        size = max(int(row.max()) if row.numel() else 0, int(rows.max()) if rows.numel() else 0) + 1
        new_row = torch.full((size,), -1, dtype=torch.int64, device=self.keys.device)
        new_row[rows] = torch.arange(rows.numel(), device=rows.device)  # -1: not selected
        row = new_row[row]
        index = (row >= 0).nonzero().squeeze(1)
        keys = (row[index] * width + column[index]) * self.n_experts + expert[index]
        order = keys.argsort()
        index = index[order]
        return RolloutCodes(
            keys[order],
            self.data[index],
            self.block_scale[index],
            self.global_scale[index],
            self.n_experts,
        )


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
    found = (codes.keys[index] == row_keys)[:, None]  # (M, 1)
    block_scale = (
        codes.block_scale[index].float().repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)
    )  # (M, K)
    global_scale = codes.global_scale[index, None]  # (M, 1)
    unit = block_scale * global_scale  # its grid step
    rollout_code_value = nvfp4.decode_e2m1(
        nvfp4.unpack_codes(codes.data[index])
    )  # (M, K), E2M1 units
    take = (
        takes_rollout_code(x.float() / unit, rollout_code_value)
        & (unit > 0)
        & torch.isfinite(unit)
        & found
    )
    rollout_value = (
        rollout_code_value * block_scale * global_scale
    )  # nvfp4.dequantize's order: bit for bit
    return torch.where(take, rollout_value, own.float()).to(own.dtype)


# ----------------------------------------------------------------------------- trace: the rollout's record
class RolloutRecorder:
    """The rollout's quantized layer inputs at each decode step (fed by rac.recording around the decode
    steps: train.sample), re-quantized with nvfp4.quantize (the same codes); `codes` keeps the completion
    tokens' (prompts come from the prefill). Per token and input of width K: K/2 + K/16 + 12 bytes (1.5 KB
    per token and layer on the small preset), held from the rollout to the update."""

    def __init__(self, act_scale="tensor"):
        self.act_scale = act_scale  # the rollout's: one global scale per tensor or per row
        self.steps, self.experts, self.n_experts = {}, {}, {}  # keyed by (paths, index)

    @torch.no_grad()
    def record(self, paths, index, x, routes=None):
        """x (M, K): input `index` of the layers at `paths` (q, k and v read one tensor: one record) at this
        decode step; index 1 (the experts' down input, rows sorted by expert): routes = (moe.Routing,
        expert_ids (T, A)) of this step."""
        q = nvfp4.quantize(x, nvfp4.activation_global_scale(x, self.act_scale))
        data, block_scale = q.data, q.block_scale.view(torch.uint8)
        global_scale = q.global_scale.float().expand(x.shape[0])  # (M,)
        if index == 1:  # rows sorted by expert -> assignment order t * A + a
            routing, expert_ids = routes
            data, block_scale, global_scale = (
                t.index_copy(0, routing.order, t) for t in (data, block_scale, global_scale)
            )
            self.experts.setdefault((paths, index), []).append(expert_ids)
            self.n_experts[paths, index] = routing.counts.numel()
        self.steps.setdefault((paths, index), []).append((data, block_scale, global_scale))

    @torch.no_grad()
    def codes(self, completion_mask, prompt_lengths, width):
        """{layer path: (RolloutCodes, ...)} for the completion tokens only, keyed by trainer position
        b * W + w, where completion token t of row b sits at column prompt_lengths[b] + t (right-padded
        rows of width W); the experts' down inputs by (b * W + w) * E + expert. completion_mask (B, T)."""
        B, T = completion_mask.shape
        b, t = completion_mask.nonzero(as_tuple=True)  # (n,) each, ascending
        position = b * width + prompt_lengths[b] + t  # (n,) trainer rows
        by_path = {}
        for (paths, index), records in self.steps.items():
            if len(records) < T:
                raise ValueError(
                    f"RolloutRecorder: {paths[0]!r} saw {len(records)} decode steps, "
                    f"the rollout has {T} tokens"
                )
            data, block_scale, global_scale = (
                torch.stack(r, dim=1) for r in zip(*records[:T])
            )  # (B[*A], T, .)
            if index == 1:
                experts, E = (
                    torch.stack(self.experts[paths, index][:T], dim=1),
                    self.n_experts[paths, index],
                )
                A = experts.shape[-1]  # experts (B, T, A)
                data = data.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)  # (n * A, K/2)
                block_scale = block_scale.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)
                global_scale = (
                    global_scale.view(B, A, T).transpose(1, 2)[b, t].flatten()
                )  # (n * A,)
                keys = (position[:, None] * E + experts[b, t]).flatten()  # (n * A,)
                order = keys.argsort()
                codes = RolloutCodes(
                    keys[order],
                    data[order],
                    block_scale[order].view(torch.float8_e4m3fn),
                    global_scale[order],
                    E,
                )
            else:
                codes = RolloutCodes(
                    position,
                    data[b, t],
                    block_scale[b, t].view(torch.float8_e4m3fn),
                    global_scale[b, t],
                )
            for path in paths:
                by_path.setdefault(path, {})[index] = codes
        return {
            path: tuple(sites.get(i) for i in range(max(sites) + 1))
            for path, sites in by_path.items()
        }


def recorded_codes(recorder, out):
    """After a trace rollout: its recorded codes, keyed by the trainer's (row, column); the recorder empties."""
    width = int(
        (out.prompt_lengths + out.completion_lengths).max()
    )  # = out.sequences().tokens.shape[1]
    codes = recorder.codes(out.completion_mask, out.prompt_lengths, width)
    recorder.__init__()
    return codes


# ----------------------------------------------------------------------------- the activation rule, per mode
def quantize_input(x, mode, rac_mask=None, codes=None, row_keys=None, act_scale="tensor"):
    """A layer input x (M, K) as the symmetric modes see it, in the GEMM's dtype, straight-through to x:
    fq(x) (w4a4), the rollout's RAC (moeresq), rollout-guided (trace); act_scale as the rollout's."""
    autocast = torch.is_autocast_enabled(
        x.device.type
    )  # the GEMM's dtype (the rollout model is BF16)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    with torch.no_grad():
        source = x.detach().to(dtype)
        if mode == "moeresq":
            values = nvfp4.fake_quantize_activation(source, rac_mask, act_scale).to(dtype)
        else:
            values = nvfp4.fake_quantize(source, nvfp4.activation_global_scale(source, act_scale))
            if mode == "trace":
                keys = torch.arange(x.shape[0], device=x.device) if row_keys is None else row_keys
                values = guided_values(source, codes, keys, values)
    return straight_through(x, values)


def _check_settings(mode, layer=False, act_scale="tensor"):
    if layer and mode == "bf16":
        raise ValueError("a QAT layer's mode is one of 'qat', 'w4a4', 'moeresq', 'trace'")
    if mode not in MODES or act_scale not in nvfp4.ACT_SCALES:
        raise ValueError(
            f"QAT mode {mode!r}, act_scale {act_scale!r}: choose a mode of {list(MODES)} and an "
            f"act_scale of {list(nvfp4.ACT_SCALES)}"
        )


def _set_mode(layer, mode, act_scale="tensor"):
    _check_settings(mode, True, act_scale)
    layer.mode, layer.act_scale = mode, act_scale


def _check_masks(layer, masks, inputs):
    if layer.mode == "moeresq" and masks is None:
        raise ValueError(
            f"{type(layer).__name__} in mode 'moeresq' has no RAC selection: call the model "
            f"within qat.sharing(model, SharedState(masks=...)) with the rollout layer's RAC "
            f"masks, one per input: {inputs}"
        )


# ----------------------------------------------------------------------------- the weights, once per forward
def fake_quantize_weights(weights):
    """[nvfp4.fake_quantize_weight(w) for w in weights], bit for bit, straight-through gradients too, with
    all global scales from one multi-tensor amax (not a few small launches per weight: results log)."""
    with torch.no_grad():
        matrices = [
            m for w in weights for m in (w.detach().unbind(0) if w.dim() >= 3 else (w.detach(),))
        ]
        amax = torch.stack(torch._foreach_norm(matrices, float("inf"))).float()  # exact: a max
        scales = nvfp4.compute_global_scale(
            amax.view(-1, 1, 1), per_matrix=True
        )  # nvfp4's own rule
        scales = scales.split([w.shape[0] if w.dim() >= 3 else 1 for w in weights])
    return [nvfp4.fake_quantize(w, s.reshape(w.shape[:-2])) for w, s in zip(weights, scales)]


class _WeightCache:
    """Within `sharing`: all QAT layers' fake-quantized weights (fake_quantize_weights) when the first layer
    asks, again after a weight or the grad mode changed (an optimizer step, a no_grad forward first)."""

    def __init__(self, layers):
        self.layers, self.key, self.values = layers, None, {}

    def get(self, layer):
        layers = self.layers
        key = (
            torch.is_grad_enabled(),
            tuple(p._version for m in layers for p in m.master_weights()),
        )
        if key != self.key:
            values = iter(fake_quantize_weights([p for m in layers for p in m.master_weights()]))
            self.values = {id(m): tuple(next(values) for _ in m.master_weights()) for m in layers}
            self.key = key
        return self.values[id(layer)]


def _fake_quantized(layer):
    """The layer's fake-quantized weights: from its model's cache within `sharing`, else its own."""
    if layer.weight_cache is not None:
        return layer.weight_cache.get(layer)
    return tuple(nvfp4.fake_quantize_weight(w) for w in layer.master_weights())


@torch.no_grad()
def quantized_weights(layer):
    """What a QAT layer's forward uses, without autograd: (fq(W),), or (fq(gate_up_proj), fq(down_proj))."""
    return tuple(nvfp4.fake_quantize_weight(w.detach()) for w in layer.master_weights())


# ----------------------------------------------------------------------------- dense layers
class QATLinear(nn.Linear):
    """nn.Linear whose forward uses the NVFP4 fake-quantized weight (straight-through to `weight`).

    mode "qat": y = x @ fq(W).T; the symmetric modes: y = x_eff @ fq(W).T with x_eff from quantize_input.
    Within `sharing`: `rac_masks` = (mask,) for moeresq, `rollout_codes` = (RolloutCodes or None,) for
    trace. The bias stays full precision.
    """

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        device=None,
        dtype=None,
        mode="qat",
        act_scale="tensor",
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _set_mode(self, mode, act_scale)
        self.rac_masks = self.rollout_codes = self.weight_cache = (
            None  # only within qat.sharing(...)
        )

    @classmethod
    def from_float(cls, linear, mode="qat", act_scale="tensor"):
        """A QATLinear holding `linear`'s own Parameter objects (an existing optimizer keeps working)."""
        qat = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            mode=mode,
            act_scale=act_scale,
        )
        qat.weight, qat.bias = linear.weight, linear.bias
        return qat.train(linear.training)

    def master_weights(self):
        return (self.weight,)

    def forward(self, x):
        if self.mode in SYMMETRIC:
            _check_masks(self, self.rac_masks, "(mask,)")
            mask = self.rac_masks[0] if self.rac_masks is not None else None
            codes = self.rollout_codes[0] if self.rollout_codes is not None else None
            x = quantize_input(
                x.reshape(-1, x.shape[-1]), self.mode, mask, codes, None, self.act_scale
            ).view(x.shape)  # (..., K)
        (weight,) = _fake_quantized(self)
        y = F.linear(x, weight)  # (..., N)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"{super().extra_repr()}, mode={self.mode}"


# ----------------------------------------------------------------------------- experts
def _grouped_linear(x_sorted, routing, weight, grouped):
    """x_sorted (R, K) grouped by expert, weight (E, N, K) -> (R, N): rows of expert e times weight[e].T."""
    if grouped:
        return torch._grouped_mm(x_sorted, weight.transpose(-2, -1), offs=routing.offsets)
    outputs, start, weights = (
        [],
        0,
        weight.unbind(0),
    )  # unbind: one gradient buffer, not one per expert
    for e, n in enumerate(
        routing.counts.tolist()
    ):  # the slow twin: one host sync, a loop over experts
        outputs.append(F.linear(x_sorted[start : start + n], weights[e]))
        start += n
    return torch.cat(outputs)


class QATExperts(moe.Experts):
    """moe.Experts computing with fake-quantized stacked weights (one global scale per expert).

    The weights enter moe.py's own expert path through a straight-through function, so per expert e
    (rows x_e of the tokens routed to it) autograd runs:

        forward   h_e = x_e @ fq(Wgu_e).T      (R_e, 2I)     y_e = (silu(gate) * up) @ fq(Wd_e).T   (R_e, D)
        backward  grad_x_e = grad_h_e @ fq(Wgu_e),  grad_Wgu_e = grad_h_e.T @ x_e  -> master gate_up_proj[e]
                  (and likewise for down_proj with input silu(gate) * up)

    On CUDA in BF16 these are torch._grouped_mm calls, elsewhere a per-expert loop. The symmetric modes
    quantize both GEMM inputs as the rollout does: x (T, D) before the gather (one global scale over T
    tokens), silu(gate) * up (R, I) over all R rows. Within `sharing`: `rac_masks` = (gate_up, down) for
    moeresq, `rollout_codes` = (gate_up codes by token, down codes by token * E + expert) for trace."""

    @classmethod
    def from_float(cls, experts, mode="qat", act_scale="tensor"):
        """A QATExperts holding `experts`' own Parameter objects (an existing optimizer keeps working)."""
        qat = cls.__new__(cls)
        nn.Module.__init__(qat)
        for name, value in vars(experts).items():  # plain attributes such as n_experts
            if not name.startswith("_") and name != "training":
                setattr(qat, name, value)
        for name, param in experts.named_parameters(recurse=False):
            setattr(qat, name, param)
        _set_mode(qat, mode, act_scale)
        qat.rac_masks = qat.rollout_codes = qat.weight_cache = None  # only within qat.sharing(...)
        return qat.train(experts.training)

    def master_weights(self):
        return (self.gate_up_proj, self.down_proj)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D), as moe.Experts."""
        gate_up, down = _fake_quantized(self)  # (E, 2I, D), (E, D, I)
        routing = moe.route_tokens(expert_ids, self.n_experts)
        if self.mode == "qat":  # moe.py's own path, only the weights swapped
            x_sorted, gate_up, down = moe.expert_operands(
                x[routing.token_ids], gate_up, down
            )  # (R, D)
            if moe.use_grouped_mm(x_sorted, down.shape[-1]):
                y_sorted = moe.expert_swiglu_grouped(x_sorted, routing.offsets, gate_up, down)
            else:
                y_sorted = moe.expert_swiglu_loop(x_sorted, routing.counts, gate_up, down)
            return moe.combine_expert_outputs(y_sorted, routing, expert_weights)
        # symmetric modes: the same two GEMMs with each input quantized as the rollout quantizes it
        _check_masks(self, self.rac_masks, "(gate_up mask, down mask)")
        masks = self.rac_masks or (None, None)
        codes = self.rollout_codes or (None, None)
        x_eff = quantize_input(x, self.mode, masks[0], codes[0], None, self.act_scale)  # (T, D)
        dtype = x_eff.dtype
        gate_up, down = gate_up.to(dtype), down.to(dtype)
        x_sorted = x_eff[routing.token_ids]  # (R, D)
        grouped = moe.use_grouped_mm(x_sorted, down.shape[-1])
        gate, up = _grouped_linear(x_sorted, routing, gate_up, grouped).chunk(
            2, dim=-1
        )  # (R, I) each
        down_keys = None
        if codes[1] is not None:  # which (token, expert) pair each sorted row is
            down_keys = routing.token_ids * self.n_experts + expert_ids.reshape(-1)[routing.order]
        hidden = quantize_input(
            F.silu(gate) * up, self.mode, masks[1], codes[1], down_keys, self.act_scale
        )
        y_sorted = _grouped_linear(hidden, routing, down, grouped)  # (R, D)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)

    def extra_repr(self):
        return f"mode={self.mode}"


# ----------------------------------------------------------------------------- conversion
def convert_for_training(
    model, mode, quantize_router=False, quantize_lm_head=False, act_scale="tensor"
):
    """Swap moe.py's layers for QAT layers in mode `mode` (MODES) in place; returns the model. Converted:
    moe.Attention's projections and moe.Experts; with the flags the routers and the LM head. Converted
    layers take the new mode. Parameters are reused, not copied (an existing optimizer keeps working).
    act_scale: the symmetric modes' activation global scale, per "tensor" or per "row" (the rollout's)."""
    _check_settings(mode, act_scale=act_scale)
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, (QATLinear, QATExperts)):
            _set_mode(child, mode, act_scale)
        else:
            setattr(
                parent,
                name,
                (QATExperts if isinstance(child, moe.Experts) else QATLinear).from_float(
                    child, mode, act_scale
                ),
            )
    return model


@dataclass
class SharedState:
    """What a symmetric trainer's forward takes from its rollout, per layer path (the two models share one
    module tree, so a path names a layer's twin): moeresq's RAC block masks, one per quantized input (the
    rollout's own RACSelector masks: one selection for both sides), and trace's recorded RolloutCodes."""

    masks: dict | None = (
        None  # {path: (mask (G,) bool, ...)}: (mask,) for a linear, (gate_up, down) experts
    )
    codes: dict | None = (
        None  # {path: (RolloutCodes or None, ...)}, as RolloutRecorder records them
    )

    def select_rows(self, rows, width):
        """The state of a forward on tokens[rows] (a mini-batch of the rollout's sequences, width W)."""
        if self.codes is None:
            return self
        selected = {}  # one selection per record: q, k and v share theirs

        def select(c):
            if c is not None and id(c) not in selected:
                selected[id(c)] = c.select_rows(rows, width)
            return None if c is None else selected[id(c)]

        return SharedState(
            self.masks, {path: tuple(map(select, c)) for path, c in self.codes.items()}
        )


@contextlib.contextmanager
def sharing(model, state):
    """Within the block, the QAT layers of `model` compute with `state` (a SharedState, or None): the state
    is an argument of this call, as torch.func.functional_call passes tensors for one call; nothing of it
    stays on the layers afterwards. moeresq layers need their masks; trace layers without codes round
    every row themselves. The fake-quantized weights of all layers are computed together (_WeightCache)."""
    layers = [
        (path, m) for path, m in model.named_modules() if isinstance(m, (QATLinear, QATExperts))
    ]
    cache = _WeightCache([m for _, m in layers])
    for path, layer in layers:
        layer.rac_masks = None if state is None or state.masks is None else state.masks.get(path)
        layer.rollout_codes = (
            None if state is None or state.codes is None else state.codes.get(path)
        )
        layer.weight_cache = cache
    try:
        yield model
    finally:
        for _, layer in layers:
            layer.rac_masks = layer.rollout_codes = layer.weight_cache = None
