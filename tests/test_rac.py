"""rac.py: the choice of path per GPU and the Blackwell kernels' guard, the experts' weight layout,
residual activation compensation (block selection, calibration, the error it removes), q/k/v sharing
one quantization and one GEMM, the experts' fast path against their reference and moe.py, model
conversion, weight sync against the QAT weight rule, and clear errors. The kernels themselves:
tests/test_kernels_w4a4_*.py."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import (
    HAS_TRITON,
    bits,
    raises_one_line,
    relative_error,
    report_diff,
    same_bits,
    tiny_model,
)

import fp8
import moe
import nvfp4
import qat
import rac


def _outlier_activations(rows, cols, seed, device="cpu", dtype=torch.bfloat16):
    """Heavy-tailed activations with a fixed set of outlier channels (as a real layer input has)."""
    generator = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(0.5 * torch.randn(cols, generator=generator))
    channel_scale[torch.randperm(cols, generator=generator)[: max(1, cols // 32)]] *= 20.0

    def batch():
        t = torch.distributions.StudentT(4.0).sample((rows, cols)) * channel_scale
        return t.to(device, dtype)

    return batch


def _routing_with_empty_experts(n_experts, tokens, active, device, seed=0):
    """Random top-A routes that never pick experts 0, 2 and the last one (they receive no
    tokens)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in (0, 2, n_experts - 1)])
    scores = torch.rand(tokens, allowed.numel(), generator=generator)
    expert_ids = allowed[scores.topk(active, dim=-1).indices].to(device)
    return expert_ids, moe.route_tokens(expert_ids, n_experts)


# =================================================================== the one place a path is chosen
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_backend_is_chosen_once_per_gpu_by_its_capability(monkeypatch):
    # an A100 (8.0) cannot compile the kernels' E4M3 conversions: the NVFP4 layers run the
    # references there, and say so once per GPU, instead of failing inside the kernel compiler;
    # sm_89 / sm_90 take the Gluon experts (the Triton ones under the interpreter); Blackwell runs
    # its native check once, and falls back to the Triton kernels when it fails
    checks = []
    monkeypatch.setattr(
        rac.w4a4_blackwell, "disagreement", lambda device: checks.append(device) or problem
    )
    gluon, problem = "gluon" if rac.w4a4_experts_gluon is not None else "triton", None
    for capability, interpret, problem, expected, warning in (
        ((8, 0), False, None, "reference", "this GPU: 8.0"),
        ((8, 6), False, None, "reference", "this GPU: 8.6"),
        ((8, 9), False, None, gluon, None),
        ((9, 0), False, None, gluon, None),
        ((9, 0), True, None, "triton", None),
        (
            (10, 0),
            False,
            "the native FP4 dense GEMM failed",
            "triton",
            "the native FP4 dense GEMM failed; using the Hopper kernels",
        ),
        ((10, 0), False, None, "native", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr(rac.w4a4_quantize, "INTERPRET", interpret)
        monkeypatch.setattr(rac, "_BACKENDS", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [rac.backend(torch.device("cuda", 0)) for _ in range(3)] == [expected] * 3, (
                capability
            )
        messages = [str(w.message) for w in caught]
        assert len(messages) == (1 if warning else 0), (capability, messages)
        if warning:
            assert warning in messages[0] and "\n" not in messages[0], messages
            assert expected != "reference" or "8.9+" in messages[0]
    assert len(checks) == 2  # only Blackwell runs the check, once per device
    assert (
        rac.backend(torch.device("cpu")) == "reference" and rac.use_triton(torch.zeros(1)) is False
    )


def test_experts_take_the_gluon_kernel_only_where_the_backend_says_so(monkeypatch, kernel_device):
    launched = []
    fake_gluon = type(
        "Gluon", (), {"grouped_matmul": lambda *args, **kwargs: launched.append("gluon")}
    )
    monkeypatch.setattr(rac, "w4a4_experts_gluon", fake_gluon, raising=False)
    act = rac.quantize_activation_triton(torch.randn(4, 64, device=kernel_device))
    for path, K, expected in (("gluon", 64, ["gluon"]), ("gluon", 96, []), ("triton", 64, [])):
        monkeypatch.setattr(rac, "backend", lambda device: path)
        launched.clear()
        w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 16, K, device=kernel_device)))
        act = rac.quantize_activation_triton(torch.randn(4, K, device=kernel_device))
        rac.grouped_matmul_triton(act, w, torch.tensor([4, 0], device=kernel_device))
        assert launched == expected, (path, K)
    # prefill-sized calls (from 2,048 tokens on, the layer's count or else the rows) take Triton's
    for tokens, expected in (
        (None, ["gluon"]),
        (1024, ["gluon"]),
        (2047, ["gluon"]),
        (2048, []),
        (4096, []),
    ):
        monkeypatch.setattr(rac, "backend", lambda device: "gluon")
        launched.clear()
        w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 16, 64, device=kernel_device)))
        act = rac.quantize_activation_triton(torch.randn(4, 64, device=kernel_device))
        rac.grouped_matmul_triton(act, w, torch.tensor([4, 0], device=kernel_device), tokens=tokens)
        assert launched == expected, tokens


