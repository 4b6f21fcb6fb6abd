"""gpu_kernels/w4a4_experts.py: the experts' grouped W4A4 GEMM in Triton (gather + SwiGLU, router
weights read through routing.order, empty experts, the experts' blocked weight layout) against
rac.grouped_matmul_reference (CPU under TRITON_INTERPRET=1, GPU natively); per-row x scales (the
gathered row's at gate/up, the sorted row's at down) against the reference, bit for bit the
one-scale results where the scales are equal, and a token's output independent of its batch; the
W4A16 operand; its autotuning table; every GPU configuration forced in turn at prefill size."""

import pytest
import torch
from conftest import report_diff
from test_kernels_w4a4_dense import assert_rows_close, deterministic_and_close
from test_kernels_w4a4_quantize import rows_of_many_magnitudes

import moe
import nvfp4
import rac

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w4a4_common, w4a4_experts  # noqa: E402


def routing_with_empty_experts(n_experts, tokens, active, device, seed=0):
    """Random top-A routes that never pick experts 0, 2 and the last one
    (they receive no tokens)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in (0, 2, n_experts - 1)])
    scores = torch.rand(tokens, allowed.numel(), generator=generator)
    expert_ids = allowed[scores.topk(active, dim=-1).indices].to(device)
    return expert_ids, moe.route_tokens(expert_ids, n_experts)


def grouped(act, w, counts, **kwargs):
    """The Triton kernel itself, whatever rac.backend would choose on this device."""
    return w4a4_experts.grouped_matmul(
        act.operand,
        act.global_scale,
        w.data,
        w.block_scale,
        w.global_scale,
        counts,
        kwargs.pop("out_dtype", torch.float32),
        **kwargs,
    )


@pytest.mark.parametrize("tokens, D", [(3, 80), (21, 80), (5, 256)])
def test_grouped_kernel_matches_the_per_expert_reference(kernel_device, tokens, D):
    # 21 tokens x 2 on 4 used experts: some experts get more rows than one 16-row tile. D = 80: the
    # down GEMM's output is 3 of the interpreter's 32-column tiles (the last one short); its K is
    # one chunk of ExpertWeights' layout, D = 256 two
    torch.manual_seed(tokens)
    E, I, A = 7, 32, 2
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, kernel_device, seed=tokens)
    assert (routing.counts[[0, 2, E - 1]] == 0).all()
    x = torch.randn(tokens, D, device=kernel_device, dtype=torch.bfloat16)
    act = rac.quantize_activation_triton(
        x, torch.arange(D // 16, device=kernel_device) % 2 == 0, codes=True
    )
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device=kernel_device))
    hidden = grouped(
        act, rac.chunk_experts(gate_up_q), routing.counts, row_ids=routing.token_ids, swiglu=True
    )
    reference = rac.grouped_matmul_reference(
        act.x_q,
        gate_up_q,
        routing.counts,
        act.residual,
        row_ids=routing.token_ids,
        swiglu=True,
        out_dtype=torch.float32,
    )
    assert hidden.shape == (tokens * A, I)
    assert (
        report_diff(hidden, reference, "grouped gate/up + swiglu")[0]
        <= 2e-3 * reference.abs().max().item()
    )

    act = rac.quantize_activation_triton(reference, codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device=kernel_device))
    down_w = rac.chunk_experts(down_q)
    row_weights = torch.rand(tokens * A, device=kernel_device)
    y = grouped(act, down_w, routing.counts, row_weights=row_weights)
    reference = rac.grouped_matmul_reference(
        act.x_q, down_q, routing.counts, row_weights=row_weights, out_dtype=torch.float32
    )
    assert (
        report_diff(y, reference, "grouped down * router weight")[0]
        <= 1e-5 * reference.abs().max().item()
    )
    # the router weights as the layer passes them: (T * A,) in assignment order, read through
    # routing.order; the oracle is the sorted path just checked, on the weights gathered by hand
    expert_weights = torch.rand(tokens, A, device=kernel_device, dtype=torch.bfloat16).reshape(-1)
    by_order = grouped(
        act, down_w, routing.counts, row_weights=expert_weights, row_weight_ids=routing.order
    )
    gathered = expert_weights[routing.order].float()
    assert torch.equal(by_order, grouped(act, down_w, routing.counts, row_weights=gathered))
    twin_by_order = rac.grouped_matmul_reference(
        act.x_q,
        down_q,
        routing.counts,
        row_weights=expert_weights,
        row_weight_ids=routing.order,
        out_dtype=torch.float32,
    )
    twin_sorted = rac.grouped_matmul_reference(
        act.x_q, down_q, routing.counts, row_weights=gathered, out_dtype=torch.float32
    )
    assert torch.equal(twin_by_order, twin_sorted)


def test_no_rows_give_an_empty_output(kernel_device):
    act = rac.quantize_activation_triton(torch.zeros(0, 32, device=kernel_device))
    w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 32, 32, device=kernel_device)))
    y = grouped(act, w, torch.zeros(2, dtype=torch.int64, device=kernel_device), swiglu=True)
    assert y.shape == (0, 16)


# ------------------------------------------------------------------ per-row x scales, W4A16 operand
def expert_layer(grouped_matmul, gate_up_w, down_w, mask=None, act_scale="row", quantize=True):
    """The experts' two GEMMs on `grouped_matmul` (this file's `grouped`, or another kernel's): x
    (T, D), expert_ids (T, A), router weights (T * A,) -> (routing, hidden (R, I) fp32 and y (R, D),
    each in sorted-row order); the down GEMM reads hidden in x's dtype, as rac.NVFP4Experts does."""

    def layer(x, expert_ids, router_weights):
        routing = moe.route_tokens(expert_ids, gate_up_w.shape[0])
        act = rac.quantize_activation_triton(x, mask, act_scale=act_scale, quantize=quantize)
        hidden = grouped_matmul(
            act, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True
        )
        act = rac.quantize_activation_triton(
            hidden.to(x.dtype), act_scale=act_scale, quantize=quantize
        )
        y = grouped_matmul(
            act, down_w, routing.counts, row_weights=router_weights, row_weight_ids=routing.order
        )
        return routing, hidden, y

    return layer


