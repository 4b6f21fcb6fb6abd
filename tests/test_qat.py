"""qat.py: QAT layers use exactly nvfp4's weight rule (the rollout's weights; checked against a float64
oracle), gradients are straight-through to the master weights, weights follow every optimizer step, QAT
trains, the symmetric modes (w4a4; moeresq against the rollout layers' torch twins; trace's rounding rule
on hand-made cases and its recorder on a real rollout), conversion, and clear errors."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import raises_one_line, report_diff, same_bits, tiny_model

import moe
import nvfp4
import qat
import rac
import rollout


# ----------------------------------------------------------------------------------------------- helpers
def tokens(batch=4, length=16, seed=1):
    return torch.randint(64, (batch, length), generator=torch.Generator().manual_seed(seed))


def weight_rule(w):
    """What the rollout loads: dequantize(quantize_weight(w)) in w's dtype."""
    return nvfp4.dequantize(nvfp4.quantize_weight(w), w.dtype)


def oracle_weight_fake_quant(w):
    """NVFP4 weight fake quantization written from the format's definition, without nvfp4.py: one global
    scale per matrix (fp32 amax / 2688), block scales rounded to the nearest E4M3 value (ties to the even
    mantissa, from an enumerated table), unit = block_scale * global_scale in fp32, and the E2M1 code of
    |x| = the number of midpoints m * unit (fp32 products) it passes (at a midpoint: up iff the code below
    is odd, i.e. ties to even); value = code value * block_scale * global_scale, exact, rounded once to
    fp32, then to w's dtype; a zero keeps x's sign (E2M1 has a sign bit: -0.1 at a unit of 1 gives -0)."""
    e4m3 = [
        (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), m % 2 == 1)
        for e in range(16)
        for m in range(8)
        if not (e == 15 and m == 7)
    ]
    e4m3_values = torch.tensor([v for v, _ in e4m3], dtype=torch.float64)
    e4m3_odd = torch.tensor([odd for _, odd in e4m3])
    midpoints = [
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ]
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    out = []
    for m in w.detach().float().reshape(-1, *w.shape[-2:]):  # each (N, K) matrix
        global_scale = m.abs().max() / torch.tensor(2688.0)  # fp32
        blocks = m.reshape(m.shape[0], -1, 16)  # (N, G, 16)
        scale = (blocks.abs().amax(-1) / torch.tensor(6.0) / global_scale).clamp(0, 448).double()
        distance = (scale[..., None] - e4m3_values).abs()  # (N, G, 127)
        nearest = distance == distance.min(-1, keepdim=True).values  # one, or two at a tie
        nearest = torch.where(
            (nearest & ~e4m3_odd).any(-1, keepdim=True), nearest & ~e4m3_odd, nearest
        )
        block_scale = e4m3_values[nearest.float().argmax(-1)]  # (N, G)
        unit = (block_scale.float() * global_scale)[..., None]  # fp32 (N, G, 1)
        code = sum(
            ((blocks.abs() >= mid * unit) if up else (blocks.abs() > mid * unit)).long()
            for mid, up in midpoints
        )
        value = e2m1[code] * block_scale[..., None] * global_scale.double()  # exact in float64
        out.append(torch.copysign(value, blocks.double()).float().reshape(m.shape))
    return torch.stack(out).reshape(w.shape).to(w.dtype)


def random_experts(mode="qat", seed=0):
    torch.manual_seed(seed)
    experts = moe.Experts(moe.MoEConfig.from_preset("tiny"))
    nn.init.normal_(experts.gate_up_proj, std=0.2)
    nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(24, 64, requires_grad=True)
    # (T, A), distinct experts per token; expert 5 gets no token (an empty group)
    expert_ids = torch.tensor([0, 1, 2, 3, 4, 6, 7])[
        torch.stack([torch.randperm(7)[:2] for _ in range(24)])
    ]
    expert_weights = torch.rand(24, 2)
    return experts, qat.QATExperts.from_float(experts, mode), x, expert_ids, expert_weights


