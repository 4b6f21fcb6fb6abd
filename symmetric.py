"""The symmetric trainer recipes: the trainer fake-quantizes its activations too, as the rollout
does.

qat.py's asymmetric trainer quantizes weights only. The symmetric answers to the same mismatch
quantize each layer input x (M, K) of the trainer's forward the way the rollout quantizes it, so
both sides compute W4A4, and pass the gradient straight through to x:

    w4a4      x_eff = DQ(Q(x))                  Q with a dynamic global scale, per tensor or per
                                                row (act_scale), as the rollout's activations
    moeresq   x_eff = DQ(Q(x)) + DQ(Q(S * r))   r = x - DQ(Q(x)); S = the rollout's own RAC block
              (MoEResQ)                         mask: nvfp4.fake_quantize_activation, one rule
    trace     x_eff = the rollout's value       s = x / (block_scale_r * global_scale_r) in the
              (TRACE)  where it lies within     rollout's grid units; lo, hi = the E2M1 points
                       one E2M1 step of x,      around s; the rollout's value is taken if it is
                       else DQ(Q(x))            lo or hi

    forward   y = x_eff @ fq(W).T               fq(W) as in qat.py
    backward  grad_x = grad_y @ fq(W)           straight-through: d x_eff / d x = identity
              grad_W = grad_y.T @ x_eff

QUADS reports that w4a4 leaves a *larger* mismatch than qat: the trainer's rounding of x is its own,
not the rollout's (a per-tensor scale depends on the batch the row shares, which differs between a
decode step and the trainer's forward). MoEResQ and TRACE each close part of that gap with something
the rollout hands over, and here both travel as arguments of the trainer's forward (moe.py's
hand_offs), made by train.py from the rollout that sampled the batch:

- moeresq: the rollout's RAC block masks (rac.rac_masks, a snapshot taken right after the rollout,
so
  a later recalibration of the rollout does not reach this batch's update);
- trace: the codes the rollout's quantizers produced at each decode step (rac.InputRecorder's
  RecordedCodes, keyed by the trainer's row b * W + w, the experts' down input by (row, expert)).

Choices TRACE's text leaves open: the rollout's block scales are used where its code is taken, the
grid test is in fp32, zero blocks (scale 0) keep the trainer's rounding, and prompt tokens (the
rollout's prefill) are not recorded, so they round on their own.

Shape letters: M rows of a layer input, K in-features, G = K / 16 blocks, T tokens, E experts, A
active experts, R = T * A (token, expert) rows, W the trainer's columns."""

from typing import NamedTuple

import torch
import torch.nn.functional as F

import moe
import nvfp4
import qat

MODES = ("w4a4", "moeresq", "trace")


# ---------------------------------------------------------------------- what the rollout hands over
class RolloutShare(NamedTuple):
    """What a symmetric trainer takes from the rollout of one batch, by layer path (the rollout and
    the trainer share one module tree, so a path names a layer's twin)."""

    masks: dict | None = None  # moeresq: {path: (mask (G,) bool, ...)}, one per quantized input
    codes: dict | None = None  # trace: {path: (RecordedCodes or None, ...)}, as rac.InputRecorder

    def select_rows(self, rows, width):
        """The share of a forward on tokens[rows] (a mini-batch of the rollout's sequences of width
        W): the codes re-keyed to the mini-batch's rows; the masks are the same for every row."""
        if self.codes is None:
            return self
        selected = {}  # one selection per record: q, k and v share theirs
        codes = {}
        for path, records in self.codes.items():
            layer_codes = []
            for record in records:
                if record is not None and id(record) not in selected:
                    selected[id(record)] = select_codes(record, rows, width)
                layer_codes.append(None if record is None else selected[id(record)])
            codes[path] = tuple(layer_codes)
        return RolloutShare(self.masks, codes)

    def hand_offs(self, trainer):
        """{layer path: LayerShare} for every symmetric layer of `trainer`: moe.py's hand_offs."""
        hand_offs = {}
        for path, layer in trainer.named_modules():
            if not isinstance(layer, (SymmetricLinear, SymmetricExperts)):
                continue
            masks = None
            codes = None
            if self.masks is not None:
                masks = self.masks.get(path)
            if self.codes is not None:
                codes = self.codes.get(path)
            hand_offs[path] = LayerShare(masks, codes)
        return hand_offs


class LayerShare(NamedTuple):
    """One layer's part of a RolloutShare, one entry per quantized input (a linear: its input;
    experts: gate/up input, down input)."""

    masks: tuple | None  # (mask (G,) bool or None, ...)
    codes: tuple | None  # (RecordedCodes or None, ...)

    def mask(self, index):
        if self.masks is None:
            return None
        return self.masks[index]

    def code(self, index):
        if self.codes is None:
            return None
        return self.codes[index]


