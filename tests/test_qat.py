"""qat.py: QAT layers use exactly nvfp4's weight rule (the rollout's weights), gradients are
straight-through to the master weights, the per-step cache, QAT trains, the w4a4 alternative,
bf16_forward, conversion, and clear errors."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import report_diff

import moe
import nvfp4
import qat


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def one_thread():
    """These shapes are tiny: one thread is fastest, and immune to other processes on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed=0, std=0.1, **overrides):
    torch.manual_seed(seed)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", **{"max_seq_len": 64, **overrides}))
    model.init_weights(std=std)
    return model


def tokens(batch=4, length=16, seed=1):
    return torch.randint(64, (batch, length), generator=torch.Generator().manual_seed(seed))


def weight_rule(w):
    """What the rollout loads: dequantize(quantize_weight(w)) in w's dtype."""
    return nvfp4.dequantize(nvfp4.quantize_weight(w), w.dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def random_experts(mode="qat", rac_ratio=0.0, seed=0):
    torch.manual_seed(seed)
    experts = moe.Experts(moe.MoEConfig.from_preset("tiny"))
    nn.init.normal_(experts.gate_up_proj, std=0.2)
    nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(24, 64, requires_grad=True)
    # (T, A), distinct experts per token; expert 5 gets no token (an empty group)
    expert_ids = torch.tensor([0, 1, 2, 3, 4, 6, 7])[torch.stack([torch.randperm(7)[:2] for _ in range(24)])]
    expert_weights = torch.rand(24, 2)
    return experts, qat.QATExperts.from_float(experts, mode, rac_ratio), x, expert_ids, expert_weights


# ----------------------------------------------------------------------------------------------- the weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_qat_layer_uses_the_rollout_weight_rule_bit_for_bit(dtype):
    model = qat.convert_for_training(tiny_model().to(dtype), "qat")
    linears = [m for m in model.modules() if isinstance(m, qat.QATLinear)]
    experts = [m for m in model.modules() if isinstance(m, qat.QATExperts)]
    assert len(linears) == 4 * 2 and len(experts) == 2
    for layer in linears:
        assert same_bits(layer.quantized_weight(), weight_rule(layer.weight))
        assert not torch.equal(layer.quantized_weight(), layer.weight)  # it really is quantized
        x = torch.randn(3, layer.in_features, dtype=dtype)
        assert torch.equal(layer(x), F.linear(x, layer.quantized_weight()))  # and the forward uses it
    for layer in experts:
        gate_up_q, down_q = layer.quantized_weights()
        assert same_bits(gate_up_q, weight_rule(layer.gate_up_proj))
        assert same_bits(down_q, weight_rule(layer.down_proj))
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
    model = qat.convert_for_training(tiny_model().cuda().bfloat16(), "qat")
    for layer in model.modules():
        if isinstance(layer, qat.QATLinear):
            pairs = [(layer.quantized_weight(), layer.weight)]
        elif isinstance(layer, qat.QATExperts):
            pairs = zip(layer.quantized_weights(), (layer.gate_up_proj, layer.down_proj))
        else:
            continue
        for quantized, master in pairs:
            w = master.detach().cpu()
            expected = nvfp4.dequantize_reference(nvfp4.quantize_reference(w, nvfp4.weight_global_scale(w)), w.dtype)
            assert same_bits(quantized.cpu(), expected)


def test_trainer_weights_equal_rac_rollout_weights_after_sync():
    rac = pytest.importorskip("rac", reason="rac.py not landed yet: the trainer/rollout cross-check is pending")
    trainer = tiny_model()
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
            assert same_bits(layer.quantized_weight(), rollout_weight), name
        gate_up_q, down_q = ours.mlp.experts.quantized_weights()
        assert same_bits(gate_up_q, theirs.mlp.experts.gate_up_q.dequantize(gate_up_q.dtype))
        assert same_bits(down_q, theirs.mlp.experts.down_q.dequantize(down_q.dtype))


# ----------------------------------------------------------------------------------------------- gradients
def test_qat_linear_gradients_are_the_analytic_straight_through_ones():
    torch.manual_seed(0)
    layer = qat.QATLinear.from_float(nn.Linear(32, 48, bias=False))
    x = torch.randn(2, 5, 32, requires_grad=True)
    grad_y = torch.randn(2, 5, 48)
    layer(x).backward(grad_y)
    weight_q = layer.quantized_weight()
    # grad_W = grad_y.T @ x (to the master weight); grad_x = grad_y @ Wq (the weight the forward used)
    expected_grad_weight = grad_y.reshape(-1, 48).T @ x.detach().reshape(-1, 32)
    torch.testing.assert_close(layer.weight.grad, expected_grad_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad_y @ weight_q, rtol=1e-6, atol=1e-6)
    assert report_diff(x.grad, grad_y @ layer.weight.detach(), "grad_x via Wq vs via W")[0] > 0


def test_qat_experts_gradients_reach_the_master_weights_straight_through():
    _, qat_experts, x, ids, weights = random_experts()
    # Reference: plain moe.Experts math with the quantized weights as leaves; its weight gradients are
    # what a straight-through estimator must hand to the master weights.
    gate_up_q, down_q = (w.clone().requires_grad_() for w in qat_experts.quantized_weights())
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
    model = qat.convert_for_training(tiny_model(), "qat")
    model(tokens()).float().logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------------------------- the cache
def counting_fake_quantize_weight(monkeypatch):
    calls = []
    original = nvfp4.fake_quantize_weight

    def counted(w):
        calls.append(w.shape)
        return original(w)
    monkeypatch.setattr(nvfp4, "fake_quantize_weight", counted)
    return calls


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.AdamW(p, lr=1e-2),                       # foreach: bumps version counters
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),           # fused: does not, the step hook sees it
], ids=["sgd", "adamw", "adamw_fused"])
def test_cache_is_recomputed_after_an_optimizer_step_and_only_then(monkeypatch, make_optimizer):
    model = tiny_model()
    optimizer = make_optimizer(model.parameters())  # created before conversion: the parameters are reused
    qat.convert_for_training(model, "qat")
    calls = counting_fake_quantize_weight(monkeypatch)
    n_weights = 4 * 2 + 2 * 2  # q, k, v, o and gate_up, down in each of 2 layers

    loss = model(tokens()).float().logsumexp(-1).mean()
    assert len(calls) == n_weights
    before = [m.quantized_weight() for m in model.modules() if isinstance(m, qat.QATLinear)]
    loss.backward()
    with torch.no_grad():
        model(tokens(seed=2))  # another forward, grads accumulated, zero_grad: nothing changed the weights
    optimizer.zero_grad()
    assert len(calls) == n_weights

    model(tokens()).float().logsumexp(-1).mean().backward()
    optimizer.step()
    model(tokens())
    model(tokens())
    assert len(calls) == 2 * n_weights  # every weight once more, once
    linears = [m for m in model.modules() if isinstance(m, qat.QATLinear)]
    after = [m.quantized_weight() for m in linears]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, weight_rule(m.weight)) for a, m in zip(after, linears))


