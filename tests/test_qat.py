"""qat.py: QAT layers use exactly nvfp4's weight rule (the rollout's weights; checked against a
float64 oracle), gradients are straight-through to the master weights, weights follow every
optimizer step, each layer quantizes its weights inside its own forward and keeps nothing, QAT
trains, and conversion keeps the parameters. The symmetric recipes built on these layers are tested
in test_symmetric.py."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import report_diff, same_bits, tiny_model

import moe
import nvfp4
import qat
import rac


# ------------------------------------------------------------------------------------------ helpers
def tokens(batch=4, length=16, seed=1):
    return torch.randint(64, (batch, length), generator=torch.Generator().manual_seed(seed))


def weight_rule(w):
    """What the rollout loads: dequantize(quantize_weight(w)) in w's dtype."""
    return nvfp4.dequantize(nvfp4.quantize_weight(w), w.dtype)


def oracle_weight_fake_quant(w):
    """NVFP4 weight fake quantization written from the format's definition, without nvfp4.py: one
    global scale per matrix (fp32 amax / 2688), block scales rounded to the nearest E4M3 value (ties
    to the even mantissa, from an enumerated table), unit = block_scale * global_scale in fp32, and
    the E2M1 code of |x| = the number of midpoints m * unit (fp32 products) it passes (at a
    midpoint: up iff the code below is odd, i.e. ties to even); value = code value * block_scale *
    global_scale, exact, rounded once to fp32, then to w's dtype; a zero keeps x's sign (E2M1 has a
    sign bit: -0.1 at a unit of 1 gives -0)."""
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


def random_experts(seed=0):
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
    return experts, qat.QATExperts.from_float(experts), x, expert_ids, expert_weights


# -------------------------------------------------------------------------------------- the weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_qat_layer_uses_the_rollout_weight_rule_bit_for_bit(dtype):
    model = qat.convert_for_training(tiny_model(std=0.1).to(dtype))
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
    model = qat.convert_for_training(tiny_model(std=0.1).cuda().bfloat16())
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
    qat.convert_for_training(trainer)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    trainer(tokens()).float().logsumexp(-1).mean().backward()
    # the rollout copy is stale now: sync_weights must bring it to the trainer's weights
    optimizer.step()
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


# ---------------------------------------------------------------------------------------- gradients
def test_qat_linear_gradients_are_the_analytic_straight_through_ones():
    torch.manual_seed(0)
    layer = qat.QATLinear.from_float(nn.Linear(32, 48, bias=False))
    x = torch.randn(2, 5, 32, requires_grad=True)
    grad_y = torch.randn(2, 5, 48)
    layer(x).backward(grad_y)
    weight_q = qat.quantized_weights(layer)[0]
    # grad_W = grad_y.T @ x (to the master weight); grad_x = grad_y @ Wq (the weight the forward
    # used)
    expected_grad_weight = grad_y.reshape(-1, 48).T @ x.detach().reshape(-1, 32)
    torch.testing.assert_close(layer.weight.grad, expected_grad_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad_y @ weight_q, rtol=1e-6, atol=1e-6)
    assert report_diff(x.grad, grad_y @ layer.weight.detach(), "grad_x via Wq vs via W")[0] > 0


def test_qat_experts_gradients_reach_the_master_weights_straight_through():
    _, qat_experts, x, ids, weights = random_experts()
    # Reference: plain moe.Experts math with the quantized weights as leaves; its weight gradients
    # are what a straight-through estimator must hand to the master weights.
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
    model = qat.convert_for_training(tiny_model(std=0.1))
    model(tokens()).float().logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------------- weight updates
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
    qat.convert_for_training(model)
    layer = model.layers[0].attn.q_proj
    x = torch.randn(3, layer.in_features)
    before = layer(x)
    model(tokens()).float().logsumexp(-1).mean().backward()
    optimizer.step()
    after = layer(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, F.linear(x, weight_rule(layer.weight)))