# ============================================================================ RAC
def test_rac_reduces_output_error_monotonically_on_outlier_channels():
    """Inputs with heavy tails and fixed outlier channels; blocks calibrated on one batch, measured
    on another. Asserted margin: ratio 0.5 at most half of naive NVFP4's error (seen: about
    0.25-0.3)."""
    torch.manual_seed(0)
    batch = _outlier_activations(64, 256, seed=0, dtype=torch.float32)
    calibration, x = batch(), batch()
    w_q = nvfp4.quantize_weight(torch.randn(96, 256))
    exact = (
        x @ w_q.dequantize(torch.float32).T
    )  # the same weights: only the activation error is measured
    errors = []
    for ratio in (0.0, 0.25, 0.5, 0.75, 1.0):
        selector = rac.RACSelector(16, ratio)
        selector.start_calibration()
        selector(calibration)
        selector.finish_calibration()
        errors.append(relative_error(rac.nvfp4_linear_reference(x, w_q, selector(x)), exact))
    print("relative error by rac_ratio 0, .25, .5, .75, 1:", [f"{e:.4f}" for e in errors])
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[2] < 0.5 * errors[0]


def test_selector_picks_the_highest_error_blocks_and_calibrate_rac_refreshes_them():
    selector = rac.RACSelector(8, 0.25)  # round(0.25 * 8) = 2 blocks
    x = torch.randn(32, 128)
    x[:, 16 * 5 + 3] *= 40.0  # blocks 5 and 2 hold large values
    x[:, 16 * 2 : 16 * 3] *= 10.0
    mask = selector(x)  # never calibrated: the first input decides
    assert mask.tolist() == [i in (2, 5) for i in range(8)]
    x2 = torch.randn(32, 128)
    x2[:, 16 * 7 :] *= 30.0
    assert selector(x2).tolist() == mask.tolist()  # frozen after its first input

    model = tiny_model(vocab_size=48)
    rollout = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", rac_ratio=0.5)
    selectors = [m for m in rollout.modules() if isinstance(m, rac.RACSelector)]
    # per layer: the q/k/v input (one selector, shared), o's input and the experts' two GEMM inputs
    assert len(selectors) == 2 * (2 + 2)
    rac.calibrate_rac(rollout, _tokens())
    for s in selectors:
        assert s.calibrated and int(s.mask.sum()) == s.n_selected == int(0.5 * s.n_blocks + 0.5)
    for s in selectors:
        s.set_ratio(0.25)
    rac.calibrate_rac(rollout, _tokens())
    assert all(int(s.mask.sum()) == int(0.25 * s.n_blocks + 0.5) for s in selectors)


# ============================================================================ conversion and sync
def _tokens(batch=2, length=12):
    return torch.randint(0, 48, (batch, length), generator=torch.Generator().manual_seed(1))


def _shared_attention(device):
    model = tiny_model(vocab_size=48).to(device, torch.bfloat16)
    attention = rac.convert_for_rollout(model, "nvfp4", rac_ratio=0.5).layers[0].attn
    return attention, (attention.q_proj, attention.k_proj, attention.v_proj)


def _count_calls(monkeypatch, name):
    calls, original = [], getattr(rac, name)
    monkeypatch.setattr(
        rac, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    )
    return calls