# ----------------------------------------------------------------------------------------------- the weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_qat_layer_uses_the_rollout_weight_rule_bit_for_bit(dtype):
    model = qat.convert_for_training(tiny_model(std=0.1).to(dtype), "qat")
    linears = [m for m in model.modules() if isinstance(m, qat.QATLinear)]
    experts = [m for m in model.modules() if isinstance(m, qat.QATExperts)]
    assert len(linears) == 4 * 2 and len(experts) == 2
    for layer in linears:
        assert same_bits(qat.quantized_weights(layer)[0], oracle_weight_fake_quant(layer.weight))
        assert not torch.equal(
            qat.quantized_weights(layer)[0], layer.weight
        )  # it really is quantized
        x = torch.randn(3, layer.in_features, dtype=dtype)
        assert torch.equal(
            layer(x), F.linear(x, qat.quantized_weights(layer)[0])
        )  # and the forward uses it
    for layer in experts:
        gate_up_q, down_q = qat.quantized_weights(layer)
        assert same_bits(gate_up_q, oracle_weight_fake_quant(layer.gate_up_proj))
        assert same_bits(down_q, oracle_weight_fake_quant(layer.down_proj))
        # one global scale per expert, as rac.py's stacked expert weights
        assert nvfp4.quantize_weight(layer.gate_up_proj).global_scale.shape == (layer.n_experts,)


def test_qat_experts_forward_is_moe_experts_with_the_quantized_weights():
    experts, qat_experts, x, ids, weights = random_experts()
    reference = copy.deepcopy(experts)
    with torch.no_grad():
        reference.gate_up_proj.copy_(weight_rule(experts.gate_up_proj))
        reference.down_proj.copy_(weight_rule(experts.down_proj))
    assert torch.equal(qat_experts(x, ids, weights), reference(x, ids, weights))


@pytest.mark.cuda
def test_cuda_triton_fake_quantized_weights_match_the_cpu_reference():
    model = qat.convert_for_training(tiny_model(std=0.1).cuda().bfloat16(), "qat")
    for layer in model.modules():
        if isinstance(layer, qat.QATLinear):
            pairs = [(qat.quantized_weights(layer)[0], layer.weight)]
        elif isinstance(layer, qat.QATExperts):
            pairs = zip(qat.quantized_weights(layer), (layer.gate_up_proj, layer.down_proj))
        else:
            continue
        for quantized, master in pairs:
            w = master.detach().cpu()
            expected = nvfp4.dequantize_reference(
                nvfp4.quantize_reference(w, nvfp4.weight_global_scale(w)), w.dtype
            )
            assert same_bits(quantized.cpu(), expected)


def test_trainer_weights_equal_rac_rollout_weights_after_sync():
    trainer = tiny_model(std=0.1)
    rollout = rac.convert_for_rollout(copy.deepcopy(trainer), "nvfp4")
    qat.convert_for_training(trainer, "qat")
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    trainer(tokens()).float().logsumexp(-1).mean().backward()
    optimizer.step()  # the rollout copy is stale now: sync_weights must bring it to the trainer's weights
    rac.sync_weights(rollout, trainer)

    trainer_blocks = [m for m in trainer.modules() if isinstance(m, moe.Block)]
    rollout_blocks = [m for m in rollout.modules() if isinstance(m, moe.Block)]
    assert len(trainer_blocks) == len(rollout_blocks) == 2
    for ours, theirs in zip(trainer_blocks, rollout_blocks):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layer = getattr(ours.attn, name)
            rollout_weight = getattr(theirs.attn, name).weight_q.dequantize(layer.weight.dtype)
            assert same_bits(qat.quantized_weights(layer)[0], rollout_weight), name
        gate_up_q, down_q = qat.quantized_weights(ours.mlp.experts)
        experts = theirs.mlp.experts
        assert same_bits(
            gate_up_q, rac.unchunk_experts(experts.gate_up_w).dequantize(gate_up_q.dtype)
        )
        assert same_bits(down_q, rac.unchunk_experts(experts.down_w).dequantize(down_q.dtype))


