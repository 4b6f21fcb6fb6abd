"""fp8.py: row-wise FP8 quantization against a float64 oracle, the layers against full precision,
the grouped experts against a per-expert loop, the layers' dispatch to the gpu_kernels/w8a8_*.py
kernels (forced on the CPU, under the interpreter; natively on a GPU) against their reference path,
and clear errors."""

import pytest
import torch
import torch.nn as nn
from conftest import raises_one_line, relative_error, report_diff

import fp8
import moe


def test_rowwise_scale_is_row_amax_over_448_and_codes_round_to_nearest():
    torch.manual_seed(0)
    # rows of very different sizes, the last one all zero
    x = torch.randn(5, 64) * torch.tensor([1.0, 10.0, 0.01, 3.0, 0.0])[:, None]
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
    # oracle: token by token, the GEMMs' numbers (SwiGLU and router weight in fp32, then one BF16
    # rounding each)
    loop = torch.zeros(9, 64)
    for t in range(9):
        for a in range(2):
            e = int(expert_ids[t, a])
            w_gu = layer.gate_up_fp8[e].float() * layer.gate_up_scale[e][:, None]
            w_d = layer.down_fp8[e].float() * layer.down_scale[e][:, None]
            codes, scale = fp8.quantize_rowwise(x[t : t + 1])
            gate, up = (codes.float() * scale @ w_gu.T).chunk(2, dim=-1)
            h = (torch.nn.functional.silu(gate) * up).bfloat16()
            codes, scale = fp8.quantize_rowwise(h)
            loop[t] += (weights[t, a] * (codes.float() * scale @ w_d.T)).bfloat16().float()[0]
    assert report_diff(y, loop, "fp8 experts vs loop")[0] <= 2**-7 * loop.abs().max().item()
    with torch.no_grad():
        assert relative_error(y, experts(x, expert_ids, weights)) < 0.1


def _counting(monkeypatch, module, names):
    """Wrap module's functions `names` so that each call is counted -> the counts (a dict)."""
    counts = dict.fromkeys(names, 0)
    for name in names:

        def counted(*args, _name=name, _call=getattr(module, name), **kwargs):
            counts[_name] += 1
            return _call(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


# the dense GEMM with its own quantization (<= 16 rows), and without
@pytest.mark.parametrize("tokens", [5, 21])
def test_layers_dispatch_to_the_kernels_and_agree_with_their_references(
    kernel_device, monkeypatch, tokens
):
    # The kernels run where use_kernels says (CUDA sm_89+); on the CPU it says no. Forced on, the
    # same layers run the gpu_kernels/w8a8_*.py kernels (under the interpreter on the CPU) and agree
    # with their reference path.
    assert fp8.use_kernels(torch.zeros(1)) is False
    torch.manual_seed(tokens)
    linear = fp8.FP8Linear.from_float(nn.Linear(64, 48, bias=False).to(kernel_device))
    config = moe.MoEConfig(dim=64, expert_dim=32, n_experts=5, n_active=2)
    experts = moe.Experts(config).to(kernel_device)
    nn.init.normal_(experts.gate_up_proj, std=0.1)
    nn.init.normal_(experts.down_proj, std=0.1)
    layer = fp8.FP8Experts.from_float(experts)
    x = torch.randn(tokens, 64, device=kernel_device, dtype=torch.bfloat16)
    expert_ids = torch.rand(tokens, 5, device=kernel_device).topk(2, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, 2, device=kernel_device), dim=-1)
    monkeypatch.setattr(fp8, "use_kernels", lambda x: False)
    references = linear(x), layer(x, expert_ids, weights)
    monkeypatch.setattr(fp8, "use_kernels", lambda x: True)
    dense_calls = _counting(monkeypatch, fp8.w8a8_dense, ["linear", "quantize_rows"])
    experts_calls = _counting(monkeypatch, fp8.w8a8_experts, ["grouped_linear"])
    quantizer_calls = _counting(monkeypatch, fp8.w8a8_quantize, ["quantize_rows"])
    fast = linear(x), layer(x, expert_ids, weights)
    # the experts quantize x and h through fp8.py; the dense layer quantizes inside its launcher
    # unless it fuses the quantization into the GEMM
    assert dense_calls == {
        "linear": 1,
        "quantize_rows": int(tokens > fp8.w8a8_dense.FUSE_MAX_ROWS),
    }
    assert experts_calls == {"grouped_linear": 2}
    assert quantizer_calls == {"quantize_rows": 2}
    # the dense layer: the same codes, sums in another order (one BF16 ulp at most)
    dense_gap = (fast[0].float() - references[0].float()).abs()
    assert (dense_gap <= 2**-7 * references[0].float().abs()).all()
    # the experts: a hidden value one ulp off may move a code of h, so only close
    experts_gap, _ = report_diff(fast[1], references[1], "fp8 experts kernels vs reference")
    assert experts_gap <= 2e-2 * references[1].abs().max().item()


# (id, call, what the message names, the problem it states)
BAD_CALLS = [
    (
        "input width",
        lambda: fp8.FP8Linear(32, 8)(torch.randn(2, 48)),
        "last dim 32",
        "got shape (2, 48)",
    ),
    (
        "input dtype",
        lambda: fp8.FP8Linear(32, 8)(torch.randint(0, 3, (2, 32))),
        "FP8Linear",
        "bfloat16/float16/float32 tensor, got torch.int64",
    ),
    (
        "weight shape",
        lambda: fp8.FP8Linear(32, 8).load_weight(torch.randn(8, 16)),
        "weight shape (8, 16)",
        "!= (8, 32)",
    ),
    (
        "gate_up shape",
        lambda: fp8.FP8Experts(4, 32, 16).load_weights(
            torch.randn(4, 16, 32), torch.randn(4, 32, 16)
        ),
        "gate_up weight shape (4, 16, 32)",
        "!= (4, 32, 32)",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


@pytest.mark.cuda
def test_the_layers_take_the_kernels_on_gpus_with_fp8_tensor_cores_and_match_their_cpu_twins():
    torch.manual_seed(0)
    linear = fp8.FP8Linear.from_float(nn.Linear(2048, 512, device="cuda"))
    x = torch.randn(33, 2048, device="cuda", dtype=torch.bfloat16)
    assert fp8.use_kernels(x) == (torch.cuda.get_device_capability() >= (8, 9))
    twin = fp8.FP8Linear.from_float(nn.Linear(2048, 512)).cpu()
    twin.load_state_dict({k: v.cpu() for k, v in linear.state_dict().items()})
    assert (
        report_diff(linear(x).float().cpu(), twin(x.cpu()).float(), "fp8 linear gpu vs cpu")[0]
        <= 1e-2 * twin(x.cpu()).float().abs().max().item()
    )
    config = moe.MoEConfig(dim=2048, expert_dim=768, n_experts=8, n_active=2)
    experts = moe.Experts(config).cuda()
    nn.init.normal_(experts.gate_up_proj, std=0.02)
    nn.init.normal_(experts.down_proj, std=0.02)
    layer = fp8.FP8Experts.from_float(experts)
    expert_ids = torch.rand(33, 8, device="cuda").topk(2, dim=-1).indices
    weights = torch.softmax(torch.randn(33, 2, device="cuda"), dim=-1)
    y = layer(x, expert_ids, weights).float().cpu()
    cpu_layer = fp8.FP8Experts(8, 2048, 768)
    cpu_layer.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    twin_y = cpu_layer(x.cpu(), expert_ids.cpu(), weights.cpu()).float()
    assert report_diff(y, twin_y, "fp8 experts gpu vs cpu")[0] <= 2e-2 * twin_y.abs().max().item()
