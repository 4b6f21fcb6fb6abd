"""symmetric.py: the symmetric trainer modes. w4a4 fake-quantizes both GEMM inputs with a
straight-through gradient; moeresq equals the rollout layers' torch twins when handed the rollout's
masks; trace's rounding rule on hand-made cases and on a real rollout's recorded codes; row scales;
mini-batches re-key the records; conversion and clear errors."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import raises_one_line, report_diff, tiny_model

import moe
import nvfp4
import qat
import rac
import rollout
import symmetric


def tokens(batch=4, length=16, seed=1):
    return torch.randint(64, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_experts(mode="w4a4", seed=0):
    """(plain experts, their trainer twin in `mode` ("qat" or a symmetric mode), x, ids,
    weights)."""
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
    if mode == "qat":
        trainer = qat.QATExperts.from_float(experts)
    else:
        trainer = symmetric.SymmetricExperts.from_float(experts, mode)
    return experts, trainer, x, expert_ids, expert_weights


def test_w4a4_fake_quantizes_activations_with_a_straight_through_gradient():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    layer_qat = qat.QATLinear.from_float(linear)
    layer_w4a4 = symmetric.SymmetricLinear.from_float(copy.deepcopy(linear), "w4a4")
    x = torch.randn(6, 64, requires_grad=True)
    y = layer_w4a4(x)
    x_q = nvfp4.fake_quantize(x.detach())
    assert torch.equal(y, F.linear(x_q, qat.quantized_weights(layer_w4a4)[0]))
    assert not torch.equal(y, layer_qat(x))
    grad_y = torch.randn(6, 32)
    y.backward(grad_y)
    # straight-through: grad_x = grad_y @ Wq as if x were not quantized; grad_W uses the quantized
    # input
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
    fast = symmetric._grouped_linear(x, routing, weight, grouped=True)
    slow = symmetric._grouped_linear(x, routing, weight, grouped=False)
    assert report_diff(fast, slow, "grouped vs loop")[0] <= 1e-2 * slow.float().abs().max()


# ------------------------------------------------------------------------------------------ moeresq
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
    trainer_layer = symmetric.SymmetricLinear.from_float(copy.deepcopy(linear), "moeresq")
    y = trainer_layer(x, symmetric.LayerShare((mask,), None))  # the masks: an argument of the call
    scale = expected.abs().max().item()
    assert report_diff(y, expected, "moeresq vs rollout twin")[0] <= 1e-6 * scale
    # the compensation is really there: without it (w4a4) or without activation quantization (qat)
    # the trainer is far from the rollout
    naive = rac.nvfp4_linear_reference(x, rollout_layer.weight_q, None)
    assert report_diff(expected, naive, "rac vs naive rollout")[0] > 1e-3 * scale
    others = {
        "w4a4": symmetric.SymmetricLinear.from_float(copy.deepcopy(linear), "w4a4"),
        "qat": qat.QATLinear.from_float(copy.deepcopy(linear)),
    }
    for mode, layer in others.items():
        assert report_diff(layer(x), expected, f"{mode} vs rollout twin")[0] > 1e-3 * scale


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
    y = trainer_experts(x.requires_grad_(), ids, weights, symmetric.LayerShare(masks, None))
    scale = expected.abs().max().item()
    assert report_diff(y, expected, "moeresq experts vs rollout twin")[0] <= 1e-5 * scale
    naive = rac.NVFP4Experts.from_float(experts)(x.detach(), ids, weights)
    assert report_diff(naive, expected, "naive vs rac rollout")[0] > 1e-3 * scale
    y.sum().backward()  # straight-through: gradients reach the input and the master weights
    assert x.grad.abs().sum() > 0 and trainer_experts.down_proj.grad.abs().sum() > 0


# -------------------------------------------------------------------------------------------- trace
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
    assert symmetric.takes_rollout_code(scaled, rollout_value).tolist() == [c[2] for c in cases]


def hand_made_codes(rollout_values, block_scale, global_scale, keys):
    """RecordedCodes of rows whose E2M1 values are given (rows, 16 * G)."""
    codes = nvfp4.encode_e2m1(rollout_values)  # exact grid values: their own codes
    return rac.RecordedCodes(
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
    out = symmetric.quantize_input(x, "trace", codes=codes)
    take = torch.tensor([True, True, False, False, True, True, True, True] * 2)
    assert torch.equal(out[0], own[0])  # row 0: not recorded
    assert torch.equal(out[1][take], rollout[take] * unit)  # the rollout's values
    assert torch.equal(out[1][~take], own[1][~take])  # its own rounding
    assert not torch.equal(
        own[1][:2], rollout[:2] * unit
    )  # rows 0-1 of the block really were flipped
    # straight-through gradient
    x.requires_grad_()
    symmetric.quantize_input(x, "trace", codes=codes).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("act_scale", ["tensor", "row"])
def test_trace_layer_takes_the_rollouts_exact_values_for_its_recorded_decode_tokens(act_scale):
    """A real rollout: the recorder keeps, per completion token, what the rollout's quantizer used.
    In layer 0 the q projection's input of a token depends on that token alone, so the trainer sees
    the same values as the rollout; with one global scale per tensor it quantizes the whole batch at
    another scale: rollout-guided rounding must give back exactly the rollout's dequantized values
    on every completion token, its own elsewhere. With one per row the trainer's own rounding
    already is the rollout's."""
    model = tiny_model(std=0.2)
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", act_scale=act_scale)
    recorder = rac.InputRecorder(rollout_model, act_scale)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out = rollout.generate(
        rollout_model,
        prompts,
        3,
        6,
        eos_id=9,
        pad_id=0,
        seed=0,
        decode_hand_offs=recorder.hand_offs(),
    )
    seq = out.sequences()
    B, W = seq.tokens.shape
    recorded = recorder.codes(out)
    codes = {"q": recorded["layers.0.attn.q_proj"], "e": recorded["layers.1.mlp.experts"]}
    n_tokens = int(out.completion_mask.sum())
    assert codes["q"][0].keys.numel() == n_tokens  # completion tokens only
    record = codes["q"][0]
    nbytes = sum(
        t.numel() * t.element_size()
        for t in (record.keys, record.data, record.block_scale, record.global_scale)
    )
    assert nbytes == n_tokens * (64 // 2 + 64 // 16 + 4 + 8)  # the docstring's bound

    trainer = symmetric.convert_for_training(copy.deepcopy(model), "trace", act_scale=act_scale)
    layer = trainer.layers[0].attn.q_proj
    seen = {}
    layer.register_forward_hook(lambda m, args, output: seen.update(x=args[0].reshape(-1, 64)))
    trainer(seq.tokens)
    x = seen["x"]  # (B * W, K)
    guided = symmetric.quantize_input(x, "trace", codes=codes["q"][0], act_scale=act_scale)
    own = symmetric.quantize_input(x, "w4a4", act_scale=act_scale)
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
    # the trainer's own rounding differs with another global scale, is the rollout's with the row's
    # own
    assert torch.equal(own[rows], rollout_values) == (act_scale == "row")
    others = torch.ones(B * W, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(guided[others], own[others])
    # a mini-batch of the sequences (rows 3 and 0) sees the same rollout values on its completion
    # tokens
    rows = torch.tensor([3, 0])
    sub = symmetric.select_codes(codes["q"][0], rows, W)
    trainer(seq.tokens[rows])
    guided_sub = symmetric.quantize_input(seen["x"], "trace", codes=sub, act_scale=act_scale)
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
            [symmetric.quantize_input(row[None], mode, rac_mask) for row in x]
        )  # tensor = the row
        per_row = symmetric.quantize_input(x, mode, rac_mask, act_scale="row")
        assert torch.equal(per_row, alone), mode
        assert not torch.equal(symmetric.quantize_input(x, mode, rac_mask), alone), mode


def test_layers_sharing_a_record_share_its_mini_batch_too():
    # q, k and v read one input and share one record; their mini-batch stays one object (selected
    # once)
    trainer = symmetric.convert_for_training(tiny_model(), "trace")
    record = hand_made_codes(torch.arange(3.0)[:, None].repeat(1, 16), 1.0, 1.0, keys=[3, 8, 13])
    paths = [f"layers.0.attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]
    share = symmetric.RolloutShare(codes={path: (record,) for path in paths})
    share = share.select_rows(torch.tensor([2, 0]), 5)
    picked = [share.codes[path][0] for path in paths]
    assert picked[0] is picked[1] is picked[2] and picked[0].keys.tolist() == [3, 8]
    hand_offs = share.hand_offs(trainer)
    assert hand_offs[paths[0]].codes[0] is picked[0]  # what the layer is handed in the forward
    assert hand_offs["layers.1.mlp.experts"].codes is None  # a layer without records: its own


def test_a_mini_batch_of_rows_gets_its_own_rows_records_rekeyed():
    width, n_experts = 5, 4
    # records of rows 0, 1, 2: one per (row, column 3) for a linear input, two experts each for a
    # down input
    linear = hand_made_codes(torch.arange(3.0)[:, None].repeat(1, 16), 1.0, 1.0, keys=[3, 8, 13])
    keys = torch.tensor([(r * width + 3) * n_experts + e for r in range(3) for e in (1, 2)])
    down = rac.RecordedCodes(
        keys,
        torch.arange(6, dtype=torch.uint8)[:, None].repeat(1, 8),
        torch.ones(6, 1).to(torch.float8_e4m3fn),
        torch.arange(6.0),
        n_experts,
    )
    rows = torch.tensor([2, 0])  # the mini-batch: row 2 first, then row 0
    picked = symmetric.select_codes(linear, rows, width)
    assert picked.keys.tolist() == [3, 8]  # new row 0 (old 2) and new row 1 (old 0), column 3
    assert nvfp4.decode_e2m1(nvfp4.unpack_codes(picked.data))[:, 0].tolist() == [2.0, 0.0]
    picked = symmetric.select_codes(down, rows, width)
    assert picked.keys.tolist() == [
        (0 * width + 3) * 4 + 1,
        (0 * width + 3) * 4 + 2,
        (1 * width + 3) * 4 + 1,
        (1 * width + 3) * 4 + 2,
    ]
    assert picked.global_scale.tolist() == [4.0, 5.0, 0.0, 1.0] and picked.n_experts == n_experts


# --------------------------------------------------------------------------------------- conversion
def test_conversion_keeps_parameters_and_sets_the_mode_and_scale():
    model = tiny_model(std=0.1, tie_embeddings=True)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    qat.convert_for_training(model)  # from QAT layers too: the same parameters
    symmetric.convert_for_training(
        model, "w4a4", "row", quantize_router=True, quantize_lm_head=True
    )
    assert {name: p for name, p in model.named_parameters()} == params
    assert list(model.state_dict()) == keys
    linears = [m for m in model.modules() if isinstance(m, symmetric.SymmetricLinear)]
    experts = [m for m in model.modules() if isinstance(m, symmetric.SymmetricExperts)]
    assert len(linears) == 4 * 2 + 2 + 1 and len(experts) == 2
    assert all(m.mode == "w4a4" and m.act_scale == "row" for m in linears + experts)
    assert model.lm_head.weight is model.embed.weight


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "unknown mode",
        lambda: symmetric.convert_for_training(tiny_model(std=0.1), "nvfp4"),
        "symmetric mode 'nvfp4'",
        "choose one of ['w4a4', 'moeresq', 'trace']",
    ),
    (
        "mode case",
        lambda: symmetric.convert_for_training(tiny_model(std=0.1), "W4A4"),
        "'W4A4'",
        "choose one of",
    ),
    (
        "act_scale",
        lambda: symmetric.convert_for_training(tiny_model(std=0.1), "w4a4", act_scale="col"),
        "act_scale 'col'",
        "choose one of ['tensor', 'row']",
    ),
    (
        "moeresq without the rollout's selection",
        lambda: symmetric.convert_for_training(tiny_model(std=0.1), "moeresq")(tokens()),
        "mode 'moeresq'",
        "has no RAC selection",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)