# ----------------------------------------------------------------------------------------------- gradients
def test_qat_linear_gradients_are_the_analytic_straight_through_ones():
    torch.manual_seed(0)
    layer = qat.QATLinear.from_float(nn.Linear(32, 48, bias=False))
    x = torch.randn(2, 5, 32, requires_grad=True)
    grad_y = torch.randn(2, 5, 48)
    layer(x).backward(grad_y)
    weight_q = qat.quantized_weights(layer)[0]
    # grad_W = grad_y.T @ x (to the master weight); grad_x = grad_y @ Wq (the weight the forward used)
    expected_grad_weight = grad_y.reshape(-1, 48).T @ x.detach().reshape(-1, 32)
    torch.testing.assert_close(layer.weight.grad, expected_grad_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad_y @ weight_q, rtol=1e-6, atol=1e-6)
    assert report_diff(x.grad, grad_y @ layer.weight.detach(), "grad_x via Wq vs via W")[0] > 0


def test_qat_experts_gradients_reach_the_master_weights_straight_through():
    _, qat_experts, x, ids, weights = random_experts()
    # Reference: plain moe.Experts math with the quantized weights as leaves; its weight gradients are
    # what a straight-through estimator must hand to the master weights.
    gate_up_q, down_q = (w.clone().requires_grad_() for w in qat.quantized_weights(qat_experts))
    reference = moe.Experts(moe.MoEConfig.from_preset("tiny"))
    del reference.gate_up_proj, reference.down_proj
    reference.gate_up_proj, reference.down_proj = gate_up_q, down_q
    x_ref = x.detach().clone().requires_grad_()
    grad_y = torch.randn(24, 64)
    qat_experts(x, ids, weights).backward(grad_y)
    reference(x_ref, ids, weights).backward(grad_y)
    assert torch.equal(qat_experts.gate_up_proj.grad, gate_up_q.grad)
    assert torch.equal(qat_experts.down_proj.grad, down_q.grad)
    assert torch.equal(x.grad, x_ref.grad)
    assert qat_experts.gate_up_proj.grad[5].abs().sum() == 0  # the unrouted expert gets none
    assert qat_experts.gate_up_proj.grad.abs().sum() > 0


def test_gradients_reach_every_master_weight_of_a_converted_model():
    model = qat.convert_for_training(tiny_model(std=0.1), "qat")
    model(tokens()).float().logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------------------ weight updates
@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2),  # foreach: bumps version counters
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),  # fused: does not
    ],
    ids=["sgd", "adamw", "adamw_fused"],
)
def test_the_forward_uses_the_weights_of_the_latest_optimizer_step(make_optimizer):
    model = tiny_model(std=0.1)
    optimizer = make_optimizer(
        model.parameters()
    )  # created before conversion: the parameters are reused
    qat.convert_for_training(model, "qat")
    layer = model.layers[0].attn.q_proj
    x = torch.randn(3, layer.in_features)
    before = layer(x)
    model(tokens()).float().logsumexp(-1).mean().backward()
    optimizer.step()
    after = layer(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, F.linear(x, weight_rule(layer.weight)))


def test_a_models_forward_fake_quantizes_each_weight_once_and_keeps_nothing(monkeypatch):
    model = qat.convert_for_training(tiny_model(std=0.1), "qat")
    qat.convert_for_training(model, "qat")  # converting again wraps nothing twice
    layer = model.layers[0].attn.q_proj
    before = {name: value for name, value in vars(layer).items() if not name.startswith("_")}
    calls = []
    monkeypatch.setattr(
        nvfp4,
        "fake_quantize_weight",
        lambda w, original=nvfp4.fake_quantize_weight: (calls.append(tuple(w.shape)), original(w))[
            1
        ],
    )
    batch = tokens()
    y = model(batch)
    assert len(calls) == 4 * 2 + 2 * 2  # the 12 weights, each once
    assert not model._forward_pre_hooks and not model._forward_hooks  # no hooks
    after = {name: value for name, value in vars(layer).items() if not name.startswith("_")}
    assert after.keys() == before.keys()  # nothing left on a layer by the forward
    layer = model.layers[0].attn.q_proj
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, weight_rule(layer.weight)))
    assert y.shape == (4, 16, 64)


def test_a_forward_under_inference_mode_does_not_break_the_next_training_step():
    model = qat.convert_for_training(tiny_model(std=0.1), "qat")
    with torch.inference_mode():
        model(tokens())  # e.g. scoring old log-probs before the first step
    model(tokens()).float().logsumexp(-1).mean().backward()
    assert model.layers[0].attn.q_proj.weight.grad is not None