def test_cache_follows_load_state_dict_and_clear(monkeypatch):
    model = qat.convert_for_training(tiny_model(), "qat")
    layer = model.layers[0].attn.q_proj
    old = layer.quantized_weight()
    model.load_state_dict(tiny_model(seed=5).state_dict())  # in-place copy_: bumps the version counter
    assert torch.equal(layer.quantized_weight(), weight_rule(layer.weight))
    assert not torch.equal(layer.quantized_weight(), old)
    layer.weight.data.mul_(2)  # invisible to the version counter, by design of .data ...
    qat.clear_weight_cache(model)  # ... hence the explicit clear
    assert torch.equal(layer.quantized_weight(), weight_rule(layer.weight))


def test_cache_filled_under_inference_mode_still_trains():
    model = qat.convert_for_training(tiny_model(), "qat")
    with torch.inference_mode():
        model(tokens())  # e.g. scoring old log-probs before the first step
    model(tokens()).float().logsumexp(-1).mean().backward()
    assert model.layers[0].attn.q_proj.weight.grad is not None


# ----------------------------------------------------------------------------------------------- training
def train_losses(mode, steps=150):
    model = qat.convert_for_training(tiny_model(std=0.02), mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.arange(33).repeat(4, 1) * torch.tensor([[1], [3], [5], [7]]) % 64  # 4 learnable sequences
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
    print(f"loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, qat {quantized[0]:.3f} -> {quantized[-1]:.3f}")
    assert abs(bf16[0] - quantized[0]) < 0.05  # same start: fake quantization perturbs, does not break
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
    assert torch.equal(y, F.linear(x_q, layer_w4a4.quantized_weight()))
    assert not torch.equal(y, layer_qat(x))
    grad_y = torch.randn(6, 32)
    y.backward(grad_y)
    # straight-through: grad_x = grad_y @ Wq as if x were not quantized; grad_W uses the quantized input
    torch.testing.assert_close(x.grad, grad_y @ layer_w4a4.quantized_weight(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer_w4a4.weight.grad, grad_y.T @ x_q, rtol=1e-6, atol=1e-6)


def test_w4a4_residual_compensation_adds_fq_residual_on_the_highest_error_blocks():
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    x[:, 16:32] *= 0.01    # tiny block: its residual is tiny too
    x[:, 48:64] *= 20      # largest values and largest absolute errors
    x_q = nvfp4.fake_quantize(x)
    residual = x - x_q
    error = residual.abs().reshape(8, 4, 16).mean(dim=(0, 2))
    top2 = sorted(error.topk(2).indices.tolist())
    assert 3 in top2
    columns = torch.cat([torch.arange(16 * b, 16 * b + 16) for b in top2])
    expected = x_q.clone()
    expected[:, columns] += nvfp4.fake_quantize(residual[:, columns])
    compensated = qat.fake_quantize_activation(x, rac_ratio=0.5)
    assert torch.equal(compensated, expected)
    assert torch.equal(qat.fake_quantize_activation(x, rac_ratio=0.0), x_q)
    errors = [(qat.fake_quantize_activation(x, r) - x).norm().item() for r in (0.0, 0.25, 0.5, 1.0)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.3 * errors[0]
    x.requires_grad_()
    qat.fake_quantize_activation(x, rac_ratio=0.5).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight-through


def test_w4a4_experts_quantize_both_gemm_inputs():
    _, qat_experts, x, ids, weights = random_experts(mode="w4a4")
    gate_up_q, down_q = qat_experts.quantized_weights()
    # Dense reference: every (token, expert) row; per-tensor activation scales over all rows.
    rows = x.detach()[torch.arange(24).repeat_interleave(2)]                               # (R, D)
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
    routing = moe.route_tokens(torch.tensor([0, 0, 2, 3])[torch.randint(4, (40, 1))], 4)  # expert 1 empty
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    fast = qat._grouped_linear(x, routing, weight, grouped=True)
    slow = qat._grouped_linear(x, routing, weight, grouped=False)
    assert report_diff(fast, slow, "grouped vs loop")[0] <= 1e-2 * slow.float().abs().max()


# ----------------------------------------------------------------------------------------------- bf16_forward
def test_bf16_forward_restores_exact_full_precision_outputs_and_reenters_qat():
    model = tiny_model()
    batch = tokens()
    reference = model(batch)
    qat.convert_for_training(model, "w4a4", rac_ratio=0.5)
    quantized = model(batch)
    assert not torch.equal(quantized, reference)
    with qat.bf16_forward(model):
        assert torch.equal(model(batch), reference)
    assert torch.equal(model(batch), quantized)
    with pytest.raises(RuntimeError), qat.bf16_forward(model):
        raise RuntimeError("an error inside the block")
    assert torch.equal(model(batch), quantized)  # restored on the way out of an error too


# ----------------------------------------------------------------------------------------------- conversion
def test_conversion_keeps_parameters_names_and_full_precision_layers():
    model = tiny_model(tie_embeddings=True)
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
    assert isinstance(model.layers[0].mlp.gate, qat.QATLinear) and isinstance(model.lm_head, qat.QATLinear)
    assert model.layers[0].attn.q_proj.mode == "w4a4" and model.layers[1].mlp.experts.mode == "w4a4"
    assert model.lm_head.weight is model.embed.weight
    assert sum(isinstance(m, qat.QATLinear) for m in model.modules()) == 4 * 2 + 2 + 1  # no double wrapping
    assert isinstance(model.layers[0].mlp.experts, moe.Experts)  # still an Experts, for isinstance users


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="nvfp4"), "unknown QAT mode 'nvfp4'"),
    (dict(mode="QAT"), "choose one of"),
    (dict(mode="qat", rac_ratio=0.5), "only the 'w4a4' mode"),
    (dict(mode="w4a4", rac_ratio=1.5), "rac_ratio must be in"),
])
def test_bad_settings_raise_a_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qat.convert_for_training(tiny_model(), **kwargs)