@torch.no_grad()
def test_q_k_v_quantize_their_one_input_once_and_equal_unshared_layers(monkeypatch):
    attention, layers = _shared_attention("cpu")
    assert isinstance(attention, rac.NVFP4Attention)
    assert (
        layers[1].rac is layers[0].rac and layers[2].rac is layers[0].rac
    )  # one input, one selector
    calls = _count_calls(monkeypatch, "quantize_activation_reference")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, layers[0].in_features, generator=generator).bfloat16()
    mask = layers[0].rac(x.reshape(-1, x.shape[-1]))  # calibrates the shared selector on x
    calls.clear()
    outputs = attention.project_qkv(x)
    assert len(calls) == 1  # one quantization of x for the three
    for layer, y in zip(layers, outputs):  # each layer's own computation
        expected = rac.nvfp4_linear_reference(x.reshape(-1, x.shape[-1]), layer.weight_q, mask)
        assert same_bits(y, expected.to(x.dtype).view(*x.shape[:-1], -1))
        assert same_bits(layer(x), y)  # the layer alone computes the same
    # nothing is kept between calls: another input gives its own outputs
    x2 = x * 2
    calls.clear()
    outputs = attention.project_qkv(x2)
    assert len(calls) == 1
    expected = rac.nvfp4_linear_reference(x2.reshape(-1, x.shape[-1]), layers[1].weight_q, mask)
    assert same_bits(outputs[1], expected.to(x.dtype).view(*x.shape[:-1], -1))


def _check_one_stacked_gemm(monkeypatch, attention, layers, x, gemms_expected):
    mask = layers[0].rac(x)
    gemms = _count_calls(monkeypatch, "layer_matmul")
    quantizations = _count_calls(monkeypatch, "quantize_activation_triton")
    outputs = attention.project_qkv(x)
    assert (len(gemms), len(quantizations)) == (gemms_expected, 1)
    for layer, y in zip(layers, outputs):  # each layer's own twin
        reference = rac.nvfp4_linear_reference(x.float(), layer.weight_q, mask)
        assert y.is_contiguous() and relative_error(y, reference) < 1e-2


@torch.no_grad()
def test_q_k_v_run_as_one_stacked_gemm_that_follows_weight_reloads(monkeypatch, kernel_device):
    attention, layers = _shared_attention(kernel_device)
    monkeypatch.setattr(
        rac, "use_triton", lambda x: True
    )  # the CUDA path, here under the interpreter
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, layers[0].in_features, generator=generator).to(kernel_device, torch.bfloat16)
    _check_one_stacked_gemm(monkeypatch, attention, layers, x, 1)
    # the layers' buffers are views of the stacked weight: a reload (sync_weights) lands in it
    layers[1].load_weight(
        torch.randn(layers[1].out_features, layers[1].in_features, generator=generator).to(
            kernel_device
        )
        * 100
    )
    _check_one_stacked_gemm(monkeypatch, attention, layers, x.clone(), 1)
    # a buffer replaced (the layer moved, say): the layers run one by one, still correct
    layers[2].weight_data = layers[2].weight_data.clone()
    with pytest.warns(UserWarning, match="no longer views of their stacked weight"):
        _check_one_stacked_gemm(monkeypatch, attention, layers, x.clone(), 3)


@pytest.mark.cuda
@torch.no_grad()
def test_q_k_v_share_the_triton_quantization_and_gemm_on_gpu(monkeypatch):
    attention, layers = _shared_attention("cuda")
    for rows in (1, 96):  # one row (no use case, but it must work) and a batch
        _check_one_stacked_gemm(
            monkeypatch,
            attention,
            layers,
            torch.randn(rows, layers[0].in_features, device="cuda", dtype=torch.bfloat16),
            1,
        )