def _experts_case(E, D, I, device, seed):
    generator = torch.Generator().manual_seed(seed)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, generator=generator).to(device))
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, generator=generator).to(device))
    return gate_up_q, down_q


@pytest.mark.parametrize("tokens, D", [(3, 80), (21, 80), (5, 256)])
def test_row_scale_grouped_kernel_matches_the_reference_per_row(kernel_device, tokens, D):
    # token rows 10^-6 .. 10^6 apart, each its own scale: gate/up reads the scale of the gathered
    # token row (row_ids), down that of its sorted row (the hidden rows, as the gate/up GEMM wrote
    # them)
    E, I, A = 7, 32, 2
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, kernel_device, seed=tokens)
    x = rows_of_many_magnitudes(tokens, D, tokens).to(kernel_device)
    mask = torch.arange(D // 16, device=kernel_device) % 2 == 0
    gate_up_q, down_q = _experts_case(E, D, I, kernel_device, tokens)
    router_weights = torch.rand(tokens * A, device=kernel_device)
    _, hidden, y = expert_layer(
        grouped, rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q), mask
    )(x, expert_ids, router_weights)
    x_q, residual = nvfp4.quantize_activation(x, mask, "row")
    reference = rac.grouped_matmul_reference(
        x_q,
        gate_up_q,
        routing.counts,
        residual,
        row_ids=routing.token_ids,
        swiglu=True,
        out_dtype=torch.float32,
    )
    assert_rows_close(hidden, reference, 2e-3, "row-scale gate/up")
    # the kernel's own hidden rows
    h_q, _ = nvfp4.quantize_activation(hidden.to(x.dtype), None, "row")
    reference = rac.grouped_matmul_reference(
        h_q,
        down_q,
        routing.counts,
        row_weights=router_weights,
        row_weight_ids=routing.order,
        out_dtype=torch.float32,
    )
    assert_rows_close(y, reference, 1e-5, "row-scale down")


def test_row_scales_equal_to_the_tensors_give_its_results_bit_for_bit(kernel_device):
    torch.manual_seed(0)
    E, D, I, A, tokens = 7, 80, 32, 2, 21
    _, routing = routing_with_empty_experts(E, tokens, A, kernel_device)
    gate_up_q, down_q = _experts_case(E, D, I, kernel_device, 0)
    x = rac.quantize_activation_triton(torch.randn(tokens, D, device=kernel_device))
    h = rac.quantize_activation_triton(torch.randn(tokens * A, I, device=kernel_device))
    for act, w, kwargs in (
        (x, gate_up_q, dict(row_ids=routing.token_ids, swiglu=True)),
        (h, down_q, dict(row_weights=torch.rand(tokens * A, device=kernel_device))),
    ):
        per_row = act._replace(
            global_scale=act.global_scale.expand(act.operand.shape[1]).contiguous()
        )
        w = rac.chunk_experts(w)
        one, each = (grouped(a, w, routing.counts, **kwargs) for a in (act, per_row))
        assert torch.equal(one, each)