def select_codes(codes, rows, width):
    """The records of trainer rows `rows` (R',) int64 of `codes` (RecordedCodes), re-keyed as a
    forward on tokens[rows] (width W) sees them."""
    position = codes.keys // codes.n_experts
    expert = codes.keys % codes.n_experts
    row = position // width
    column = position % width
    largest_row = 0
    if row.numel():
        largest_row = int(row.max())
    if rows.numel():
        largest_row = max(largest_row, int(rows.max()))
    new_row = torch.full((largest_row + 1,), -1, dtype=torch.int64, device=codes.keys.device)
    new_row[rows] = torch.arange(rows.numel(), device=rows.device)  # -1: not selected
    row = new_row[row]
    index = (row >= 0).nonzero().squeeze(1)
    keys = (row[index] * width + column[index]) * codes.n_experts + expert[index]
    order = keys.argsort()
    index = index[order]
    return codes._replace(
        keys=keys[order],
        data=codes.data[index],
        block_scale=codes.block_scale[index],
        global_scale=codes.global_scale[index],
    )


# ------------------------------------------------------------------- trace: rollout-guided rounding
# The signed E2M1 grid, ascending: the 15 distinct values a code can take.
_SIGNED_GRID = tuple(sorted({s * v for v in nvfp4.E2M1_VALUES for s in (-1.0, 1.0)}))


def takes_rollout_code(scaled, rollout_value):
    """Bool mask: is the rollout's grid value (in E2M1 units) one of the grid points that bracket
    `scaled` (x in units of the rollout's block grid)? lo = the largest grid value <= s, hi = the
    smallest >= s (both s itself on a grid point; +-6 beyond the range); NaN never takes."""
    grid = torch.tensor(_SIGNED_GRID, dtype=torch.float32, device=scaled.device)
    scaled = scaled.contiguous()
    below = (torch.searchsorted(grid, scaled, right=True) - 1).clamp(min=0)
    above = torch.searchsorted(grid, scaled).clamp(max=len(_SIGNED_GRID) - 1)
    lo = grid[below]
    hi = grid[above]
    return ((rollout_value == lo) | (rollout_value == hi)) & ~torch.isnan(scaled)


@torch.no_grad()
def guided_values(x, codes, row_keys, own):
    """Rollout-guided rounding of the rows of x (M, K) that `codes` recorded (matched by row_keys
    (M,)). own: x's own fake-quantized values (M, K), returned with the guided rows replaced."""
    if codes is None or codes.keys.numel() == 0:
        return own
    # every row is looked up and computed, the rows without a record masked out at the end:
    # no host sync
    last = codes.keys.numel() - 1
    index = torch.searchsorted(codes.keys, row_keys).clamp(max=last)  # (M,)
    found = (codes.keys[index] == row_keys)[:, None]  # (M, 1)
    block_scale = codes.block_scale[index].float()  # (M, G)
    block_scale = block_scale.repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)  # (M, K)
    global_scale = codes.global_scale[index, None]  # (M, 1)
    unit = block_scale * global_scale  # the rollout's grid step
    rollout_codes = nvfp4.unpack_codes(codes.data[index])
    rollout_code_value = nvfp4.decode_e2m1(rollout_codes)  # (M, K), E2M1 units
    take = takes_rollout_code(x.float() / unit, rollout_code_value)
    take = take & (unit > 0) & torch.isfinite(unit) & found
    # nvfp4.dequantize's order of products: bit for bit the rollout's value
    rollout_value = rollout_code_value * block_scale * global_scale
    return torch.where(take, rollout_value, own.float()).to(own.dtype)


# -------------------------------------------------------------------- the activation rule, per mode
def quantize_input(x, mode, rac_mask=None, codes=None, row_keys=None, act_scale="tensor"):
    """A layer input x (M, K) as the symmetric modes see it, in the GEMM's dtype, straight-through
    to x: fq(x) (w4a4), with the rollout's RAC residual (moeresq), rollout-guided (trace). row_keys
    (M,): which trainer row each row of x is, to find its record (default 0..M-1)."""
    # the GEMM's dtype: under autocast BF16, as the rollout model's
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    with torch.no_grad():
        source = x.detach().to(dtype)
        if mode == "moeresq":
            values = nvfp4.fake_quantize_activation(source, rac_mask, act_scale).to(dtype)
        else:
            global_scale = nvfp4.activation_global_scale(source, act_scale)
            values = nvfp4.fake_quantize(source, global_scale)
        if mode == "trace":
            if row_keys is None:
                row_keys = torch.arange(x.shape[0], device=x.device)
            values = guided_values(source, codes, row_keys, values)
    return qat.straight_through(x, values)


def _check_mode(mode, act_scale):
    if mode not in MODES:
        raise ValueError(f"symmetric mode {mode!r}: choose one of {list(MODES)}")
    if act_scale not in nvfp4.ACT_SCALES:
        raise ValueError(f"act_scale {act_scale!r}: choose one of {list(nvfp4.ACT_SCALES)}")