@torch.no_grad()
def test_convert_for_rollout_logits_bf16_identical_fp8_closer_than_nvfp4():
    model, tokens = tiny_model(vocab_size=48), _tokens()
    reference = model(tokens)
    errors = {}
    for mode, ratio in (("bf16", 0.0), ("fp8", 0.0), ("nvfp4", 0.0), ("nvfp4", 0.5)):
        rollout = rac.convert_for_rollout(copy.deepcopy(model), mode, rac_ratio=ratio)
        if mode != "bf16":
            attention, block = rollout.layers[0].attn, rollout.layers[0].mlp
            linear_type = rac.NVFP4Linear if mode == "nvfp4" else fp8.FP8Linear
            projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
            assert all(isinstance(p, linear_type) for p in projections)
            assert isinstance(
                block.experts, rac.NVFP4Experts if mode == "nvfp4" else fp8.FP8Experts
            )
            assert (
                type(block.gate) is nn.Linear and type(rollout.lm_head) is nn.Linear
            )  # stay full precision
        errors[(mode, ratio)] = relative_error(rollout(tokens), reference)
    print("relative logit error vs the unconverted model:", errors)
    assert errors[("bf16", 0.0)] == 0.0
    # NVFP4 on a 64-wide model: per-tensor activation scales are coarse, and 2 layers compound them
    assert 0 < 2 * errors[("fp8", 0.0)] < errors[("nvfp4", 0.0)] < 0.3
    assert errors[("nvfp4", 0.5)] < errors[("nvfp4", 0.0)]

    rollout = rac.convert_for_rollout(
        copy.deepcopy(model), "nvfp4", quantize_router=True, quantize_lm_head=True
    )
    assert isinstance(rollout.layers[0].mlp.gate, rac.NVFP4Linear)
    assert isinstance(rollout.lm_head, rac.NVFP4Linear)


def _assert_rollout_weights_are_the_qat_weights(rollout, trainer):
    masters = dict(trainer.named_parameters())
    checked = 0
    for path, module in rollout.named_modules():
        if isinstance(module, rac.NVFP4Linear):
            pairs = [(module.weight_q, masters[f"{path}.weight"])]
        elif isinstance(module, rac.NVFP4Experts):
            pairs = [
                (rac.unchunk_experts(module.gate_up_w), masters[f"{path}.gate_up_proj"]),
                (rac.unchunk_experts(module.down_w), masters[f"{path}.down_proj"]),
            ]
        else:
            continue
        for quantized, master in pairs:
            with torch.no_grad():
                assert same_bits(
                    quantized.dequantize(master.dtype), nvfp4.fake_quantize_weight(master)
                ), path
            checked += 1
    assert checked == 2 * (4 + 2)
    for name, param in rollout.named_parameters():  # norms, embeddings, routers, LM head: copied
        assert torch.equal(param, masters[name]), name


