"""gpu_kernels/w4a4_dense.py: the dense W4A4 GEMM (split-K, the prefill weight pass, stacked q/k/v
weights) against rac.nvfp4_linear_reference / rac.matmul_reference and the prefill pass against the
fp16 operand's definition (CPU under TRITON_INTERPRET=1, GPU natively); per-row x scales against the
reference on row-quantized activations, bit for bit the one-scale results where the scales are
equal, and a row's output independent of its batch; the W4A16 operand against x @ DQ(W).T; every
GPU configuration forced in turn. (Its autotuning table's fields: test_kernels_w4a4_common.py.)"""

import pytest
import torch
from conftest import raises_one_line, relative_error, report_diff, same_bits
from test_kernels_w4a4_quantize import operand_oracle, rows_of_many_magnitudes

import nvfp4
import rac

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w4a4_dense  # noqa: E402


def _dense_case(rows, cols, out_features, device, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 4
    w_q = nvfp4.quantize_weight(torch.randn(out_features, cols, device=device))
    return x, w_q


def _dense(act, w_q, out_dtype=torch.float32, splits=None, **variant):
    return w4a4_dense.dense_matmul(
        act.operand,
        act.global_scale,
        w_q.data,
        w_q.block_scale,
        w_q.global_scale,
        out_dtype,
        splits,
        **variant,
    )


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("cols,out_features", [(16, 24), (48, 40), (96, 33), (256, 72)])
@pytest.mark.parametrize("compensate", [False, True])
def test_dense_kernel_matches_the_layer_reference(
    kernel_device, rows, cols, out_features, compensate
):
    # 1, 3 and 17 rows: the interpreter's decode buckets (split-K at 64 and below); odd K masked
    x, w_q = _dense_case(rows, cols, out_features, kernel_device, rows + cols + out_features)
    mask = torch.arange(cols // 16, device=kernel_device) % 2 == 0 if compensate else None
    y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
    reference = rac.nvfp4_linear_reference(x, w_q, mask)
    max_diff, _ = report_diff(
        y, reference, f"dense M={rows} K={cols} N={out_features} rac={compensate}"
    )
    # fp32 accumulation order only; with a residual also the fp16 rounding of x + r (2^-12 relative)
    assert max_diff <= (2e-3 if compensate else 1e-5) * reference.abs().max().item() + 1e-6
    y_bf16 = rac.nvfp4_linear_triton(x, w_q, mask)
    assert y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(
        y_bf16.float(), reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item()
    )


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_prefill_and_partial_max_paths_match_the_decode_path(kernel_device, monkeypatch, rows):
    # the weight decoded once (prefill) or in registers, whatever the row count, with the amax from
    # the partial-max launch; the same layer's decode result is the oracle, and both equal the
    # reference
    x, w_q = _dense_case(rows, 96, 40, kernel_device, rows)
    mask = torch.arange(6, device=kernel_device) < 4
    act = rac.quantize_activation_triton(x, mask)
    in_registers, prefill = _dense(act, w_q, prefill=False), _dense(act, w_q, prefill=True)
    assert (
        report_diff(prefill, in_registers, "prefill vs decode")[0]
        <= 1e-5 * in_registers.abs().max().item()
    )
    monkeypatch.setattr(rac.w4a4_quantize, "AMAX_IN_LAUNCH", 0)
    y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)  # PREFILL_ROWS decides
    assert (
        report_diff(y, in_registers, "partial max vs in launch")[0]
        <= 1e-5 * in_registers.abs().max().item()
    )
    reference = rac.nvfp4_linear_reference(x, w_q, mask)
    assert report_diff(prefill, reference)[0] <= 2e-3 * reference.abs().max().item()


def test_prefill_weight_pass_matches_its_reference(kernel_device):
    torch.manual_seed(0)
    w_q = nvfp4.quantize_weight(torch.randn(40, 96, device=kernel_device))
    assert same_bits(w4a4_dense.weight_operand(w_q.data, w_q.block_scale), operand_oracle(w_q))


def test_split_k_counters_are_reset_so_repeated_calls_agree(kernel_device):
    # the interpreter's decode bucket splits K in two
    x, w_q = _dense_case(3, 256, 72, kernel_device, 3)
    first = rac.nvfp4_linear_triton(x, w_q, out_dtype=torch.float32)
    counters = w4a4_dense.SPLIT_COUNTERS[w_q.device]
    assert (counters == 0).all()
    assert torch.equal(rac.nvfp4_linear_triton(x, w_q, out_dtype=torch.float32), first)


def _stacked(weights):
    """Three weights quantized one by one (their own global scales), stacked along N as q/k/v
    are."""
    qs = [nvfp4.quantize_weight(w) for w in weights]
    return qs, rac.stack_weights(qs)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("compensate", [False, True])
def test_stacked_weights_give_each_weight_its_own_global_scale_and_output(
    kernel_device, rows, compensate
):
    # 40 / 24 / 8 rows: tiles straddle the weights (the interpreter's BLOCK_N is 32); the three
    # global scales differ by 2^10
    generator = torch.Generator().manual_seed(rows)
    weights = [
        torch.randn(n, 96, generator=generator).to(kernel_device) * scale
        for n, scale in ((40, 1.0), (24, 2.0**10), (8, 2.0**-10))
    ]
    qs, stacked = _stacked(weights)
    x = torch.randn(rows, 96, generator=generator).to(kernel_device, torch.bfloat16)
    mask = torch.arange(6, device=kernel_device) % 2 == 0 if compensate else None
    outputs = rac.nvfp4_linear_triton(x, stacked, mask, out_dtype=torch.float32, splits=(40, 24, 8))
    assert [tuple(y.shape) for y in outputs] == [(rows, 40), (rows, 24), (rows, 8)]
    tolerance = 2e-3 if compensate else 1e-5
    # each against its own layer's reference, and contiguous (q/k norms read rows)
    for y, q in zip(outputs, qs):
        reference = rac.nvfp4_linear_reference(x, q, mask)
        assert y.is_contiguous()
        assert report_diff(y, reference)[0] <= tolerance * reference.abs().max() + 1e-30


# ------------------------------------------------------------------ per-row x scales, W4A16 operand
def assert_rows_close(y, reference, tolerance, name=""):
    """Each row of y within tolerance * its reference row's max |value| (rows many magnitudes apart:
    one max over the tensor would hide the small rows' errors); a zero reference row must come out
    zero."""
    diff = (y.double() - reference.double()).abs().amax(dim=-1).cpu()
    scale = reference.double().abs().amax(dim=-1).cpu()
    error = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
    print(f"{name} worst row error {error.max().item():.3e}")
    assert (error <= tolerance).all(), (name, error)  # NaN fails too


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("compensate", [False, True])
def test_row_scale_dense_kernel_matches_the_reference_per_row(kernel_device, rows, compensate):
    # rows 10^-6 .. 10^6 apart, each with its own global scale: the interpreter's split-K buckets
    # (up to 64 rows) and the prefill pass (300), three stacked weights whose global scales differ
    # by 2^10
    x = rows_of_many_magnitudes(rows, 96, rows).to(kernel_device)
    mask = torch.arange(6, device=kernel_device) % 2 == 0 if compensate else None
    generator = torch.Generator().manual_seed(rows)
    weights = [
        torch.randn(n, 96, generator=generator).to(kernel_device) * scale
        for n, scale in ((40, 1.0), (24, 2.0**10), (8, 2.0**-10))
    ]
    qs, stacked = _stacked(weights)
    act = rac.quantize_activation_triton(x, mask, act_scale="row")
    x_q, residual = nvfp4.quantize_activation(x, mask, "row")
    # as the one-scale tests: fp32 order (and fp16 rounding of x + r)
    tolerance = 2e-3 if compensate else 1e-5
    assert_rows_close(
        _dense(act, qs[0]),
        rac.matmul_reference(x_q, qs[0], residual, torch.float32),
        tolerance,
        f"row-scale dense M={rows}",
    )
    for y, q in zip(_dense(act, stacked, splits=(40, 24, 8)), qs):
        assert_rows_close(y, rac.matmul_reference(x_q, q, residual, torch.float32), tolerance)


@pytest.mark.parametrize("rows", [3, 64, 300])
@pytest.mark.parametrize("prefill", [False, True])
def test_row_scales_equal_to_the_tensors_give_its_results_bit_for_bit(kernel_device, rows, prefill):
    # the epilogue forms (2^12 g_x) g_w in the same order whether g_x is one or one per row
    x, w_q = _dense_case(rows, 96, 40, kernel_device, rows)
    act = rac.quantize_activation_triton(x, torch.arange(6, device=kernel_device) < 3)
    per_row = act.global_scale.expand(rows).contiguous()
    for splits, w in (
        (None, w_q),
        (
            (16, 16, 8),
            _stacked(
                [
                    w_q.dequantize(torch.float32)[:16] * 3,
                    w_q.dequantize(torch.float32)[16:32],
                    w_q.dequantize(torch.float32)[32:] * 0.1,
                ]
            )[1],
        ),
    ):
        one = w4a4_dense.dense_matmul(
            act.operand,
            act.global_scale,
            w.data,
            w.block_scale,
            w.global_scale,
            torch.float32,
            splits,
            prefill=prefill,
        )
        each = w4a4_dense.dense_matmul(
            act.operand,
            per_row,
            w.data,
            w.block_scale,
            w.global_scale,
            torch.float32,
            splits,
            prefill=prefill,
        )
        assert all(
            torch.equal(a, b)
            for a, b in zip(one if splits else (one,), each if splits else (each,))
        )


def _row_layer(w_q, mask, act_scale):
    def layer(x):
        return _dense(rac.quantize_activation_triton(x, mask, act_scale=act_scale), w_q)

    return layer


@pytest.mark.parametrize("compensate", [False, True])
def test_a_rows_output_does_not_depend_on_its_batch_under_row_scales(kernel_device, compensate):
    # a row's quantization depends on itself alone, and its GEMM output on its own operand row and
    # scale: within one configuration (here the 16-row bucket's: 12, 1 and 7 rows, split-K, the same
    # tiles) the same bits whatever else is in the batch and wherever the row sits in it. One scale
    # per tensor moves the row's output with its batch (so the test can tell the two apart).
    x = rows_of_many_magnitudes(12, 96, 0).to(kernel_device)
    others = torch.randn(6, 96, device=kernel_device, dtype=torch.bfloat16) * 1e3
    _, w_q = _dense_case(1, 96, 40, kernel_device, 0)
    mask = torch.arange(6, device=kernel_device) % 3 == 0 if compensate else None
    layer, tensor_layer = _row_layer(w_q, mask, "row"), _row_layer(w_q, mask, "tensor")
    batch = layer(x)
    for i in (0, 5, 11):
        alone, mixed = layer(x[i : i + 1]), layer(torch.cat((others[:3], x[i : i + 1], others[3:])))
        assert torch.equal(alone[0], batch[i]) and torch.equal(mixed[3], batch[i]), i
    mixed = tensor_layer(torch.cat((others[:3], x[5:6], others[3:])))
    assert not torch.equal(mixed[3], tensor_layer(x)[5])


@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("act_scale", ["tensor", "row"])
def test_w4a16_operand_gives_x_times_the_dequantized_weight(kernel_device, rows, act_scale):
    # the operand is x / g * 2^-6 exactly and the epilogue multiplies by 2^12 g: x @ DQ(W).T to fp32
    # order. Per row, rows 10^-6 .. 10^6 apart; one scale for all takes rows of like magnitudes (far
    # smaller ones would fall into fp16's subnormals)
    x, w_q = _dense_case(rows, 96, 40, kernel_device, rows)
    if act_scale == "row":
        x = rows_of_many_magnitudes(rows, 96, rows).to(kernel_device)
    act = rac.quantize_activation_triton(
        x, codes=False, operand=True, act_scale=act_scale, quantize=False
    )
    assert act.x_q is None and act.residual is None
    reference = x.float() @ w_q.dequantize(torch.float32).T
    assert_rows_close(_dense(act, w_q), reference, 1e-5, f"w4a16 dense M={rows} {act_scale}")


def test_a_global_scale_neither_one_nor_one_per_row_is_refused(kernel_device):
    x, w_q = _dense_case(3, 32, 16, kernel_device, 0)
    act = rac.quantize_activation_triton(x)
    raises_one_line(
        lambda: w4a4_dense.dense_matmul(
            act.operand,
            torch.ones(4, device=kernel_device),
            w_q.data,
            w_q.block_scale,
            w_q.global_scale,
            torch.float32,
        ),
        "x_global_scale",
        "one per operand row (3,)",
    )


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 300, 1500])
@pytest.mark.parametrize("out_features,cols", [(4096, 2048), (512, 2048), (2048, 4096), (200, 96)])
def test_dense_kernel_matches_the_reference_on_gpu_shapes(rows, out_features, cols):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w_q = nvfp4.quantize_weight(
        torch.randn(out_features, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    )
    for mask in (None, torch.arange(cols // 16, device="cuda") % 2 == 0):
        y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
        reference = rac.nvfp4_linear_reference(x, w_q, mask)
        max_diff, _ = report_diff(
            y, reference, f"gpu dense M={rows} N={out_features} K={cols} rac={mask is not None}"
        )
        assert max_diff <= (2e-3 if mask is not None else 1e-4) * reference.abs().max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 300, 1500])
@pytest.mark.parametrize("splits,cols", [((4096, 512, 512), 2048), (None, 4096)])
def test_row_scale_and_w4a16_dense_on_gpu_shapes(rows, splits, cols):
    # Qwen3-30B-A3B's q/k/v (stacked, 5120 x 2048) and o_proj (2048 x 4096), rows 10^-6 .. 10^6
    # apart
    x = rows_of_many_magnitudes(rows, cols, rows).cuda()
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, cols, generator=generator).cuda() * 0.02 for n in (splits or (2048,))]
    if splits:
        qs, w_q = _stacked(weights)
    else:
        w_q = nvfp4.quantize_weight(weights[0])
        qs = [w_q]
    for mask in (None, torch.arange(cols // 16, device="cuda") % 2 == 0):
        act = rac.quantize_activation_triton(x, mask, act_scale="row")
        x_q, residual = nvfp4.quantize_activation(x, mask, "row")
        outputs = _dense(act, w_q, splits=splits)
        for y, q in zip(outputs if splits else (outputs,), qs):
            assert_rows_close(
                y,
                rac.matmul_reference(x_q, q, residual, torch.float32),
                2e-3 if mask is not None else 1e-4,
                f"gpu row dense M={rows} K={cols}",
            )
    for act_scale in ("row", "tensor"):
        if act_scale == "row":
            x_w4a16 = x
        else:
            x_w4a16 = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        act = rac.quantize_activation_triton(x_w4a16, act_scale=act_scale, quantize=False)
        outputs = _dense(act, w_q, splits=splits)
        for y, q in zip(outputs if splits else (outputs,), qs):
            assert_rows_close(
                y,
                x_w4a16.float() @ q.dequantize(torch.float32).T,
                1e-4,
                f"gpu w4a16 dense M={rows} K={cols} {act_scale}",
            )


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [16, 64, 256])
def test_a_rows_output_does_not_depend_on_its_batch_on_gpu_shapes(rows):
    # Qwen3's stacked q/k/v: a batch of `rows`, a row among others (two thirds as many rows: the
    # same autotuning bucket, so the same configuration), and at 16 a row alone
    x = rows_of_many_magnitudes(rows, 2048, rows).cuda()
    generator = torch.Generator().manual_seed(rows)
    _, w_q = _stacked(
        [torch.randn(n, 2048, generator=generator).cuda() * 0.02 for n in (4096, 512, 512)]
    )
    others = torch.randn(rows * 2 // 3, 2048, generator=generator).cuda().bfloat16() * 1e3
    for mask in (None, torch.arange(128, device="cuda") % 2 == 0):

        def layer(x):
            act = rac.quantize_activation_triton(x, mask, act_scale="row")
            return torch.cat(_dense(act, w_q, splits=(4096, 512, 512)), dim=1)

        batch = layer(x)
        for i in (0, rows // 2 + 1, rows - 1):
            mixed = layer(torch.cat((others[:3], x[i : i + 1], others[3:])))
            assert torch.equal(mixed[3], batch[i]), (rows, i)
            if rows <= 16:
                assert torch.equal(layer(x[i : i + 1])[0], batch[i]), (rows, i)


@pytest.mark.cuda
def test_a_weight_copied_in_just_before_the_layer_is_the_one_it_reads():
    # a weight copied into the layer's buffers right before it runs (as sync_weights does) must be
    # the one the GEMM reads: two weights take turns in one buffer, each call gives that weight's
    # output
    torch.manual_seed(0)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    pair = [
        nvfp4.quantize_weight(torch.randn(4096, 2048, device="cuda") * scale)
        for scale in (0.02, 3.0)
    ]
    expected = [rac.nvfp4_linear_triton(x, w_q, out_dtype=torch.float32) for w_q in pair]
    assert relative_error(expected[0], rac.nvfp4_linear_reference(x, pair[0])) < 1e-3
    live = nvfp4.NVFP4Tensor(
        *(t.clone() for t in (pair[0].data, pair[0].block_scale, pair[0].global_scale))
    )
    for i in range(20):
        for field in ("data", "block_scale", "global_scale"):
            getattr(live, field).copy_(getattr(pair[i % 2], field))
        assert torch.equal(
            rac.nvfp4_linear_triton(x, live, out_dtype=torch.float32), expected[i % 2]
        ), i


def forced_configs(kernel, bucket, relabel=lambda config: True):
    """Each of the kernel's autotuning configurations in turn: the bucket's own, and those of other
    buckets that `relabel` accepts, relabelled for `bucket` so the pruner keeps them."""
    import triton

    configs = list(kernel.configs)
    try:
        for config in configs:
            if config.kwargs["BUCKET"] != bucket and not relabel(config):
                continue
            kernel.configs = [
                triton.Config(
                    {**config.kwargs, "BUCKET": bucket},
                    num_warps=config.num_warps,
                    num_stages=config.num_stages,
                    maxnreg=config.maxnreg,
                )
            ]
            kernel.cache.clear()
            yield config
    finally:
        kernel.configs = configs
        kernel.cache.clear()


def deterministic_and_close(calls, repeats=10):
    """calls: name -> (kernel, bucket, relabel, call, reference). Every configuration forced in turn
    must repeat its result bit for bit and stay within 2e-3 of the reference (relative to its max)
    -> failures."""
    failures = []
    for name, (kernel, bucket, relabel, call, reference) in calls.items():
        for config in forced_configs(kernel, bucket, relabel=relabel):
            first = call()
            differing = sum(not torch.equal(call(), first) for _ in range(repeats))
            error = ((first - reference).abs().max() / reference.abs().max()).item()
            if differing or not error <= 2e-3:  # NaN fails too
                failures.append(
                    f"{name} {config}: {differing}/{repeats} repeats differ, "
                    f"relative error {error:.2e}"
                )
    return failures


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # Autotuning may pick any configuration, so each one is forced and repeated (a miscompiled one
    # showed as run-to-run differences): at each decode bucket (split-K; RAC; one x scale and one
    # per row) and at prefill size, where the configurations without split-K of every bucket are
    # tried too (split-K scratch is sized per bucket).
    torch.manual_seed(0)
    D, T = 512, 26112
    w_q = nvfp4.quantize_weight(torch.randn(512, D, device="cuda") * 0.05)
    x = rac.quantize_activation_triton(
        torch.randn(T, D, device="cuda", dtype=torch.bfloat16), codes=True
    )
    calls = {
        "dense prefill": (
            w4a4_dense.dense_kernel,
            4096,
            lambda c: c.kwargs["SPLIT_K"] == 1,
            lambda: _dense(x, w_q),
            rac.matmul_reference(x.x_q, w_q, out_dtype=torch.float32),
        )
    }
    mask = torch.arange(D // 16, device="cuda") % 2 == 0
    for rows in (2, 16, 64, 256):  # each decode bucket
        x_small = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
        act = rac.quantize_activation_triton(x_small, mask)
        calls[f"dense decode M={rows}"] = (
            w4a4_dense.dense_kernel,
            gemm_common.m_bucket(rows, w4a4_dense.DENSE_CONFIGS),
            lambda c: False,
            lambda act=act: _dense(act, w_q),
            rac.nvfp4_linear_reference(x_small, w_q, mask),
        )
        # and with a scale per row (rows 10x apart either way: the max over the tensor still sees
        # each)
        x_rows = (x_small.float() * torch.logspace(-1, 1, rows, device="cuda")[:, None]).bfloat16()
        act = rac.quantize_activation_triton(x_rows, mask, act_scale="row")
        x_q, residual = nvfp4.quantize_activation(x_rows, mask, "row")
        calls[f"dense decode row scales M={rows}"] = (
            w4a4_dense.dense_kernel,
            gemm_common.m_bucket(rows, w4a4_dense.DENSE_CONFIGS),
            lambda c: False,
            lambda act=act: _dense(act, w_q),
            rac.matmul_reference(x_q, w_q, residual, torch.float32),
        )
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)