def tokens_by_assignment(routing, y_sorted, tokens, A):
    """Sorted rows -> (T, A, N): each token's rows in its own order."""
    return y_sorted[routing.inverse_order].view(tokens, A, -1)


def assert_batch_invariant(layer, x, expert_ids, router_weights, extra, picks):
    """Each picked token's hidden and output rows: the same bits in its batch, alone, and among
    `extra` other tokens (x, expert_ids, router weights (T, A)), where it comes fourth."""
    tokens, A = expert_ids.shape
    routing, hidden, y = layer(x, expert_ids, router_weights.reshape(-1))
    batch = [tokens_by_assignment(routing, t, tokens, A) for t in (hidden, y)]
    for t in picks:
        for xs, ids, weights in (
            (x[t : t + 1], expert_ids[t : t + 1], router_weights[t : t + 1]),
            *[
                tuple(
                    torch.cat((e[:3], own[t : t + 1], e[3:]))
                    for e, own in zip(extra, (x, expert_ids, router_weights))
                )
            ],
        ):
            routing, hidden, y = layer(xs, ids, weights.reshape(-1))
            at = 0 if xs.shape[0] == 1 else 3
            for got, expected in zip((hidden, y), batch):
                token_rows = tokens_by_assignment(routing, got, xs.shape[0], A)
                assert torch.equal(token_rows[at], expected[t]), t