@torch.no_grad()
def test_the_twin_path_dequantizes_a_weight_again_whenever_it_is_loaded():
    torch.manual_seed(0)
    layer = rac.NVFP4Linear.from_float(nn.Linear(64, 24, bias=False))
    x = torch.randn(5, 64)

    def twin():  # dequantizes the weight itself, every call
        return rac.nvfp4_linear_reference(x, layer.weight_q)

    first = layer(x)
    assert same_bits(first, twin()) and same_bits(layer(x), first)
    layer.load_weight(torch.randn(24, 64))  # what sync_weights does
    assert same_bits(layer(x), twin()) and not torch.equal(layer(x), first)
    # a write that is not a weight load (no load_weight, no state dict) asks for clear() explicitly
    layer.weight_global_scale.mul_(2.0)
    layer.weight_fp32.clear()
    assert same_bits(layer(x), twin())
    # a state dict is a weight load: the kept DQ(W) goes with the old codes
    other = rac.NVFP4Linear.from_float(nn.Linear(64, 24, bias=False))
    layer.load_state_dict(other.state_dict())
    assert same_bits(layer(x), other(x)) and same_bits(layer(x), twin())
    # a whole model: a sync after the trainer's weights moved gives what a fresh conversion gives
    model, tokens = tiny_model(vocab_size=48), _tokens()
    rollout = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")
    before = rollout(tokens)
    for param in model.parameters():
        param.mul_(1.5)
    rac.sync_weights(rollout, model)
    after = rollout(tokens)
    assert same_bits(after, rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")(tokens))
    assert not torch.equal(after, before)


# ================================================================== the error sources: w4a16, w16a4
def _oracle_w16a4(x, w, mask, act_scale):
    """Each row quantized alone (per row) or the tensor at once, then a float64 product with w
    itself."""
    rows = (
        [nvfp4.fake_quantize_activation(r[None], mask) for r in x]
        if act_scale == "row"
        else [nvfp4.fake_quantize_activation(x, mask)]
    )
    return (torch.cat(rows).double() @ w.double().T).float()


@pytest.mark.parametrize("act_scale", ["tensor", "row"])
def test_w16a4_layer_is_the_fake_quantized_input_times_the_full_precision_weight(act_scale):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    x = _outlier_activations(6, 64, seed=1, dtype=torch.float32)()
    layer = rac.NVFP4Linear.from_float(linear, rac_ratio=0.5, mode="w16a4", act_scale=act_scale)
    mask = layer.rac(x)  # calibrated on x: half of the 4 blocks
    assert int(mask.sum()) == 2
    expected = _oracle_w16a4(x, linear.weight.detach(), mask, act_scale)
    assert report_diff(layer(x), expected, "w16a4 vs oracle")[0] <= 1e-5 * expected.abs().max()
    quantized = rac.NVFP4Linear.from_float(linear, rac_ratio=0.5, act_scale=act_scale)(
        x
    )  # W4A4 differs
    assert (quantized - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("mode", ["w4a16", "w16a4"])
def test_weight_only_and_activation_only_experts_equal_moe_with_one_operand_quantized(mode):
    torch.manual_seed(0)
    experts, x = moe.Experts(moe.MoEConfig.from_preset("tiny")), torch.randn(10, 64)
    nn.init.normal_(experts.gate_up_proj, std=0.2), nn.init.normal_(experts.down_proj, std=0.2)
    ids, weights = torch.rand(10, experts.n_experts).topk(2, dim=-1).indices, torch.rand(10, 2)
    layer = rac.NVFP4Experts.from_float(experts, mode=mode)
    reference = copy.deepcopy(experts)
    fq = nvfp4.fake_quantize_activation
    if mode == "w4a16":  # moe.py's experts with DQ(W): the activations untouched
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                getattr(reference, name).copy_(nvfp4.fake_quantize_weight(getattr(experts, name)))
        expected = reference(x, ids, weights)
    else:  # an independent loop: each input fake-quantized as one tensor, float64 products
        routing = moe.route_tokens(ids, experts.n_experts)
        x_sorted = fq(x)[routing.token_ids].double()
        gate_up = torch.cat(
            [
                x_e @ w.double().T
                for x_e, w in zip(
                    x_sorted.split(routing.counts.tolist()), experts.gate_up_proj.detach()
                )
            ]
        )
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = fq(torch.nn.functional.silu(gate) * up).double()
        y = torch.cat(
            [
                h_e @ w.double().T
                for h_e, w in zip(h.split(routing.counts.tolist()), experts.down_proj.detach())
            ]
        ).float()
        expected = moe.combine_expert_outputs(y, routing, weights)
    got = layer(x, ids, weights)
    assert report_diff(got, expected, f"{mode} experts")[0] <= 1e-5 * expected.abs().max()


def test_a_rows_quantization_under_row_scales_does_not_depend_on_its_batch():
    x = _outlier_activations(64, 64, seed=2, dtype=torch.float32)()
    x[5] *= 1000.0  # one loud row sets the tensor's scale
    mask = torch.tensor([True, False, True, False])
    for act_scale, same in (("row", True), ("tensor", False)):
        batch, _ = nvfp4.quantize_activation(x, mask, act_scale)
        alone, _ = nvfp4.quantize_activation(x[:1], mask, act_scale)
        assert torch.equal(batch.data[:1], alone.data) == same, act_scale
        assert same_bits(batch.block_scale[:1], alone.block_scale) == same, act_scale


def test_sync_weights_reloads_exactly_the_qat_weights():
    trainer = tiny_model(vocab_size=48)
    rollout = rac.convert_for_rollout(copy.deepcopy(trainer), "nvfp4", rac_ratio=0.5)
    with torch.no_grad():
        for p in trainer.parameters():  # a training step happened: the rollout copy is stale
            p.add_(torch.randn_like(p) * 0.05)
    assert not same_bits(
        rollout.layers[0].attn.q_proj.weight_q.dequantize(torch.float32),
        nvfp4.fake_quantize_weight(trainer.layers[0].attn.q_proj.weight).detach(),
    )
    rac.sync_weights(rollout, trainer)
    _assert_rollout_weights_are_the_qat_weights(rollout, trainer)

    qat.convert_for_training(trainer)  # same parameter names: sync works unchanged
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rac.sync_weights(rollout, trainer)
    _assert_rollout_weights_are_the_qat_weights(rollout, trainer)

    fp8_rollout = rac.convert_for_rollout(copy.deepcopy(tiny_model(vocab_size=48)), "fp8")
    rac.sync_weights(fp8_rollout, trainer)
    codes, scale = fp8.quantize_weight(trainer.layers[1].mlp.experts.down_proj)
    assert torch.equal(bits(fp8_rollout.layers[1].mlp.experts.down_fp8), bits(codes))
    assert torch.equal(fp8_rollout.layers[1].mlp.experts.down_scale, scale)


def test_nvfp4_experts_fast_path_matches_the_twin_and_moe(kernel_device):
    torch.manual_seed(0)
    config = moe.MoEConfig(dim=64, expert_dim=32, n_experts=6, n_active=2)
    experts = moe.Experts(config).to(kernel_device)
    nn.init.normal_(experts.gate_up_proj, std=0.1)
    nn.init.normal_(experts.down_proj, std=0.1)
    layer = rac.NVFP4Experts.from_float(experts, rac_ratio=0.5)
    x = torch.randn(9, 64, device=kernel_device, dtype=torch.bfloat16)
    expert_ids, routing = _routing_with_empty_experts(6, 9, 2, kernel_device)
    weights = torch.softmax(torch.randn(9, 2, device=kernel_device), dim=-1)
    fast = layer._forward_triton(x, routing, weights.reshape(-1))
    twin = layer._forward_reference(x, routing, weights.reshape(-1))
    report_diff(fast, twin, "NVFP4Experts triton vs twin")
    torch.testing.assert_close(
        fast.float(), twin.float(), rtol=2e-2, atol=2e-2 * twin.abs().max().item()
    )
    combined = (twin[routing.inverse_order].view(9, 2, -1).sum(dim=1)).to(x.dtype)
    if kernel_device == "cpu":  # the module's own forward takes the twin on the CPU
        assert torch.equal(layer(x, expert_ids, weights), combined)
    with torch.no_grad():
        exact = experts(x.float(), expert_ids, weights)
    # two W4A4 GEMMs of NVFP4 noise, not another function
    assert relative_error(combined.float(), exact) < 0.35


# ============================================================================ errors
def _grouped_call(rows=4, K=32):
    """(act, w, counts) of a small grouped GEMM on the CPU: enough for its input checks."""
    act = rac.Activation(
        None, None, torch.zeros(2, rows, K // 2, dtype=torch.float16), torch.ones(())
    )
    return (
        act,
        rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 16, K))),
        torch.tensor([rows, 0]),
    )