# ----------------------------------------------------------------------------------------------- training
def train_losses(mode, steps=150):
    model = qat.convert_for_training(tiny_model(std=0.02), mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (
        torch.arange(33).repeat(4, 1) * torch.tensor([[1], [3], [5], [7]]) % 64
    )  # 4 learnable sequences
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_qat_trains_a_tiny_model_like_bf16():
    bf16, quantized = train_losses("bf16"), train_losses("qat")
    print(
        f"loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, qat {quantized[0]:.3f} -> {quantized[-1]:.3f}"
    )
    assert (
        abs(bf16[0] - quantized[0]) < 0.05
    )  # same start: fake quantization perturbs, does not break
    assert bf16[-1] < 0.1 * bf16[0]
    assert quantized[-1] < 0.1 * quantized[0] and quantized[-1] < 2 * bf16[-1] + 0.05


# ----------------------------------------------------------------------------------------------- w4a4
def test_w4a4_fake_quantizes_activations_with_a_straight_through_gradient():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    layer_qat = qat.QATLinear.from_float(linear, "qat")
    layer_w4a4 = qat.QATLinear.from_float(copy.deepcopy(linear), "w4a4")
    x = torch.randn(6, 64, requires_grad=True)
    y = layer_w4a4(x)
    x_q = nvfp4.fake_quantize(x.detach())
    assert torch.equal(y, F.linear(x_q, qat.quantized_weights(layer_w4a4)[0]))
    assert not torch.equal(y, layer_qat(x))
    grad_y = torch.randn(6, 32)
    y.backward(grad_y)
    # straight-through: grad_x = grad_y @ Wq as if x were not quantized; grad_W uses the quantized input
    torch.testing.assert_close(
        x.grad, grad_y @ qat.quantized_weights(layer_w4a4)[0], rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(layer_w4a4.weight.grad, grad_y.T @ x_q, rtol=1e-6, atol=1e-6)


def test_w4a4_experts_quantize_both_gemm_inputs():
    _, qat_experts, x, ids, weights = random_experts(mode="w4a4")
    gate_up_q, down_q = qat.quantized_weights(qat_experts)
    # Dense reference: every (token, expert) row; per-tensor activation scales over all rows.
    rows = x.detach()[torch.arange(24).repeat_interleave(2)]  # (R, D)
    experts_of_rows = ids.reshape(-1)
    h = torch.einsum("rd,rkd->rk", nvfp4.fake_quantize(rows), gate_up_q[experts_of_rows])  # (R, 2I)
    gate, up = h.chunk(2, dim=-1)
    hidden = nvfp4.fake_quantize(F.silu(gate) * up)
    out = torch.einsum("ri,rdi->rd", hidden, down_q[experts_of_rows]).view(24, 2, 64)
    expected = (weights.unsqueeze(-1) * out).sum(1)
    y = qat_experts(x, ids, weights)
    assert report_diff(y, expected, "w4a4 experts vs dense reference")[0] < 1e-5
    _, qat_only, _, _, _ = random_experts(mode="qat")
    assert report_diff(y, qat_only(x, ids, weights), "w4a4 vs qat")[0] > 1e-3
    y.sum().backward()
    assert x.grad is not None and qat_experts.gate_up_proj.grad.abs().sum() > 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this torch")
def test_w4a4_grouped_linear_matches_its_loop_twin_in_bf16():
    torch.manual_seed(0)
    weight = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    routing = moe.route_tokens(
        torch.tensor([0, 0, 2, 3])[torch.randint(4, (40, 1))], 4
    )  # expert 1 empty
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    fast = qat._grouped_linear(x, routing, weight, grouped=True)
    slow = qat._grouped_linear(x, routing, weight, grouped=False)
    assert report_diff(fast, slow, "grouped vs loop")[0] <= 1e-2 * slow.float().abs().max()


# ----------------------------------------------------------------------------------------------- conversion
def test_conversion_keeps_parameters_names_and_full_precision_layers():
    model = tiny_model(std=0.1, tie_embeddings=True)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert qat.convert_for_training(model, "bf16") is model
    assert not any(isinstance(m, (qat.QATLinear, qat.QATExperts)) for m in model.modules())
    qat.convert_for_training(model, "qat")
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects
    assert list(model.state_dict()) == keys
    assert type(model.layers[0].mlp.gate) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(model.embed) is nn.Embedding
    assert model.lm_head.weight is model.embed.weight

    qat.convert_for_training(model, "w4a4", quantize_router=True, quantize_lm_head=True)
    assert isinstance(model.layers[0].mlp.gate, qat.QATLinear) and isinstance(
        model.lm_head, qat.QATLinear
    )
    assert model.layers[0].attn.q_proj.mode == "w4a4" and model.layers[1].mlp.experts.mode == "w4a4"
    assert model.lm_head.weight is model.embed.weight
    assert (
        sum(isinstance(m, qat.QATLinear) for m in model.modules()) == 4 * 2 + 2 + 1
    )  # no double wrapping
    assert isinstance(
        model.layers[0].mlp.experts, moe.Experts
    )  # still an Experts, for isinstance users


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "unknown mode",
        lambda: qat.convert_for_training(tiny_model(std=0.1), mode="nvfp4"),
        "QAT mode 'nvfp4'",
        "choose a mode of ['bf16', 'qat', 'w4a4', 'moeresq', 'trace']",
    ),
    (
        "mode case",
        lambda: qat.convert_for_training(tiny_model(std=0.1), mode="QAT"),
        "'QAT'",
        "choose a mode of",
    ),
    (
        "act_scale",
        lambda: qat.convert_for_training(tiny_model(std=0.1), "w4a4", act_scale="col"),
        "act_scale 'col'",
        "an act_scale of ['tensor', 'row']",
    ),
    (
        "moeresq without the rollout's selection",
        lambda: qat.convert_for_training(tiny_model(std=0.1), "moeresq")(tokens()),
        "mode 'moeresq'",
        "has no RAC selection",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


# ----------------------------------------------------------------------------------------------- moeresq
def half_the_blocks(n_blocks, seed):
    mask = torch.zeros(n_blocks, dtype=torch.bool)
    mask[
        torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))[: n_blocks // 2]
    ] = True
    return mask


def test_moeresq_linear_equals_the_rollout_layers_torch_twin_to_accumulation_order():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    x = torch.randn(40, 64)
    x[:, 16:32] *= 30  # an outlier block: the residual matters
    mask = half_the_blocks(4, seed=1)
    rollout_layer = rac.NVFP4Linear.from_float(linear)
    expected = rac.nvfp4_linear_reference(
        x, rollout_layer.weight_q, mask
    )  # the rollout's twin, fp32
    trainer_layer = qat.QATLinear.from_float(copy.deepcopy(linear), "moeresq")
    with qat.sharing(trainer_layer, qat.SharedState(masks={"": (mask,)})):  # "": the layer itself
        y = trainer_layer(x)
    assert trainer_layer.rac_masks is None  # the masks were an argument of that call only
    scale = expected.abs().max().item()
    assert report_diff(y, expected, "moeresq vs rollout twin")[0] <= 1e-6 * scale
    # the compensation is really there: without it (w4a4) or without activation quantization (qat) the
    # trainer is far from the rollout
    naive = rac.nvfp4_linear_reference(x, rollout_layer.weight_q, None)
    assert report_diff(expected, naive, "rac vs naive rollout")[0] > 1e-3 * scale
    for mode in ("w4a4", "qat"):
        other = qat.QATLinear.from_float(copy.deepcopy(linear), mode)(x)
        assert report_diff(other, expected, f"{mode} vs rollout twin")[0] > 1e-3 * scale


def test_moeresq_experts_equal_the_rollout_experts_torch_twin_to_accumulation_order():
    experts, trainer_experts, x, ids, weights = random_experts(mode="moeresq")
    x = x.detach()
    x[:, :16] *= 20
    rollout_experts = rac.NVFP4Experts.from_float(experts, rac_ratio=0.5)
    # the rollout's own selection, calibrated from these inputs (as rac.calibrate_rac does)
    rollout_experts.rac_gate_up.start_calibration()
    rollout_experts.rac_down.start_calibration()
    expected = rollout_experts(x, ids, weights)  # CPU: the torch twin
    rollout_experts.rac_gate_up.finish_calibration()
    rollout_experts.rac_down.finish_calibration()
    masks = (rollout_experts.rac_gate_up.mask, rollout_experts.rac_down.mask)
    assert masks[1].any() and not masks[1].all()
    with qat.sharing(trainer_experts, qat.SharedState(masks={"": masks})):
        y = trainer_experts(x.requires_grad_(), ids, weights)
    scale = expected.abs().max().item()
    assert report_diff(y, expected, "moeresq experts vs rollout twin")[0] <= 1e-5 * scale
    naive = rac.NVFP4Experts.from_float(experts)(x.detach(), ids, weights)
    assert report_diff(naive, expected, "naive vs rac rollout")[0] > 1e-3 * scale
    y.sum().backward()  # straight-through: gradients reach the input and the master weights
    assert x.grad.abs().sum() > 0 and trainer_experts.down_proj.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------- trace
def recorded_and_used(x):
    return nvfp4.quantize(x), rac.quantize_activation_triton(x, codes=True).x_q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recorders_requantization_is_the_rollout_kernels_bit_for_bit(dtype, kernel_device):
    """trace records nvfp4.quantize(x) of each rollout layer input; the rollout's fused quantizer (under
    the Triton interpreter on the CPU) must have produced the same codes, block scales and global scale."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=dtype).to(kernel_device)
    x[:, 16:32] *= 40
    recorded, used = recorded_and_used(x)
    assert torch.equal(recorded.global_scale.reshape(()), used.global_scale.reshape(()))
    assert torch.equal(recorded.data, used.data)
    assert torch.equal(recorded.block_scale.view(torch.uint8), used.block_scale.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "rows", [64, 4096]
)  # a decode step (amax in the fused launch), a prefill (partials)
def test_cuda_the_recorders_requantization_is_the_rollout_kernels_bit_for_bit(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    x[:, 64:80] *= 40
    recorded, used = recorded_and_used(x)
    assert torch.equal(recorded.global_scale.reshape(()), used.global_scale.reshape(()))
    assert torch.equal(recorded.data, used.data)
    assert torch.equal(recorded.block_scale.view(torch.uint8), used.block_scale.view(torch.uint8))


def test_the_rollouts_code_is_taken_only_when_it_brackets_the_trainers_value():
    # scaled value s (x in units of the rollout's block grid), the rollout's grid value, taken?
    cases = [
        (2.49, 3.0, True),  # just below the 2.5 midpoint: own rounding says 2, the rollout's 3 wins
        (2.51, 2.0, True),  # just above it: own says 3, the rollout's 2 wins
        (2.49, 4.0, False),  # the rollout's value is more than a grid step away
        (3.0, 4.0, False),  # on a grid point: only that point brackets it
        (3.0, 3.0, True),
        (0.2, 0.5, True),
        (0.2, 0.0, True),
        (0.2, 1.0, False),
        (-0.3, -0.5, True),
        (-0.3, 0.0, True),
        (-0.3, 0.5, False),  # the grid is signed
        (7.5, 6.0, True),
        (-9.0, -6.0, True),
        (7.5, 4.0, False),  # beyond +-6: saturation only
        (float("nan"), 0.0, False),
    ]
    scaled = torch.tensor([c[0] for c in cases])
    rollout_value = torch.tensor([c[1] for c in cases])
    assert qat.takes_rollout_code(scaled, rollout_value).tolist() == [c[2] for c in cases]


def hand_made_codes(rollout_values, block_scale, global_scale, keys):
    """RolloutCodes of rows whose E2M1 values are given (rows, 16 * G)."""
    codes = nvfp4.encode_e2m1(rollout_values)  # exact grid values: their own codes
    return qat.RolloutCodes(
        keys=torch.tensor(keys),
        data=nvfp4.pack_codes(codes),
        block_scale=torch.full((len(keys), rollout_values.shape[1] // 16), block_scale).to(
            torch.float8_e4m3fn
        ),
        global_scale=torch.full((len(keys),), global_scale),
    )


def test_trace_rounds_to_the_rollouts_code_across_a_boundary_and_its_own_elsewhere():
    unit = 0.5 * 0.25  # block scale 0.5 (exact in E4M3) times global scale 0.25
    scaled = torch.tensor([2.49, 2.51, 2.49, 3.0, 0.7, -1.3, 5.2, 0.1] * 2)  # one block of 16
    rollout = torch.tensor([3.0, 2.0, 4.0, 4.0, 1.0, -1.5, 6.0, 0.0] * 2)
    x = torch.stack([scaled * unit, scaled * unit])  # rows 0 and 1
    codes = hand_made_codes(rollout[None], 0.5, 0.25, keys=[1])  # only row 1 recorded
    own = nvfp4.fake_quantize(x)
    out = qat.quantize_input(x, "trace", codes=codes)
    take = torch.tensor([True, True, False, False, True, True, True, True] * 2)
    assert torch.equal(out[0], own[0])  # row 0: not recorded
    assert torch.equal(out[1][take], rollout[take] * unit)  # the rollout's values
    assert torch.equal(out[1][~take], own[1][~take])  # its own rounding
    assert not torch.equal(
        own[1][:2], rollout[:2] * unit
    )  # rows 0-1 of the block really were flipped
    # straight-through gradient
    x.requires_grad_()
    qat.quantize_input(x, "trace", codes=codes).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("act_scale", ["tensor", "row"])
def test_trace_layer_takes_the_rollouts_exact_values_for_its_recorded_decode_tokens(act_scale):
    """A real rollout: the recorder keeps, per completion token, what the rollout's quantizer used. In
    layer 0 the q projection's input of a token depends on that token alone, so the trainer sees the same
    values as the rollout; with one global scale per tensor it quantizes the whole batch at another scale:
    rollout-guided rounding must give back exactly the rollout's dequantized values on every completion
    token, its own elsewhere. With one per row the trainer's own rounding already is the rollout's."""
    model = tiny_model(std=0.2)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", act_scale=act_scale)
    recorder = qat.RolloutRecorder(act_scale)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out = rollout.generate(
        rollout_model,
        prompts,
        3,
        6,
        eos_id=9,
        pad_id=0,
        seed=0,
        decode_context=lambda: rac.recording(rollout_model, recorder.record),
    )
    seq = out.sequences()
    B, W = seq.tokens.shape
    recorded = recorder.codes(out.completion_mask, out.prompt_lengths, W)
    codes = {"q": recorded["layers.0.attn.q_proj"], "e": recorded["layers.1.mlp.experts"]}
    n_tokens = int(out.completion_mask.sum())
    assert codes["q"][0].keys.numel() == n_tokens  # completion tokens only
    record = codes["q"][0]
    nbytes = sum(
        t.numel() * t.element_size()
        for t in (record.keys, record.data, record.block_scale, record.global_scale)
    )
    assert nbytes == n_tokens * (64 // 2 + 64 // 16 + 4 + 8)  # the docstring's bound

    trainer = qat.convert_for_training(copy.deepcopy(model), "trace", act_scale=act_scale)
    layer = trainer.layers[0].attn.q_proj
    seen = {}
    layer.register_forward_hook(lambda m, args, output: seen.update(x=args[0].reshape(-1, 64)))
    trainer(seq.tokens)
    x = seen["x"]  # (B * W, K)
    guided = qat.quantize_input(x, "trace", codes=codes["q"][0], act_scale=act_scale)
    own = qat.quantize_input(x, "w4a4", act_scale=act_scale)
    rows = codes["q"][0].keys
    q_codes = codes["q"][0]
    rollout_values = torch.cat(
        [
            nvfp4.dequantize(nvfp4.NVFP4Tensor(data, scale, global_scale), torch.float32)
            for data, scale, global_scale in zip(
                q_codes.data[:, None], q_codes.block_scale[:, None], q_codes.global_scale
            )
        ]
    )
    assert torch.equal(guided[rows], rollout_values)
    # the trainer's own rounding differs with another global scale, is the rollout's with the row's own
    assert torch.equal(own[rows], rollout_values) == (act_scale == "row")
    others = torch.ones(B * W, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(guided[others], own[others])
    # a mini-batch of the sequences (rows 3 and 0) sees the same rollout values on its completion tokens
    rows = torch.tensor([3, 0])
    sub = codes["q"][0].select_rows(rows, W)
    trainer(seq.tokens[rows])
    guided_sub = qat.quantize_input(seen["x"], "trace", codes=sub, act_scale=act_scale)
    old_keys = rows[sub.keys // W] * W + sub.keys % W
    assert sub.keys.numel() == int(seq.loss_mask[rows].sum())
    assert torch.equal(guided_sub[sub.keys], guided[old_keys])
    # the experts' down records are keyed by (position, expert) of the rollout's own routes
    down = codes["e"][1]
    position, expert = down.keys // 8, down.keys % 8
    b, w = position // W, position % W
    assert seq.loss_mask[b, w].all()
    assert (seq.routes[1, b, w] == expert[:, None]).any(-1).all()


def test_symmetric_modes_with_row_scales_quantize_each_row_as_if_alone():
    x = torch.randn(6, 64) * torch.logspace(-2, 2, 6)[:, None]  # rows of every size
    mask = torch.tensor([True, False, False, True])
    for mode, rac_mask in (("w4a4", None), ("moeresq", mask)):
        alone = torch.cat(
            [qat.quantize_input(row[None], mode, rac_mask) for row in x]
        )  # tensor = the row
        assert torch.equal(qat.quantize_input(x, mode, rac_mask, act_scale="row"), alone), mode
        assert not torch.equal(qat.quantize_input(x, mode, rac_mask), alone), mode


def test_layers_sharing_a_record_share_its_mini_batch_too():
    # q, k and v read one input and share one record; their mini-batch stays one object (selected once)
    trainer = qat.convert_for_training(tiny_model(), "trace")
    record = hand_made_codes(torch.arange(3.0)[:, None].repeat(1, 16), 1.0, 1.0, keys=[3, 8, 13])
    paths = [f"layers.0.attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]
    state = qat.SharedState(codes={path: (record,) for path in paths}).select_rows(
        torch.tensor([2, 0]), 5
    )
    picked = [state.codes[path][0] for path in paths]
    assert picked[0] is picked[1] is picked[2] and picked[0].keys.tolist() == [3, 8]
    layers = dict(trainer.named_modules())
    with qat.sharing(trainer, state):
        assert layers[paths[0]].rollout_codes[0] is picked[0]
    assert all(layers[path].rollout_codes is None for path in paths)


def test_a_mini_batch_of_rows_gets_its_own_rows_records_rekeyed():
    width, n_experts = 5, 4
    # records of rows 0, 1, 2: one per (row, column 3) for a linear input, two experts each for a down input
    linear = hand_made_codes(torch.arange(3.0)[:, None].repeat(1, 16), 1.0, 1.0, keys=[3, 8, 13])
    keys = torch.tensor([(r * width + 3) * n_experts + e for r in range(3) for e in (1, 2)])
    down = qat.RolloutCodes(
        keys,
        torch.arange(6, dtype=torch.uint8)[:, None].repeat(1, 8),
        torch.ones(6, 1).to(torch.float8_e4m3fn),
        torch.arange(6.0),
        n_experts,
    )
    rows = torch.tensor([2, 0])  # the mini-batch: row 2 first, then row 0
    picked = linear.select_rows(rows, width)
    assert picked.keys.tolist() == [3, 8]  # new row 0 (old 2) and new row 1 (old 0), column 3
    assert nvfp4.decode_e2m1(nvfp4.unpack_codes(picked.data))[:, 0].tolist() == [2.0, 0.0]
    picked = down.select_rows(rows, width)
    assert picked.keys.tolist() == [
        (0 * width + 3) * 4 + 1,
        (0 * width + 3) * 4 + 2,
        (1 * width + 3) * 4 + 1,
        (1 * width + 3) * 4 + 2,
    ]
    assert picked.global_scale.tolist() == [4.0, 5.0, 0.0, 1.0] and picked.n_experts == n_experts


@pytest.mark.parametrize("mode", ["qat", "w4a4"])
def test_weights_quantized_together_within_sharing_equal_each_layers_own(mode):
    """The batched weights of `sharing` (one multi-tensor amax) give the outputs and gradients of each
    layer quantizing its own weight, bit for bit; an optimizer step inside the block is seen."""
    torch.manual_seed(0)
    model = qat.convert_for_training(tiny_model(), mode)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    own = model(tokens)
    own.float().square().mean().backward()
    own_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with qat.sharing(model, None):
        shared = model(tokens)
        shared.float().square().mean().backward()
        assert torch.equal(own, shared)
        assert all(torch.equal(g, p.grad) for g, p in zip(own_grads, model.parameters()))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        after_step = model(tokens)
    assert torch.equal(after_step, model(tokens))
    assert not torch.equal(after_step, shared)