def test_a_models_forward_fake_quantizes_each_weight_once_and_keeps_nothing(monkeypatch):
    model = qat.convert_for_training(tiny_model(std=0.1))
    qat.convert_for_training(model)  # converting again wraps nothing twice
    layer = model.layers[0].attn.q_proj
    before = {name: value for name, value in vars(layer).items() if not name.startswith("_")}
    calls = []
    original = nvfp4.fake_quantize

    def counting(w, *args, **kwargs):
        calls.append(tuple(w.shape))
        return original(w, *args, **kwargs)

    monkeypatch.setattr(nvfp4, "fake_quantize", counting)
    y = model(tokens())
    assert len(calls) == 4 * 2 + 2 * 2  # the 12 weights (8 projections, 2 x 2 expert stacks), once
    calls.clear()
    model(tokens())
    assert len(calls) == 12  # and again on the next forward: nothing is cached between forwards
    assert not model._forward_pre_hooks and not model._forward_hooks  # no hooks
    after = {name: value for name, value in vars(layer).items() if not name.startswith("_")}
    assert after.keys() == before.keys()  # nothing left on a layer by the forward
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, weight_rule(layer.weight)))
    assert y.shape == (4, 16, 64)


def test_weights_quantized_together_equal_each_weights_own_rule_with_its_gradient():
    """fake_quantize_weights (one amax launch for a layer's matrices) is nvfp4.fake_quantize_weight
    of each, bit for bit, and hands each master weight the identity gradient."""
    torch.manual_seed(0)
    dense = (torch.randn(48, 64) * 0.1).requires_grad_()
    stack = (torch.randn(4, 32, 64) * torch.logspace(-2, 1, 4)[:, None, None]).requires_grad_()
    together = qat.fake_quantize_weights([dense, stack])
    assert same_bits(together[0], nvfp4.fake_quantize_weight(dense.detach()))
    assert same_bits(together[1], nvfp4.fake_quantize_weight(stack.detach()))
    grads = (torch.randn(48, 64), torch.randn(4, 32, 64))
    torch.autograd.backward(together, grads)
    assert torch.equal(dense.grad, grads[0]) and torch.equal(stack.grad, grads[1])


def test_a_forward_under_inference_mode_does_not_change_the_next_training_step():
    model = qat.convert_for_training(tiny_model(std=0.1))
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        model(tokens())  # e.g. scoring old log-probs before the first step
    model(tokens()).float().logsumexp(-1).mean().backward()
    twin(tokens()).float().logsumexp(-1).mean().backward()  # the same step, without it
    for (name, param), twin_param in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param.grad, twin_param.grad), name


# ----------------------------------------------------------------------------------------- training
def train_losses(quantized, steps=150):
    model = tiny_model(std=0.02)
    if quantized:
        qat.convert_for_training(model)
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
    bf16 = train_losses(quantized=False)
    quantized = train_losses(quantized=True)
    print(
        f"loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, qat {quantized[0]:.3f} -> {quantized[-1]:.3f}"
    )
    assert (
        abs(bf16[0] - quantized[0]) < 0.05
    )  # same start: fake quantization perturbs, does not break
    assert bf16[-1] < 0.1 * bf16[0]
    assert quantized[-1] < 0.1 * quantized[0] and quantized[-1] < 2 * bf16[-1] + 0.05


# --------------------------------------------------------------------------------------------- w4a4


# --------------------------------------------------------------------------------------- conversion
def test_conversion_keeps_parameters_names_and_full_precision_layers():
    model = tiny_model(std=0.1, tie_embeddings=True)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    qat.convert_for_training(model)
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects
    assert list(model.state_dict()) == keys
    assert type(model.layers[0].mlp.gate) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(model.embed) is nn.Embedding
    assert model.lm_head.weight is model.embed.weight
    qat.convert_for_training(model, quantize_router=True, quantize_lm_head=True)
    assert isinstance(model.layers[0].mlp.gate, qat.QATLinear)
    assert isinstance(model.lm_head, qat.QATLinear)
    assert model.lm_head.weight is model.embed.weight
    # 8 projections, 2 routers, the head: no double wrapping
    assert sum(isinstance(m, qat.QATLinear) for m in model.modules()) == 4 * 2 + 2 + 1
    # still an Experts, for isinstance users
    assert isinstance(model.layers[0].mlp.experts, moe.Experts)


def test_a_mode_passed_as_before_is_refused_not_taken_for_a_flag():
    with pytest.raises(TypeError):
        qat.convert_for_training(tiny_model(std=0.1), "qat")