def _three_stacked():
    return rac.stack_weights([nvfp4.quantize_weight(torch.randn(4, 32))] * 3)


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    *[
        (f"{label} ({name})", lambda q=quantize, args=args: q(*args), names, problem)
        for name, quantize in (
            ("twin", rac.quantize_activation_reference),
            ("Triton", rac.quantize_activation_triton),
        )[: 2 if HAS_TRITON else 1]
        for label, args, names, problem in (
            (
                "activation K",
                (torch.randn(2, 40),),
                "K=40",
                "not a multiple of the NVFP4 block size 16",
            ),
            (
                "activation dtype",
                (torch.randint(0, 4, (2, 32)),),
                "activations",
                "got dtype torch.int64",
            ),
            (
                "rac_mask shape",
                (torch.randn(2, 32), torch.ones(3, dtype=torch.bool)),
                "rac_mask",
                "(G,) = (2,) on cpu, got torch.bool (3,) on cpu",
            ),
        )
    ],
    (
        "K mismatch",
        lambda: rac.matmul_reference(
            nvfp4.quantize(torch.randn(2, 32)), nvfp4.quantize(torch.randn(4, 48))
        ),
        "K differs",
        "x_q (2, 32) vs w_q (4, 48)",
    ),
    (
        "residual scale",
        lambda: rac.matmul_reference(
            nvfp4.quantize(torch.randn(2, 32)),
            nvfp4.quantize(torch.randn(4, 32)),
            nvfp4.quantize(torch.randn(2, 32)),
        ),
        "residual",
        "must share x_q's global scale",
    ),
    (
        "x_q type",
        lambda: rac.matmul_reference([1.0], nvfp4.quantize(torch.randn(4, 32))),
        "x_q",
        "must be an NVFP4Tensor or Tensor, got list",
    ),
    (
        "router weight ids",
        lambda: rac.grouped_matmul_triton(
            *_grouped_call(), row_weights=torch.ones(6), row_weight_ids=torch.arange(3)
        ),
        "row_weight_ids",
        "one id per row (4,), got (3,) and row_weights (6,)",
    ),
    (
        "router weights",
        lambda: rac.grouped_matmul_triton(*_grouped_call(), row_weights=torch.ones(5)),
        "row_weights",
        "one weight per row (4,), got (5,)",
    ),
    (
        "experts layout",
        lambda: rac.grouped_matmul_triton(
            _grouped_call()[0], rac.unchunk_experts(_grouped_call()[1]), _grouped_call()[2]
        ),
        "w must be ExpertWeights",
        "got NVFP4Tensor",
    ),
    (
        "experts rows",
        lambda: rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 8, 32))),
        "N=8 rows",
        "not a multiple of 16",
    ),
    (
        "router weight ids (twin)",
        lambda: rac.grouped_matmul_reference(
            nvfp4.quantize(torch.randn(4, 32)),
            *_grouped_call()[1:],
            row_weights=torch.ones(6),
            row_weight_ids=torch.arange(3),
        ),
        "grouped_matmul_reference: row_weight_ids",
        "one id per row (4,)",
    ),
    (
        "kernel K",
        lambda: rac.nvfp4_linear_triton(torch.randn(2, 40), nvfp4.quantize(torch.randn(4, 48))),
        "K=40",
        "not a multiple of",
    ),
    (
        "x vs weight",
        lambda: rac.nvfp4_linear_triton(torch.randn(2, 32), nvfp4.quantize(torch.randn(4, 48))),
        "x (2, 32)",
        "does not match the weight (4, 48)",
    ),
    (
        "out_dtype",
        lambda: rac.nvfp4_linear_triton(
            torch.randn(2, 32).half(), nvfp4.quantize(torch.randn(4, 32)), out_dtype=torch.int8
        ),
        "out_dtype",
        "got torch.int8",
    ),
    (
        "rac_mask dtype",
        lambda: rac.nvfp4_linear_triton(
            torch.randn(2, 32), nvfp4.quantize(torch.randn(4, 32)), torch.ones(2)
        ),
        "rac_mask",
        "must be a bool tensor of shape (G,) = (2,) on cpu, got torch.float32 (2,) on cpu",
    ),
    (
        "splits sum",
        lambda: rac.nvfp4_linear_triton(torch.randn(2, 32), _three_stacked(), splits=(4, 4, 5)),
        "splits (4, 4, 5)",
        "adding up to the weight's N = 12",
    ),
    (
        "splits scales",
        lambda: rac.nvfp4_linear_triton(torch.randn(2, 32), _three_stacked()),
        "3 global scales",
        "expected 1 (one per stacked weight)",
    ),
    (
        "layer features",
        lambda: rac.NVFP4Linear(40, 8),
        "40 features",
        "not a multiple of the NVFP4 block size",
    ),
    (
        "input device",
        lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 32, device="meta")),
        "input on meta",
        "but weights on cpu",
    ),
    (
        "input dtype",
        lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 32).to(torch.float8_e4m3fn)),
        "NVFP4Linear",
        "bfloat16/float16/float32 tensor, got torch.float8_e4m3fn",
    ),
    (
        "input width",
        lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 48)),
        "last dim 32",
        "got shape (2, 48)",
    ),
    ("selector ratio", lambda: rac.RACSelector(4, 1.5), "rac_ratio", "in [0, 1], got 1.5"),
    (
        "convert ratio",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "nvfp4", rac_ratio=-0.1),
        "rac_ratio",
        "in [0, 1], got -0.1",
    ),
    (
        "mode",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "int4"),
        "'int4'",
        "unknown rollout mode",
    ),
    (
        "fp8 with RAC",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "fp8", rac_ratio=0.5),
        "rac_ratio=0.5",
        "concerns NVFP4 activations; mode 'fp8' has none",
    ),
    (
        "w4a16 with RAC",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "w4a16", rac_ratio=0.5),
        "rac_ratio=0.5",
        "mode 'w4a16' has none",
    ),
    (
        "act_scale",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "nvfp4", act_scale="col"),
        "act_scale",
        "one of ['tensor', 'row'], got 'col'",
    ),
    (
        "w4a16 row scale",
        lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "w4a16", act_scale="row"),
        "act_scale='row'",
        "mode 'w4a16' has none",
    ),
    (
        "layer mode",
        lambda: rac.NVFP4Linear(32, 8, mode="fp8"),
        "'fp8'",
        "choose one of ['nvfp4', 'w4a16', 'w16a4']",
    ),
    (
        "sync target",
        lambda: rac.sync_weights(
            rac.convert_for_rollout(tiny_model(vocab_size=48), "nvfp4"), nn.Linear(2, 2)
        ),
        "sync_weights",
        "has no parameter 'layers.0.attn.q_proj.weight'",
    ),
]