def _check_share(layer, share, inputs):
    if layer.mode == "moeresq" and (share is None or share.masks is None):
        raise ValueError(
            f"{type(layer).__name__} in mode 'moeresq' has no RAC selection: hand it the rollout's "
            f"RAC masks, one per input {inputs}, through the model's hand_offs "
            "(symmetric.RolloutShare(masks=rac.rac_masks(rollout_model)).hand_offs(trainer))"
        )


# ----------------------------------------------------------------------------- the layers
class SymmetricLinear(qat.QATLinear):
    """qat.QATLinear whose input is quantized too: y = x_eff @ fq(W).T, x_eff from quantize_input.
    forward(x, share): share, a LayerShare (the rollout's mask and codes for this input), or
    None."""

    @classmethod
    def from_float(cls, linear, mode="w4a4", act_scale="tensor"):
        _check_mode(mode, act_scale)
        layer = super().from_float(linear)
        layer.mode = mode
        layer.act_scale = act_scale
        return layer

    def forward(self, x, share=None):
        _check_share(self, share, "(mask,)")
        rac_mask = None
        codes = None
        if share is not None:
            rac_mask = share.mask(0)
            codes = share.code(0)
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        x_eff = quantize_input(x2, self.mode, rac_mask, codes, None, self.act_scale)
        return super().forward(x_eff.view(x.shape))

    def extra_repr(self):
        return f"{super().extra_repr()}, mode={self.mode}, act_scale={self.act_scale}"


def _grouped_linear(x_sorted, routing, weight, grouped):
    """x_sorted (R, K) grouped by expert, weight (E, N, K) -> (R, N): rows of expert e times
    weight[e].T."""
    if grouped:
        return torch._grouped_mm(x_sorted, weight.transpose(-2, -1), offs=routing.offsets)
    outputs = []
    start = 0
    weights = weight.unbind(0)  # unbind: one gradient buffer, not one per expert
    for e, n in enumerate(routing.counts.tolist()):  # the slow twin: one host sync, a loop
        outputs.append(F.linear(x_sorted[start : start + n], weights[e]))
        start += n
    return torch.cat(outputs)


class SymmetricExperts(qat.QATExperts):
    """qat.QATExperts with both GEMM inputs quantized as the rollout quantizes them: x (T, D) before
    the gather (one global scale over the T tokens) and silu(gate) * up (R, I) over all R rows.
    forward(x, expert_ids, expert_weights, share): share, a LayerShare with (gate/up, down) entries
    (the down codes keyed by (row, expert)), or None."""

    @classmethod
    def from_float(cls, experts, mode="w4a4", act_scale="tensor"):
        _check_mode(mode, act_scale)
        layer = super().from_float(experts)
        layer.mode = mode
        layer.act_scale = act_scale
        return layer

    def forward(self, x, expert_ids, expert_weights, share=None):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) fp32 -> (T, D), as
        moe.Experts."""
        _check_share(self, share, "(gate_up mask, down mask)")
        if share is None:
            share = LayerShare(None, None)
        gate_up, down = qat.fake_quantize_weights(self.master_weights())  # (E, 2I, D), (E, D, I)
        routing = moe.route_tokens(expert_ids, self.n_experts)
        x_eff = quantize_input(
            x, self.mode, share.mask(0), share.code(0), None, self.act_scale
        )  # (T, D)
        dtype = x_eff.dtype
        gate_up = gate_up.to(dtype)
        down = down.to(dtype)
        x_sorted = x_eff[routing.token_ids]  # (R, D)
        grouped = moe.use_grouped_mm(x_sorted, down.shape[-1])
        gate_up_out = _grouped_linear(x_sorted, routing, gate_up, grouped)  # (R, 2I)
        gate, up = gate_up_out.chunk(2, dim=-1)  # (R, I) each
        down_keys = None
        if share.code(1) is not None:  # which (token, expert) pair each sorted row is
            sorted_experts = expert_ids.reshape(-1)[routing.order]
            down_keys = routing.token_ids * self.n_experts + sorted_experts
        hidden = quantize_input(
            F.silu(gate) * up, self.mode, share.mask(1), share.code(1), down_keys, self.act_scale
        )  # (R, I)
        y_sorted = _grouped_linear(hidden, routing, down, grouped)  # (R, D)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)

    def extra_repr(self):
        return f"mode={self.mode}, act_scale={self.act_scale}"


# ----------------------------------------------------------------------------- conversion
def convert_for_training(
    model, mode, act_scale="tensor", *, quantize_router=False, quantize_lm_head=False
):
    """Swap moe.py's layers (or qat.py's) for symmetric layers in mode `mode` (MODES) in place;
    returns the model. The same layers as qat.convert_for_training, the same Parameter objects;
    act_scale: the activations' global scale, per "tensor" or per "row", as the rollout's."""
    _check_mode(mode, act_scale)
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, moe.Experts):
            layer = SymmetricExperts.from_float(child, mode, act_scale)
        else:
            layer = SymmetricLinear.from_float(child, mode, act_scale)
        setattr(parent, name, layer)
    return model
