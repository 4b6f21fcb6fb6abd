"""fp8.py: row-wise FP8 quantization against a float64 oracle, the layers against full precision, the
grouped experts against a per-expert loop, torch._scaled_mm against the twin (GPU), and clear errors."""
import pytest
import torch
import torch.nn as nn
from conftest import raises_one_line, relative_error, report_diff

import fp8
import moe


def test_rowwise_scale_is_row_amax_over_448_and_codes_round_to_nearest():
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.tensor([1.0, 10.0, 0.01, 3.0, 0.0])[:, None]   # the last row all zero
    codes, scale = fp8.quantize_rowwise(x)
    amax = x.double().abs().amax(dim=1, keepdim=True)
    expected = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.allclose(scale.double(), expected, rtol=1e-7) and scale[4].item() == 1.0
    # each row's largest magnitude lands on E4M3's maximum; every code is the nearest E4M3 value
    assert (codes[:4].float().abs().amax(dim=1) == 448.0).all()
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = grid[grid.isfinite()].unique()
    target = (x.double() / expected).clamp(-448, 448)
    nearest = (target[..., None] - grid).abs().min(dim=-1).values
    assert torch.allclose((codes.double() - target).abs(), nearest)


def test_fp8_linear_is_close_to_full_precision_and_keeps_bias():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    layer = fp8.FP8Linear.from_float(linear)
    x = torch.randn(3, 7, 64)
    y = layer(x)
    assert y.shape == (3, 7, 48)
    assert relative_error(y, linear(x).detach()) < 0.05
    layer.bias.zero_()
    assert relative_error(layer(x) + linear.bias.detach(), linear(x).detach()) < 0.05


def test_fp8_experts_match_a_per_expert_loop_and_moe():
    torch.manual_seed(0)
    config = moe.MoEConfig(dim=64, expert_dim=32, n_experts=5, n_active=2)
    experts = moe.Experts(config)
    nn.init.normal_(experts.gate_up_proj, std=0.1)
    nn.init.normal_(experts.down_proj, std=0.1)
    layer = fp8.FP8Experts.from_float(experts)
    x = torch.randn(9, 64)
    expert_ids = torch.tensor([[0, 1], [1, 3], [3, 0]] * 3)  # expert 2 and 4: no tokens
    weights = torch.softmax(torch.randn(9, 2), dim=-1)
    y = layer(x, expert_ids, weights)
    loop = torch.zeros(9, 64)  # oracle: token by token
    for t in range(9):
        for a in range(2):
            e = int(expert_ids[t, a])
            w_gu = layer.gate_up_fp8[e].float() * layer.gate_up_scale[e][:, None]
            w_d = layer.down_fp8[e].float() * layer.down_scale[e][:, None]
            codes, scale = fp8.quantize_rowwise(x[t:t + 1])
            gate, up = (codes.float() * scale @ w_gu.T).bfloat16().float().chunk(2, dim=-1)
            h = (torch.nn.functional.silu(gate) * up)
            codes, scale = fp8.quantize_rowwise(h)
            loop[t] += weights[t, a] * (codes.float() * scale @ w_d.T).bfloat16().float()[0]
    assert report_diff(y, loop, "fp8 experts vs loop")[0] < 2e-2 * loop.abs().max().item()
    with torch.no_grad():
        assert relative_error(y, experts(x, expert_ids, weights)) < 0.1


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    ("input width", lambda: fp8.FP8Linear(32, 8)(torch.randn(2, 48)), "last dim 32", "got shape (2, 48)"),
    ("input dtype", lambda: fp8.FP8Linear(32, 8)(torch.randint(0, 3, (2, 32))), "FP8Linear",
     "bfloat16/float16/float32 tensor, got torch.int64"),
    ("weight shape", lambda: fp8.FP8Linear(32, 8).load_weight(torch.randn(8, 16)), "weight shape (8, 16)",
     "!= (8, 32)"),
    ("gate_up shape", lambda: fp8.FP8Experts(4, 32, 16).load_weights(torch.randn(4, 16, 32),
                                                                     torch.randn(4, 32, 16)),
     "gate_up weight shape (4, 16, 32)", "!= (4, 32, 32)"),
]


@pytest.mark.parametrize("call, names, problem", [case[1:] for case in BAD_CALLS],
                         ids=[case[0] for case in BAD_CALLS])
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


@pytest.mark.cuda
def test_scaled_mm_and_scaled_grouped_mm_match_their_twins():
    torch.manual_seed(0)
    x = torch.randn(33, 2048, device="cuda", dtype=torch.bfloat16)
    w_codes, w_scale = fp8.quantize_weight(torch.randn(512, 2048, device="cuda") * 0.02)
    fast = fp8.linear(x, w_codes, w_scale)
    twin = fp8.linear_reference(*fp8.quantize_rowwise(x), w_codes, w_scale)
    assert report_diff(fast.float(), twin.float(),
                       "fp8 _scaled_mm vs twin")[0] <= 1e-2 * twin.abs().max().item()
    routing = moe.route_tokens(torch.rand(16, 8, device="cuda").topk(2, dim=-1).indices, 8)
    stacked_codes, stacked_scale = fp8.quantize_weight(torch.randn(8, 256, 2048, device="cuda") * 0.02)
    x_sorted = x[:16][routing.token_ids]
    fast = fp8.grouped_linear(x_sorted, routing, stacked_codes, stacked_scale)
    twin = fp8.grouped_linear(x_sorted.cpu(), routing._replace(counts=routing.counts.cpu()),  # the CPU loop
                              stacked_codes.cpu(), stacked_scale.cpu())
    assert report_diff(fast.float().cpu(), twin.float(),
                       "fp8 grouped vs loop")[0] <= 1e-2 * twin.abs().max().item()