def calls_a_kernel(call):
    """Does the case call a kernel entry point (rac.*_triton)? Then it can only reach its one-line
    check where triton is installed; without it the entry point says so first."""
    return any(name.endswith("_triton") for name in call.__code__.co_names)


@pytest.mark.parametrize(
    "call, names, problem",
    [
        pytest.param(
            *case[1:],
            id=case[0],
            marks=pytest.mark.skipif(
                calls_a_kernel(case[1]) and not HAS_TRITON, reason="triton is not installed"
            ),
        )
        for case in BAD_CALLS
    ],
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


# ====================================================================== TRACE: the rollout's record
def recorded_and_used(x):
    """What InputRecorder keeps of x (nvfp4.quantize) and what the rollout's quantizer used."""
    return nvfp4.quantize(x), rac.quantize_activation_triton(x, codes=True).x_q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recorders_requantization_is_the_rollout_kernels_bit_for_bit(dtype, kernel_device):
    """InputRecorder keeps nvfp4.quantize(x) of each rollout layer input; the rollout's fused
    quantizer (under the Triton interpreter on the CPU) must have produced the same codes and
    scales."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=dtype).to(kernel_device)
    x[:, 16:32] *= 40
    recorded, used = recorded_and_used(x)
    assert torch.equal(recorded.global_scale.reshape(()), used.global_scale.reshape(()))
    assert torch.equal(recorded.data, used.data)
    assert torch.equal(recorded.block_scale.view(torch.uint8), used.block_scale.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [64, 4096])  # a decode step, a prefill
def test_cuda_the_recorders_requantization_is_the_rollout_kernels_bit_for_bit(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    x[:, 64:80] *= 40
    recorded, used = recorded_and_used(x)
    assert torch.equal(recorded.global_scale.reshape(()), used.global_scale.reshape(()))
    assert torch.equal(recorded.data, used.data)
    assert torch.equal(recorded.block_scale.view(torch.uint8), used.block_scale.view(torch.uint8))


@torch.no_grad()
def test_the_recorder_keeps_each_layers_quantized_input_with_its_own_act_scale():
    """Each NVFP4 layer records the input it quantizes, once per call (q, k and v: once for the
    three, under each path), requantized with the recorder's act_scale: the rollout's codes."""
    seen = {}
    for act_scale in ("tensor", "row"):
        model = tiny_model(vocab_size=48)
        rollout_model = rac.convert_for_rollout(model, "nvfp4", act_scale=act_scale)
        recorder = rac.InputRecorder(rollout_model, act_scale)
        slots = recorder.hand_offs()
        assert slots["layers.0.attn.q_proj"] is slots["layers.0.attn.v_proj"]
        assert slots["layers.0.attn.o_proj"] is not slots["layers.0.attn.q_proj"]
        attention = rollout_model.layers[0].attn
        tokens = _tokens()
        rollout_model(tokens, hand_offs=slots)
        hidden = rollout_model.embed(tokens)
        x = rollout_model.layers[0].attn_norm(hidden).reshape(-1, 64)  # q/k/v's input
        steps = recorder.steps[
            (("layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj"), 0)
        ]
        assert len(steps) == 1  # one record for the three
        data, block_scale, global_scale = steps[0]
        expected = nvfp4.quantize(x, nvfp4.activation_global_scale(x, act_scale))
        assert torch.equal(data, expected.data)
        assert torch.equal(block_scale, expected.block_scale.view(torch.uint8))
        assert torch.equal(global_scale, expected.global_scale.float().expand(x.shape[0]))
        seen[act_scale] = global_scale
        assert isinstance(attention, rac.NVFP4Attention)
    assert seen["tensor"].unique().numel() == 1 and seen["row"].unique().numel() > 1
