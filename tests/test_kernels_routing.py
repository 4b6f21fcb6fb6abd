"""Tests for gpu_kernels/routing.py: the counting sort, the sum of expert rows and the fused router
against moe.py's plain twins and float64 oracles (on the CPU under TRITON_INTERPRET=1, on a GPU
natively)."""

import pytest
import torch
from conftest import raises_one_line, same_bits

import moe
from moe import route_tokens

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import routing as routing_kernels  # noqa: E402


def test_fused_router_picks_the_most_probable_experts_lowest_id_first_on_ties(kernel_device):
    generator = torch.Generator().manual_seed(5)
    for tokens, n_experts, active, norm in ((1, 8, 2, True), (37, 128, 8, True), (5, 60, 4, False)):
        logits = 2 * torch.randn(tokens, n_experts, generator=generator)
        logits[0, 1] = logits[0, 3] = logits[0].max() + 1  # a tie: the lower id comes first
        weights, ids = routing_kernels.router_top_k(logits.to(kernel_device), active, norm)
        probs = torch.softmax(logits.double(), dim=-1)  # the float64 oracle
        for t in range(tokens):
            expected = sorted(range(n_experts), key=lambda e: (-probs[t, e].item(), e))[:active]
            assert ids[t].tolist() == expected
        expected = probs.gather(-1, ids.cpu())
        if norm:
            expected = expected / expected.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(weights.cpu().double(), expected, rtol=1e-6, atol=0)


def test_fused_router_weights_replayed_routes_and_its_gradient_is_the_twins(kernel_device):
    generator = torch.Generator().manual_seed(6)
    logits = (2 * torch.randn(9, 64, generator=generator)).to(kernel_device)
    weights, ids = routing_kernels.router_top_k(logits, 4, True)
    replayed, own = routing_kernels.router_top_k(logits, 4, True, routes=ids)
    assert torch.equal(replayed, weights) and torch.equal(own, ids)  # its own routes: the same bits
    routes = torch.randint(64, (9, 4), generator=generator).to(kernel_device)
    replayed, own = routing_kernels.router_top_k(logits, 4, True, routes=routes)
    assert torch.equal(own, ids)  # still reports its own choice
    expected = torch.softmax(logits.double(), dim=-1).gather(-1, routes)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(replayed.double(), expected, rtol=1e-6, atol=0)
    grad = torch.randn(9, 4, generator=generator).to(kernel_device)
    for given in (None, routes):
        fused_logits, twin_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        weights_of = moe.router_weights
        routing_kernels.RouterTopK.apply(fused_logits, 4, True, given, weights_of)[0].backward(grad)
        moe.router_top_k_reference(twin_logits, 4, True, ids if given is None else given)[
            0
        ].backward(grad)
        assert torch.equal(fused_logits.grad, twin_logits.grad)


def test_fused_routing_equals_the_torch_routing_in_every_integer(kernel_device):
    generator = torch.Generator().manual_seed(4)
    # one assignment; a partial chunk; several chunks, few experts; the largest (chunks, experts) it
    # takes
    for n_experts, tokens, active in ((8, 1, 1), (5, 3, 2), (128, 256, 8), (256, 512, 8)):
        expert_ids = torch.randint(n_experts, (tokens, active), generator=generator)
        if tokens > 8:
            # a crowded expert across chunk boundaries: ties keep order
            expert_ids[:8] = n_experts - 1
        fused = routing_kernels.route_tokens(expert_ids.to(kernel_device), n_experts)
        for name, got, expected in zip(
            moe.Routing._fields, fused, moe.route_tokens_reference(expert_ids, n_experts)
        ):
            assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected), name


def test_fused_sum_of_expert_rows_equals_its_twin_bit_for_bit(kernel_device):
    generator = torch.Generator().manual_seed(6)
    # one token and one expert; a partial D block; a decode layer's shape (D 2048 in two blocks)
    for tokens, active, dim in ((1, 1, 16), (3, 2, 48), (17, 8, 1040), (4, 8, 2048)):
        routing = route_tokens(torch.randint(8, (tokens, active), generator=generator), 8)
        for dtype in (torch.bfloat16, torch.float32):
            y_sorted = (torch.randn(tokens * active, dim, generator=generator) * 3).to(dtype)
            y_sorted[
                0, :4
            ] = -0.0  # a token whose first row holds -0: the sum starts from that row, not 0
            fused = routing_kernels.sum_expert_rows(
                y_sorted.to(kernel_device), routing.inverse_order.to(kernel_device), active
            )
            twin = moe.sum_expert_rows_reference(y_sorted, routing, active)
            assert same_bits(fused.cpu(), twin), (tokens, dtype)


def test_sum_of_expert_rows_refuses_rows_that_are_not_the_routings():
    routing = route_tokens(torch.zeros(3, 2, dtype=torch.long), 4)
    raises_one_line(
        lambda: routing_kernels.sum_expert_rows(torch.zeros(5, 4), routing.inverse_order, 2),
        "y_sorted (5, 4)",
        "N = 6",
    )