@pytest.mark.parametrize("compensate", [False, True])
def test_a_tokens_output_does_not_depend_on_its_batch_under_row_scales(kernel_device, compensate):
    # 12 tokens, one, or 7 (the token among 6 others 10^3 larger): 2 to 24 rows over 7 experts, the
    # interpreter's one configuration of the 16-row bucket; the token's rows land in other tiles at
    # other places. One scale per tensor moves them with the batch (so the test can tell the two
    # apart).
    E, D, I, A = 7, 80, 32, 2
    gate_up_q, down_q = _experts_case(E, D, I, kernel_device, 1)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    mask = torch.arange(D // 16, device=kernel_device) % 2 == 0 if compensate else None
    generator = torch.Generator().manual_seed(2)
    x = rows_of_many_magnitudes(12, D, 3).to(kernel_device)
    expert_ids = torch.rand(12, E, generator=generator).topk(A, dim=-1).indices.to(kernel_device)
    router_weights = torch.rand(12, A, generator=generator).to(kernel_device)
    extra = (
        torch.randn(6, D, generator=generator).to(kernel_device, torch.bfloat16) * 1e3,
        torch.rand(6, E, generator=generator).topk(A, dim=-1).indices.to(kernel_device),
        torch.rand(6, A, generator=generator).to(kernel_device),
    )
    assert_batch_invariant(
        expert_layer(grouped, gate_up_w, down_w, mask),
        x,
        expert_ids,
        router_weights,
        extra,
        (0, 6, 11),
    )
    amax = x.float().abs().amax(dim=-1)
    smallest = int(torch.where(amax > 0, amax, float("inf")).argmin())  # (token 6 is all zero)
    with pytest.raises(AssertionError):
        assert_batch_invariant(
            expert_layer(grouped, gate_up_w, down_w, mask, "tensor"),
            x,
            expert_ids,
            router_weights,
            extra,
            (smallest,),
        )


@pytest.mark.parametrize("act_scale", ["tensor", "row"])
def test_w4a16_operand_gives_x_times_the_dequantized_experts(kernel_device, act_scale):
    # gate/up and down on W4A16 operands (x / g * 2^-6, exact) against the float loop on x itself
    E, D, I, A, tokens = 7, 80, 32, 2, 21
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, kernel_device, seed=3)
    gate_up_q, down_q = _experts_case(E, D, I, kernel_device, 3)
    if act_scale == "row":
        x = rows_of_many_magnitudes(tokens, D, 3)
    else:
        x = torch.randn(tokens, D).bfloat16()
    x = x.to(kernel_device)  # bf16: x / g * 2^-6 exact in fp16
    router_weights = torch.rand(tokens * A, device=kernel_device)
    _, hidden, y = expert_layer(
        grouped,
        rac.chunk_experts(gate_up_q),
        rac.chunk_experts(down_q),
        act_scale=act_scale,
        quantize=False,
    )(x, expert_ids, router_weights)
    gate_up, down = gate_up_q.dequantize(torch.float32), down_q.dequantize(torch.float32)
    rows = x.float()[routing.token_ids].split(routing.counts.tolist())
    gate, up = torch.cat([r @ w.T for r, w in zip(rows, gate_up)]).chunk(2, dim=-1)
    reference = torch.nn.functional.silu(gate) * up
    assert_rows_close(hidden, reference, 1e-5, f"w4a16 gate/up {act_scale}")
    hidden = hidden.to(x.dtype).float()
    reference = torch.cat([r @ w.T for r, w in zip(hidden.split(routing.counts.tolist()), down)])
    assert_rows_close(
        y, reference * router_weights[routing.order][:, None], 1e-5, f"w4a16 down {act_scale}"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_grouped_kernels_match_the_reference_on_qwen3_expert_shapes(tokens):
    # through rac.grouped_matmul_triton: the kernel rac.backend picks here (Gluon on sm_89 / sm_90),
    # and the Triton kernel itself
    torch.manual_seed(0)
    E, D, I, A = 128, 2048, 768, 8
    routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
    act = rac.quantize_activation_triton(
        torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
        torch.arange(D // 16, device="cuda") % 4 == 0,
        codes=True,
    )
    gate_up_q = nvfp4.quantize_weight(
        torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    )
    reference = rac.grouped_matmul_reference(
        act.x_q,
        gate_up_q,
        routing.counts,
        act.residual,
        row_ids=routing.token_ids,
        swiglu=True,
        out_dtype=torch.float32,
    )
    for name, call in (("chosen", rac.grouped_matmul_triton), ("triton", grouped)):
        hidden = call(
            act,
            rac.chunk_experts(gate_up_q),
            routing.counts,
            row_ids=routing.token_ids,
            swiglu=True,
            out_dtype=torch.float32,
        )
        assert (
            report_diff(hidden, reference, f"gpu grouped gate/up T={tokens} {name}")[0]
            <= 2e-3 * reference.abs().max().item()
        )
    act = rac.quantize_activation_triton(reference.bfloat16(), codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
    row_weights = torch.rand(tokens * A, device="cuda")
    down_reference = rac.grouped_matmul_reference(
        act.x_q, down_q, routing.counts, row_weights=row_weights, out_dtype=torch.float32
    )
    for name, call in (("chosen", rac.grouped_matmul_triton), ("triton", grouped)):
        y = call(
            act,
            rac.chunk_experts(down_q),
            routing.counts,
            row_weights=row_weights,
            out_dtype=torch.float32,
        )
        assert (
            report_diff(y, down_reference, f"gpu grouped down T={tokens} {name}")[0]
            <= 1e-4 * down_reference.abs().max().item()
        )


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_row_scale_and_w4a16_grouped_kernels_on_qwen3_expert_shapes(tokens):
    # through rac.grouped_matmul_triton (Gluon on sm_89 / sm_90) and the Triton kernel itself: token
    # rows 10^-6 .. 10^6 apart with their own scales, against the reference; the W4A16 operand
    # against x @ DQ(W).T; at 64 tokens a token's output the same bits in its batch, alone and among
    # 40 others (one bucket)
    E, D, I, A = 128, 2048, 768, 8
    generator = torch.Generator().manual_seed(tokens)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, generator=generator).cuda() * 0.02)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, generator=generator).cuda() * 0.02)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    x = rows_of_many_magnitudes(tokens, D, tokens).cuda()
    expert_ids = torch.rand(tokens, E, generator=generator).topk(A, dim=-1).indices.cuda()
    router_weights = torch.rand(tokens, A, generator=generator).cuda()
    mask = torch.arange(D // 16, device="cuda") % 4 == 0
    for name, call in (
        (
            "chosen",
            lambda act, w, counts, **kw: rac.grouped_matmul_triton(
                act, w, counts, out_dtype=torch.float32, **kw
            ),
        ),
        ("triton", grouped),
    ):
        routing, hidden, y = expert_layer(call, gate_up_w, down_w, mask)(
            x, expert_ids, router_weights.view(-1)
        )
        x_q, residual = nvfp4.quantize_activation(x, mask, "row")
        assert_rows_close(
            hidden,
            rac.grouped_matmul_reference(
                x_q,
                gate_up_q,
                routing.counts,
                residual,
                row_ids=routing.token_ids,
                swiglu=True,
                out_dtype=torch.float32,
            ),
            2e-3,
            f"gpu row gate/up T={tokens} {name}",
        )
        h_q, _ = nvfp4.quantize_activation(hidden.bfloat16(), None, "row")
        assert_rows_close(
            y,
            rac.grouped_matmul_reference(
                h_q,
                down_q,
                routing.counts,
                row_weights=router_weights.view(-1),
                row_weight_ids=routing.order,
                out_dtype=torch.float32,
            ),
            1e-4,
            f"gpu row down T={tokens} {name}",
        )
        routing, hidden, _ = expert_layer(call, gate_up_w, down_w, quantize=False)(
            x, expert_ids, router_weights.view(-1)
        )
        rows = x.float()[routing.token_ids].split(routing.counts.tolist())
        gate, up = torch.cat(
            [r @ w.T for r, w in zip(rows, gate_up_q.dequantize(torch.float32))]
        ).chunk(2, -1)
        assert_rows_close(
            hidden,
            torch.nn.functional.silu(gate) * up,
            1e-4,
            f"gpu w4a16 gate/up T={tokens} {name}",
        )
        if tokens == 64:
            extra = (
                torch.randn(40, D, generator=generator).cuda().bfloat16() * 1e3,
                torch.rand(40, E, generator=generator).topk(A, dim=-1).indices.cuda(),
                torch.rand(40, A, generator=generator).cuda(),
            )
            assert_batch_invariant(
                expert_layer(call, gate_up_w, down_w, mask),
                x,
                expert_ids,
                router_weights,
                extra,
                (0, 33, 63),
            )


def test_triton_grouped_autotuner_steps_k_within_one_chunk_of_the_layout(monkeypatch):
    # the Triton grouped kernel reads ExpertWeights directly: where K spans several 128-element
    # chunks, its GPU configurations' 256-element steps become 128 (a step may not cross a chunk); K
    # of one chunk (here 192) keeps every step; each bucket keeps its own configurations
    monkeypatch.setattr(w4a4_common, "INTERPRET", False)  # the GPU table, not the interpreter's
    configs = w4a4_common.autotune_configs(w4a4_experts.GROUPED_CONFIGS)
    assert any(c.kwargs["BLOCK_K"] == 256 for c in configs)
    assert any(c.maxnreg for c in configs)  # the table's register cap reaches Triton
    for bucket, entries in w4a4_experts.GROUPED_CONFIGS.items():
        for K, chunk in ((2048, 128), (192, 192)):
            kept = w4a4_experts.grouped_prune(configs, {"M_BUCKET": bucket, "K": K}, CHUNK=chunk)
            assert [
                (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept
            ] == [(m, n, w, st) for m, n, _, w, st, *_ in entries]
            for c, (_, _, k, *_) in zip(kept, entries):
                assert c.kwargs["BLOCK_K"] == (min(k, chunk) if chunk < K else k), (bucket, K, c)
                assert chunk == K or chunk % c.kwargs["BLOCK_K"] == 0


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # each configuration forced and repeated (a miscompiled one showed as run-to-run differences) at
    # a prefill of 512 evaluation prompts, 26k tokens, on the small preset's shapes (gate/up with
    # row scales too)
    import triton

    torch.manual_seed(0)
    E, D, I, A, T = 32, 512, 256, 4, 26112
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda") * 0.05)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    x = rac.quantize_activation_triton(
        torch.randn(T, D, device="cuda", dtype=torch.bfloat16), codes=True
    )
    h = rac.quantize_activation_triton(
        torch.randn(T * A, I, device="cuda", dtype=torch.bfloat16), codes=True
    )
    x_rows = (
        torch.randn(T, D, device="cuda") * torch.logspace(-1, 1, T, device="cuda")[:, None]
    ).bfloat16()
    x_row = rac.quantize_activation_triton(x_rows, act_scale="row")
    x_row_q, _ = nvfp4.quantize_activation(x_rows, None, "row")
    row_weights = torch.rand(T * A, device="cuda")
    bucket = gemm_common.m_bucket(triton.cdiv(T * A, E), w4a4_experts.GROUPED_CONFIGS)
    calls = {
        "gate/up": (
            w4a4_experts.grouped_kernel,
            bucket,
            lambda c: False,
            lambda: grouped(x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True),
            rac.grouped_matmul_reference(
                x.x_q,
                gate_up_q,
                routing.counts,
                row_ids=routing.token_ids,
                swiglu=True,
                out_dtype=torch.float32,
            ),
        ),
        "down": (
            w4a4_experts.grouped_kernel,
            bucket,
            lambda c: False,
            lambda: grouped(h, down_w, routing.counts, row_weights=row_weights),
            rac.grouped_matmul_reference(
                h.x_q, down_q, routing.counts, row_weights=row_weights, out_dtype=torch.float32
            ),
        ),
        "gate/up, row scales": (
            w4a4_experts.grouped_kernel,
            bucket,
            lambda c: False,
            lambda: grouped(
                x_row, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True
            ),
            rac.grouped_matmul_reference(
                x_row_q,
                gate_up_q,
                routing.counts,
                row_ids=routing.token_ids,
                swiglu=True,
                out_dtype=torch.float32,
            ),
        ),
    }
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)
