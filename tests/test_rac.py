"""rac.py: the activation quantizer (bit for bit), the dense (GEMV, split-K, prefill) and
grouped W4A4 kernels against their dequantize-then-matmul twins (CPU under TRITON_INTERPRET=1, GPU
natively), every autotuning configuration on the GPU, the Blackwell kernels' guard and sm_100
compilation, residual activation compensation (block selection, calibration, the error it removes),
q/k/v sharing one quantization and one GEMM, model conversion, weight sync against the QAT weight rule,
and clear errors."""
import copy
import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import HAS_TRITON, bits, raises_one_line, relative_error, report_diff, same_bits, tiny_model

import fp8
import moe
import nvfp4
import qat
import rac


def _outlier_activations(rows, cols, seed, device="cpu", dtype=torch.bfloat16):
    """Heavy-tailed activations with a fixed set of outlier channels (as a real layer input has)."""
    generator = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(0.5 * torch.randn(cols, generator=generator))
    channel_scale[torch.randperm(cols, generator=generator)[:max(1, cols // 32)]] *= 20.0

    def batch():
        t = torch.distributions.StudentT(4.0).sample((rows, cols)) * channel_scale
        return t.to(device, dtype)
    return batch


# ============================================================================ quantizer
@pytest.mark.parametrize("rows,cols", [(1, 16), (3, 48), (17, 80), (64, 768)])
@pytest.mark.parametrize("compensate", [False, True])
def test_quantizer_matches_its_twin_bit_for_bit(kernel_device, rows, cols, compensate):
    # (64, 768) has 49152 elements: above AMAX_IN_LAUNCH, so its amax comes from the partial-max launch
    torch.manual_seed(rows * cols)
    x = (torch.randn(rows, cols) * torch.exp(torch.randn(cols))).to(kernel_device, torch.bfloat16)
    x[0, :5] = -1e-30  # negative values that round to zero
    mask = (torch.arange(cols // 16, device=kernel_device) % 2 == 0) if compensate else None
    act = rac.quantize_activation_triton(x, mask, codes=True, operand=True)
    x_q, residual = rac.quantize_activation_reference(x.cpu(), None if mask is None else mask.cpu())
    assert same_bits(act.global_scale, x_q.global_scale)
    assert same_bits(act.x_q.data, x_q.data) and same_bits(act.x_q.block_scale, x_q.block_scale)
    if compensate:
        assert same_bits(act.residual.data, residual.data)
        assert same_bits(act.residual.block_scale, residual.block_scale)
        # unselected blocks carry no residual; selected ones do (the test input has no exact blocks)
        scales = residual.block_scale.float()
        assert (scales[:, ~mask.cpu()] == 0).all() and (scales[:, mask.cpu()] > 0).any()
    else:
        assert act.residual is None
    assert same_bits(act.operand, rac.activation_operand(x_q, residual))
    # the operand twin is the definition: (code value * block scale, x's and r's summed) * 2^-6 in fp16
    def values(q):
        codes = nvfp4.unpack_codes(q.data.cpu())
        magnitude = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
        signed = torch.where(codes >= 8, -magnitude, magnitude).view(rows, -1, 16)
        return (signed * q.block_scale.cpu().double()[..., None]).view(rows, cols)
    exact = values(x_q) + (values(residual) if residual is not None else 0.0)
    planes = torch.stack((exact[:, 0::2], exact[:, 1::2])) * 2.0 ** -6
    assert torch.equal(rac.activation_operand(x_q, residual).double(), planes.half().double())


def test_quantizer_zeros_and_nan(kernel_device):
    zeros = torch.zeros(2, 32, device=kernel_device, dtype=torch.bfloat16)
    act = rac.quantize_activation_triton(zeros, torch.ones(2, dtype=torch.bool, device=kernel_device),
                                         codes=True)
    assert act.global_scale.item() == 1.0 and (act.operand == 0).all() and (act.residual.data == 0).all()
    x = torch.randn(3, 32, device=kernel_device)
    x[1, 20] = float("nan")
    act = rac.quantize_activation_triton(x, torch.ones(2, dtype=torch.bool, device=kernel_device))
    x_q, residual = rac.quantize_activation_reference(x.cpu(), torch.ones(2, dtype=torch.bool))
    assert act.global_scale.isnan().item() and x_q.global_scale.isnan().item()
    assert same_bits(act.operand, rac.activation_operand(x_q, residual))
    assert act.operand[:, 1, 8:].isnan().all()  # the NaN block (columns 16..31) stays NaN


@pytest.mark.parametrize("rows", [3, 16])  # 3 x 4096: narrow chunks; 16 x 4096: wide ones
def test_partial_max_finds_the_largest_value_in_every_chunk_of_a_slice(kernel_device, monkeypatch, rows):
    # two slices, so that each program of the partial-max launch loops over several chunks
    monkeypatch.setattr(rac, "_AMAX_SLICES", 2)
    numel = rows * 4096
    chunk = rac._partial_chunk(numel)
    assert chunk == (4 if rows == 16 else 1) * rac._AMAX_CHUNK
    torch.manual_seed(rows)
    base = torch.rand(numel) * 0.5
    # the first and last element, and the first and last of every chunk
    places = sorted({0, numel - 1} | {c * chunk + e for c in range(numel // chunk) for e in (0, chunk - 1)})
    for place in places:
        x = base.clone()
        x[place] = -3.0 if place % 2 else 3.0
        partials = rac._partial_amax(x.view(rows, 4096).to(kernel_device, torch.bfloat16))
        assert partials.numel() == 2 and partials.max().item() == 3.0, place
    # and the quantizer takes its global scale from them
    x = base.view(rows, 4096).to(kernel_device, torch.bfloat16)
    scale = rac.quantize_activation_triton(x).global_scale
    assert same_bits(scale, nvfp4.compute_global_scale(x.cpu().float()))


def _compiled_output(script):
    """Run a compile-only script in a fresh Python with the interpreter off (Triton compiles for a GPU it
    does not have, with its own ptxas) -> its stdout lines."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


_COMPILE_PREAMBLE = r"""
import re, triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
def jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # through autotune and heuristics
        kernel = kernel.fn
    return kernel
i = "i32"
"""


_COMPILE_FOR_SM90 = _COMPILE_PREAMBLE + r"""
kernels = {
    "quantizer": (rac._quantize_activation_kernel,
                  ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*u8", "*u8", "*u8", "*u8", "*fp16"] + [i] * 5,
                  dict(AMAX_HERE=True, HAS_RESIDUAL=True, X_BF16=True, WRITE_CODES=True, WRITE_OPERAND=True,
                       BLOCKS=32, CHUNK=4096, PARTIALS=1, PDL=False, EARLY=False)),
}
for name, (kernel, types, constants) in kernels.items():
    kernel = jit(kernel)
    for gpu in (True, False):
        c = dict(constants, GPU=gpu)
        names = kernel.arg_names
        signature = dict(zip([n for n in names if n not in c], types))
        signature.update({n: "constexpr" for n in c})
        ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(name.replace(" ", "_"), gpu, len(re.findall(r"\bmul\.rn\.f32\b", ptx)))
"""


_COMPILE_PDL_FOR_SM90 = _COMPILE_PREAMBLE + r"""
dense_types = ["*fp16", "*fp32", "*u8", "*u8", "*fp32", "*i16", "*fp32", "*i32"] + [i] * 11
kernels = {
    "partial_max": (rac._partial_amax_kernel, ["*bf16", "*fp32", i], dict(SLICE=4096, CHUNK=4096)),
    "quantizer": (rac._quantize_activation_kernel,
                  ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*u8", "*u8", "*u8", "*u8", "*fp16"] + [i] * 5,
                  dict(AMAX_HERE=False, HAS_RESIDUAL=True, X_BF16=True, WRITE_CODES=True, WRITE_OPERAND=True,
                       BLOCKS=32, CHUNK=4096, PARTIALS=256, GPU=True)),
    "dense_split_k": (rac._dense_kernel, dense_types,
                      dict(W_FP16=False, OUT_BF16=True, BUCKET=16, EVEN_K=True, BLOCK_M=16, BLOCK_N=64,
                           BLOCK_K=256, SPLIT_K=4, X_FIRST=True, GPU=True)),
    "GEMV": (rac._gemv_kernel, ["*fp16", "*fp32", "*u8", "*u8", "*fp32", "*i16"] + [i] * 7,
             dict(OUT_BF16=True, GPU=True, BLOCK_N=4, BLOCK_K=2048, STEPS=2, EVEN_K=True)),
    "grouped": (rac._grouped_kernel,
                ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*i16"] + [i] * 13,
                dict(GATHER=True, ROW_WEIGHTS=True, WEIGHT_IDS=True, SWIGLU=True, OUT_BF16=True, GPU=True,
                     E_POW2=128, CHUNK=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, BUCKET=16,
                     EVEN_K=True, X_FIRST=True)),
}
memory = re.compile(r"\b(?:ld|st|atom|red)\.global\b|\bcp\.async\b")


def _after_weights(ptx, wait):
    # Where the GEMV's memory accesses other than its weight loads may begin: it loads its first weight
    # tile (params 2 and 3: codes, block scales) before the wait, and nothing else. Each access before
    # the wait must be a load whose address derives from those two pointers alone (register taint through
    # the PTX), else the position of the offending access is returned.
    tainted = {}  # register -> the params it derives from
    head = ptx[:wait] if wait >= 0 else ptx
    for line in head.splitlines():
        param = re.search(r"ld\.param\.(\w+)\s+(%\w+),\s*\[\w+_param_(\d+)\]", line)
        if param:  # pointers are the 64-bit params (sizes and strides are 32-bit)
            tainted[param.group(2)] = {int(param.group(3))} if param.group(1) in ("b64", "u64") else set()
            continue
        regs = re.findall(r"%\w+", line)
        if not regs:
            continue
        sources = set().union(*(tainted.get(r, set()) for r in regs[1:]))
        access = memory.search(line)
        if access and (not line.strip().lstrip("@%p0123456789 !").startswith("ld.global")
                       or not sources or not sources <= {2, 3}):
            return ptx.find(line)
        if not access and sources:
            tainted[regs[0]] = tainted.get(regs[0], set()) | sources
    return wait if wait >= 0 else 0


for name, (kernel, types, constants) in kernels.items():
    kernel = jit(kernel)
    small = "EARLY" in kernel.arg_names
    flags = [dict(PDL=False), dict(PDL=True)] + ([dict(PDL=True, EARLY=True)] if small else [])
    for extra in flags:
        extra = {"EARLY": False, **extra} if small else extra
        c = dict(constants, **extra)
        signature = dict(zip([n for n in kernel.arg_names if n not in c], types))
        signature.update({n: "constexpr" for n in c})
        ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        first = memory.search(ptx, 0 if name != "GEMV" else _after_weights(ptx, wait))
        print(name, int(extra["PDL"]), int(extra.get("EARLY", False)), int(wait >= 0),
              int(wait >= 0 and first is not None and wait < first.start()),
              int("griddepcontrol.launch_dependents" in ptx))
"""


def test_kernels_launched_after_the_previous_one_wait_for_it_before_any_memory_access():
    # Programmatic dependent launch: a kernel may start before the one ahead of it in the stream ends, so
    # its griddepcontrol.wait must come before its first global load or store (else it reads stale data,
    # now and then); with PDL off (pre-Hopper GPUs) the instructions must be absent (sm_80 lacks them).
    rows = [line.split() for line in _compiled_output(_COMPILE_PDL_FOR_SM90)]
    seen = {(name, pdl, early): (wait, before, trigger) for name, pdl, early, wait, before, trigger in rows}
    names = {"partial_max", "quantizer", "GEMV", "dense_split_k", "grouped"}
    assert {name for name, *_ in seen} == names, seen
    for name in names:
        assert seen[name, "0", "0"] == ("0", "0", "0"), (name, seen[name, "0", "0"])
        assert seen[name, "1", "0"] == ("1", "1", "0"), (name, seen[name, "1", "0"])
    for name in ("partial_max", "quantizer"):  # the small kernels can let the next one launch early
        assert seen[name, "1", "1"] == ("1", "1", "1"), (name, seen[name, "1", "1"])


def test_pdl_is_used_on_hopper_and_later_and_early_launch_only_where_asked(monkeypatch):
    for capability, expected in (((8, 0), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr(rac, "_INTERPRET", False)
        rac._CAPABILITIES.clear()
        device = torch.device("cuda", 0)
        assert rac._launch_options(device) == dict(PDL=expected, launch_pdl=expected)
        assert rac._launch_options(device, early=True)["EARLY"] == expected
        assert rac._launch_options(device, early=False)["EARLY"] is False
    rac._CAPABILITIES.clear()
    assert rac._launch_options(torch.device("cpu"), early=True) == dict(PDL=False, launch_pdl=False,
                                                                        EARLY=False)


def test_layers_take_their_twins_with_one_warning_on_gpus_older_than_sm89(monkeypatch):
    # an A100 (8.0) cannot compile the kernels' E4M3 conversions: the NVFP4 layers run the torch twins there,
    # and say so once per GPU, instead of failing inside the kernel compiler
    class CudaTensor:  # what use_triton reads of a tensor
        is_cuda, device = True, torch.device("cuda", 0)

    monkeypatch.setattr(nvfp4, "_use_triton", lambda x: x.is_cuda)
    for capability, fast in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                             ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr(rac, "_CAPABILITIES", {})
        monkeypatch.setattr(rac, "_OLD_GPUS_WARNED", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [rac.use_triton(CudaTensor()) for _ in range(3)] == [fast] * 3, capability
        messages = [str(w.message) for w in caught]
        assert len(messages) == (0 if fast else 1), (capability, messages)
        if not fast:
            assert "8.9+" in messages[0] and f"this GPU: {capability[0]}.{capability[1]}" in messages[0]
    assert rac.use_triton(torch.zeros(1)) is False  # CPU tensors: the twins, silently


def test_only_small_quantizer_launches_before_the_experts_or_a_one_row_gemv_let_the_next_one_launch_early(
        monkeypatch, kernel_device):
    launches = []
    original = rac._launch_options
    monkeypatch.setattr(rac, "_launch_options", lambda device, early=None: launches.append(early) or
                        original(device, early))
    monkeypatch.setattr(rac, "EARLY_LAUNCH_PROGRAMS", 16)  # 32 rows of 256: 512 blocks, 16 programs of 32
    for rows, early_launch, expected in ((32, True, True), (33, True, False), (32, False, False)):
        launches.clear()
        x = torch.randn(rows, 256).bfloat16().to(kernel_device)
        rac.quantize_activation_triton(x, early_launch=early_launch)
        assert launches == [True, expected], (rows, early_launch, launches)  # partial max, then quantizer
    experts = rac.NVFP4Experts(4, 64, 32, device=kernel_device)
    monkeypatch.setattr(rac, "use_triton", lambda x: True)
    calls = []
    quantize = rac.quantize_activation_triton
    monkeypatch.setattr(rac, "quantize_activation_triton", lambda *args, **kwargs:
                        calls.append(kwargs.get("early_launch")) or quantize(*args, **kwargs))
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    x = torch.randn(3, 64).bfloat16().to(kernel_device)
    experts(x, ids.to(kernel_device), torch.rand(3, 2).to(kernel_device))
    assert calls == [True, True]
    calls.clear()  # the dense layer: one row (the GEMV loads its weights meanwhile), then two rows
    w_q = nvfp4.quantize_weight(torch.randn(8, 64, device=kernel_device))
    for rows in (1, 2):
        rac.nvfp4_linear_triton(torch.randn(rows, 64).bfloat16().to(kernel_device), w_q)
    assert calls == [True, False]


def test_compiled_kernels_round_the_residuals_product_on_its_own():
    # What the interpreter cannot show: compiled for the GPU, x - DQ(x_q) would become one FMA, skipping
    # the product's fp32 rounding the twin makes (seen on the H200 as residual codes unlike the twin's).
    # The quantizer must hold the never-fused mul.rn.f32 (not in its interpreter build, GPU=False: the
    # count is of the residual's products, not of something else).
    lines = _compiled_output(_COMPILE_FOR_SM90)
    counts = {(name, gpu): int(n) for name, gpu, n in (line.split() for line in lines)}
    assert set(counts) == {("quantizer", "True"), ("quantizer", "False")}
    assert counts["quantizer", "True"] > 0 and counts["quantizer", "False"] == 0, counts


# ============================================================================ dense layer path
def _dense_case(rows, cols, out_features, device, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 4
    w_q = nvfp4.quantize_weight(torch.randn(out_features, cols, device=device))
    return x, w_q


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("cols,out_features", [(16, 24), (48, 40), (96, 33), (256, 72)])
@pytest.mark.parametrize("compensate", [False, True])
def test_dense_kernel_matches_the_layer_twin(kernel_device, rows, cols, out_features, compensate):
    # M = 1 is the GEMV (all of K in one step, odd K masked), 3 and 17 the tensor-core tiles with and
    # without split-K
    x, w_q = _dense_case(rows, cols, out_features, kernel_device, rows + cols + out_features)
    mask = torch.arange(cols // 16, device=kernel_device) % 2 == 0 if compensate else None
    y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
    reference = rac.nvfp4_linear_reference(x, w_q, mask)
    max_diff, _ = report_diff(y, reference, f"dense M={rows} K={cols} N={out_features} rac={compensate}")
    # fp32 accumulation order only; with a residual also the fp16 rounding of x + r (2^-12 relative)
    assert max_diff <= (2e-3 if compensate else 1e-5) * reference.abs().max().item() + 1e-6
    y_bf16 = rac.nvfp4_linear_triton(x, w_q, mask)
    assert y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(y_bf16.float(), reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())


@pytest.mark.parametrize("amax_in_launch,prefill_rows", [(0, 10 ** 9), (0, 1)])
def test_partial_max_and_prefill_paths_match_the_decode_path(kernel_device, monkeypatch, amax_in_launch,
                                                              prefill_rows):
    # the same layer with the amax from the partial-max launch, and with the prefill weight pass
    x, w_q = _dense_case(5, 96, 40, kernel_device, 0)
    mask = torch.arange(6, device=kernel_device) < 4
    decode = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
    monkeypatch.setattr(rac, "AMAX_IN_LAUNCH", amax_in_launch)
    monkeypatch.setattr(rac, "PREFILL_ROWS", prefill_rows)
    y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
    assert report_diff(y, decode, "partial max / prefill vs decode")[0] <= 1e-5 * decode.abs().max().item()


@pytest.mark.parametrize("cols", [96, 80, 16])
def test_gemv_steps_over_k_beyond_its_block_and_matches_the_twin(kernel_device, monkeypatch, cols):
    # K = 96 / 80 in K steps of 32 (the last one of 80 masked), K = 16 in one short step; one row each
    monkeypatch.setattr(rac, "GEMV_BLOCK_K", 32)
    x, w_q = _dense_case(1, cols, 9, kernel_device, cols)
    mask = torch.arange(cols // 16, device=kernel_device) % 2 == 1
    y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
    reference = rac.nvfp4_linear_reference(x, w_q, mask)
    assert report_diff(y, reference)[0] <= 2e-3 * reference.abs().max().item()  # x + r in fp16


def test_prefill_weight_pass_matches_its_twin(kernel_device):
    torch.manual_seed(0)
    w_q = nvfp4.quantize_weight(torch.randn(40, 96, device=kernel_device))
    operand = rac._empty_planes(40, 48, kernel_device)
    rac._weight_operand_kernel[(1, 1)](w_q.data, w_q.block_scale.view(torch.uint8), operand, 40, 96, 48, 6,
                                       operand.stride(0), GPU=kernel_device == "cuda", ROWS=64, BLOCK_K=256)
    assert same_bits(operand, rac.weight_operand_reference(w_q))


def test_split_k_counters_are_reset_so_repeated_calls_agree(kernel_device):
    x, w_q = _dense_case(3, 256, 72, kernel_device, 3)  # the interpreter's decode bucket splits K in two
    first = rac.nvfp4_linear_triton(x, w_q, out_dtype=torch.float32)
    counters = rac._SPLIT_COUNTERS[w_q.device]
    assert (counters == 0).all()
    assert torch.equal(rac.nvfp4_linear_triton(x, w_q, out_dtype=torch.float32), first)


@pytest.mark.cuda
def test_gemv_on_qwen3_shapes_matches_the_twin_and_reads_the_weight_copied_just_before_it():
    # The GEMV loads its first weight tile before its PDL wait, while the quantizer runs: a weight copied
    # in right before the layer (as sync_weights does) must be the one it reads. Two weights take turns
    # in one buffer; every call must give that weight's own output, bit for bit, and that output its twin.
    torch.manual_seed(0)
    for N, K, splits in ((4096, 2048, None), (512, 2048, None), (2048, 4096, None),
                         (5120, 2048, (4096, 512, 512))):
        pairs = []
        for scale in (0.02, 3.0):
            w = torch.randn(N, K, device="cuda") * scale
            parts, w_q = _stacked(w.split(splits)) if splits else ([nvfp4.quantize_weight(w)], None)
            pairs.append((w_q if splits else parts[0], parts, scale))
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        fields = ("data", "block_scale", "global_scale")
        live = nvfp4.NVFP4Tensor(*(getattr(pairs[0][0], f).clone() for f in fields))
        expected = []
        for w_q, parts, scale in pairs:
            y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32, splits=splits)
            ys = y if splits else (y,)
            for part_y, part in zip(ys, parts):
                reference = rac.nvfp4_linear_reference(x, part, mask)
                assert relative_error(part_y, reference) < 2e-3, (N, K, scale)
            expected.append(torch.cat([t.reshape(-1) for t in ys]))
        for i in range(20):
            w_q = pairs[i % 2][0]
            for f in fields:
                getattr(live, f).copy_(getattr(w_q, f))
            y = rac.nvfp4_linear_triton(x, live, mask, out_dtype=torch.float32, splits=splits)
            got = torch.cat([t.reshape(-1) for t in (y if splits else (y,))])
            assert torch.equal(got, expected[i % 2]), (N, K, i)


def _stacked(weights):
    """Three weights quantized one by one (their own global scales), stacked along N as q/k/v are."""
    qs = [nvfp4.quantize_weight(w) for w in weights]
    return qs, rac.stack_weights(qs)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("compensate", [False, True])
def test_stacked_weights_give_each_weight_its_own_global_scale_and_output(kernel_device, rows, compensate):
    # 40 / 24 / 8 rows: tiles straddle the weights (the interpreter's BLOCK_N is 32); the three global
    # scales differ by 2^10; one row takes the GEMV, more the tiled GEMM
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, 96, generator=generator).to(kernel_device) * scale
               for n, scale in ((40, 1.0), (24, 2.0 ** 10), (8, 2.0 ** -10))]
    qs, stacked = _stacked(weights)
    x = torch.randn(rows, 96, generator=generator).to(kernel_device, torch.bfloat16)
    mask = torch.arange(6, device=kernel_device) % 2 == 0 if compensate else None
    outputs = rac.nvfp4_linear_triton(x, stacked, mask, out_dtype=torch.float32, splits=(40, 24, 8))
    assert [tuple(y.shape) for y in outputs] == [(rows, 40), (rows, 24), (rows, 8)]
    for y, q in zip(outputs, qs):  # each against its own layer's twin, and contiguous (q/k norms read rows)
        reference = rac.nvfp4_linear_reference(x, q, mask)
        assert y.is_contiguous()
        assert report_diff(y, reference)[0] <= (2e-3 if compensate else 1e-5) * reference.abs().max() + 1e-30


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 64, 300, 1500])
@pytest.mark.parametrize("out_features,cols", [(4096, 2048), (512, 2048), (2048, 4096), (200, 96)])
def test_dense_kernel_matches_the_twin_on_gpu_shapes(rows, out_features, cols):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w_q = nvfp4.quantize_weight(torch.randn(out_features, cols, device="cuda", dtype=torch.bfloat16) * 0.02)
    for mask in (None, torch.arange(cols // 16, device="cuda") % 2 == 0):
        y = rac.nvfp4_linear_triton(x, w_q, mask, out_dtype=torch.float32)
        reference = rac.nvfp4_linear_reference(x, w_q, mask)
        max_diff, _ = report_diff(y, reference,
                                  f"gpu dense M={rows} N={out_features} K={cols} rac={mask is not None}")
        assert max_diff <= (2e-3 if mask is not None else 1e-4) * reference.abs().max().item()


# ============================================================================ grouped GEMM (experts)
def _routing_with_empty_experts(n_experts, tokens, active, device, seed=0):
    """Random top-A routes that never pick experts 0, 2 and the last one (they receive no tokens)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in (0, 2, n_experts - 1)])
    scores = torch.rand(tokens, allowed.numel(), generator=generator)
    expert_ids = allowed[scores.topk(active, dim=-1).indices].to(device)
    return expert_ids, moe.route_tokens(expert_ids, n_experts)


def test_expert_weights_store_each_row_block_and_k_chunk_as_one_run():
    # the oracle walks every code and scale and computes where ExpertWeights' layout puts it by hand
    E, N, K = 2, 32, 384
    w_q = nvfp4.quantize_weight(torch.randn(E, N, K))
    w = rac.chunk_experts(w_q)
    assert w.shape == (E, N, K) and w.chunk == 128
    data, scale = w.data.flatten().tolist(), w.block_scale.view(torch.uint8).flatten().tolist()
    codes, scales = w_q.data.tolist(), w_q.block_scale.view(torch.uint8).tolist()

    def position(e, n, chunk, within, run):  # (expert, row block, chunk, row in block, within the run)
        return (((e * (N // 16) + n // 16) * (K // 128) + chunk) * 16 + n % 16) * run + within
    for e, n, j in itertools.product(range(E), range(N), range(K // 2)):   # byte j: elements 2j, 2j + 1
        assert data[position(e, n, j // 64, j % 64, 64)] == codes[e][n][j]
    for e, n, b in itertools.product(range(E), range(N), range(K // 16)):
        assert scale[position(e, n, b // 8, b % 8, 8)] == scales[e][n][b]
    back = rac.unchunk_experts(w)
    assert same_bits(back.data, w_q.data) and same_bits(back.block_scale, w_q.block_scale)
    # K not a multiple of 128: one chunk, the row-major codes in blocks of 16 rows, and unchunking is a view
    w = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(E, N, 96)))
    assert w.chunk == 96 and rac.unchunk_experts(w).data.data_ptr() == w.data.data_ptr()


def test_experts_take_the_gluon_kernel_on_sm89_and_hopper_only(monkeypatch):
    if rac.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(rac, "_INTERPRET", False)
    for capability, expected in (((8, 0), False), ((8, 9), True), ((9, 0), True), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        rac._CAPABILITIES.clear()
        assert rac._gluon_experts(torch.device("cuda", 0)) is expected, capability
    rac._CAPABILITIES.clear()  # not the stand-in's answer for the tests after this one
    assert rac._gluon_experts(torch.device("cpu")) is False
    monkeypatch.setattr(rac, "_INTERPRET", True)
    assert rac._gluon_experts(torch.device("cuda", 0)) is False


def test_gluon_autotuner_keeps_the_bucket_and_steps_k_within_one_chunk_of_the_layout():
    # a K step may not cross a chunk of ExpertWeights' layout: K = 192 is one chunk (not a multiple of 128),
    # which 128-element steps do not divide, so they become 64; at K = 2048 (chunks of 128) they stay
    if rac.gluon is None:
        pytest.skip("this Triton has no Gluon")
    configs = rac._grouped_gluon_kernel.configs
    for chunk, expected in ((128, {128, 64}), (192, {64})):
        for bucket, entries in rac.GLUON_CONFIGS.items():
            kept = rac._gluon_prune(configs, {"M_BUCKET": bucket}, CHUNK=chunk)
            shapes = [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept]
            assert shapes == [(t, n, w) for t, n, _, w in entries]
            assert all(c.kwargs["BUCKET"] == bucket for c in kept)
            for c, (_, _, k, _) in zip(kept, entries):
                step = c.kwargs["BLOCK_K"]
                assert step == (k if chunk % k == 0 else 64) and step in expected


def test_triton_grouped_autotuner_steps_k_within_one_chunk_of_the_layout(monkeypatch):
    # the Triton grouped kernel reads ExpertWeights directly: where K spans several 128-element chunks, its
    # GPU configurations' 256-element steps become 128 (a step may not cross a chunk); K of one chunk
    # (here 192) keeps every step; each bucket keeps its own configurations
    monkeypatch.setattr(rac, "_INTERPRET", False)
    configs = rac._configs(rac.GROUPED_CONFIGS)
    assert any(c.kwargs["BLOCK_K"] == 256 for c in configs)
    for bucket, entries in rac.GROUPED_CONFIGS.items():
        for K, chunk in ((2048, 128), (192, 192)):
            kept = rac._grouped_prune(configs, {"M_BUCKET": bucket, "K": K}, CHUNK=chunk)
            assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept] == \
                [(m, n, w, st) for m, n, _, w, st, *_ in entries]
            for c, (_, _, k, *_) in zip(kept, entries):
                assert c.kwargs["BLOCK_K"] == (min(k, chunk) if chunk < K else k), (bucket, K, c)
                assert chunk == K or chunk % c.kwargs["BLOCK_K"] == 0


_COMPILE_GLUON_FOR_SM90 = _COMPILE_PREAMBLE + r"""
from triton.experimental.gluon._runtime import GluonASTSource
kernel = jit(rac._grouped_gluon_kernel)
types = ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*bf16"] + [i] * 13
memory = re.compile(r"\b(?:ld|st|atom|red)\.global\b")
for swiglu, tile, n, k in ((1, 8, 64, 128), (1, 32, 64, 64), (0, 8, 128, 128), (0, 64, 64, 64)):
    for pdl in (False, True):
        swiglu = bool(swiglu)
        c = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, E_POW2=128,
                 CHUNK=128, PDL=pdl, BUCKET=8, BLOCK_T=tile, BLOCK_N=n, BLOCK_K=k, NUM_WARPS=4)
        signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
        signature.update({a: "constexpr" for a in c})
        aligned = [a for a in kernel.arg_names if a not in c  # 16-divisible, as the launches see them
                   and (signature[a].startswith("*") or a.startswith(("stride", "N", "K", "x_plane")))]
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        ptx = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32),
                      options=dict(num_warps=4)).asm["ptx"]
        wait, first = ptx.find("griddepcontrol.wait"), memory.search(ptx)
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16", ptx))
        loads8 = len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.b32", ptx))
        loads1 = len(re.findall(r"ld\.global(?:\.\w+)*\.[us]8", ptx))
        print(int(swiglu), tile, n, k, int(pdl), mma, loads8, loads1, int("cp.async" in ptx), int(wait >= 0),
              int(wait >= 0 and wait < first.start()))
"""


def test_experts_gluon_kernel_loads_8_byte_code_runs_into_mma_sync_on_hopper():
    # compiled for sm_90 on the CPU (numerics: the GPU tests). Per K step a thread loads each of its weight
    # rows' 8 codes bytes (one NVFP4 block) as one 8-byte load and its block scale as one byte, with no shared
    # memory staging; with PDL its first memory access waits for the kernel ahead of it. A tile of 16 rows or
    # more also holds the loop of a tile of half its rows (for tiles at most half full), one of 32 or more
    # that of half plus a quarter (at most three quarters full): its MMAs a K step are 1.5 and 2.25 times a
    # full tile's, which are (weight rows / 16 a warp) x (tile rows / 8) x (BLOCK_K / 16).
    if rac.gluon is None:
        pytest.skip("this Triton has no Gluon")
    for line in _compiled_output(_COMPILE_GLUON_FOR_SM90):
        swiglu, tile, n, k, pdl, mma, loads8, loads1, staged, wait, before = map(int, line.split())
        full = (n * (2 if swiglu else 1) // 16 // 4) * (tile // 8) * (k // 16)
        assert mma == full * {8: 4, 16: 6, 32: 9, 64: 9}[tile] // 4 and not staged, line
        assert loads8 > 0 and loads8 >= loads1, line  # codes in 8-byte runs, scales a byte each
        assert (wait, before) == ((1, 1) if pdl else (0, 0)), line


@pytest.mark.parametrize("tokens, D", [(3, 80), (21, 80), (5, 256)])
def test_grouped_kernel_matches_the_per_expert_twin(kernel_device, tokens, D):
    # 21 tokens x 2 on 4 used experts: some experts get more rows than one 16-row tile. D = 80: the down
    # GEMM's output is 3 of the interpreter's 32-column tiles (the last one short); its K is one chunk of
    # ExpertWeights' layout, D = 256 two
    torch.manual_seed(tokens)
    E, I, A = 7, 32, 2
    expert_ids, routing = _routing_with_empty_experts(E, tokens, A, kernel_device, seed=tokens)
    assert (routing.counts[[0, 2, E - 1]] == 0).all()
    x = torch.randn(tokens, D, device=kernel_device, dtype=torch.bfloat16)
    act = rac.quantize_activation_triton(x, torch.arange(D // 16, device=kernel_device) % 2 == 0,
                                         codes=True)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device=kernel_device))
    hidden = rac.grouped_matmul_triton(act, rac.chunk_experts(gate_up_q), routing.counts,
                                       row_ids=routing.token_ids, swiglu=True, out_dtype=torch.float32)
    reference = rac.grouped_matmul_reference(act.x_q, gate_up_q, routing.counts, act.residual,
                                             row_ids=routing.token_ids, swiglu=True,
                                             out_dtype=torch.float32)
    assert hidden.shape == (tokens * A, I)
    assert report_diff(hidden, reference,
                       "grouped gate/up + swiglu")[0] <= 2e-3 * reference.abs().max().item()

    act = rac.quantize_activation_triton(reference, codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device=kernel_device))
    down_w = rac.chunk_experts(down_q)
    row_weights = torch.rand(tokens * A, device=kernel_device)
    y = rac.grouped_matmul_triton(act, down_w, routing.counts, row_weights=row_weights,
                                  out_dtype=torch.float32)
    reference = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=row_weights,
                                             out_dtype=torch.float32)
    assert report_diff(y, reference, "grouped down * router weight")[0] <= 1e-5 * reference.abs().max().item()
    # the router weights as the layer passes them: (T * A,) in assignment order, read through routing.order;
    # the oracle is the sorted path just checked, on the weights gathered by hand
    expert_weights = torch.rand(tokens, A, device=kernel_device, dtype=torch.bfloat16).reshape(-1)
    by_order = rac.grouped_matmul_triton(act, down_w, routing.counts, row_weights=expert_weights,
                                         row_weight_ids=routing.order, out_dtype=torch.float32)
    gathered = expert_weights[routing.order].float()
    assert torch.equal(by_order, rac.grouped_matmul_triton(act, down_w, routing.counts, row_weights=gathered,
                                                           out_dtype=torch.float32))
    twin_by_order = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=expert_weights,
                                                 row_weight_ids=routing.order, out_dtype=torch.float32)
    twin_sorted = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=gathered,
                                               out_dtype=torch.float32)
    assert torch.equal(twin_by_order, twin_sorted)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_grouped_kernel_matches_the_twin_on_qwen3_expert_shapes(tokens):
    torch.manual_seed(0)
    E, D, I, A = 128, 2048, 768, 8
    routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
    act = rac.quantize_activation_triton(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
                                         torch.arange(D // 16, device="cuda") % 4 == 0, codes=True)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02)
    hidden = rac.grouped_matmul_triton(act, rac.chunk_experts(gate_up_q), routing.counts,
                                       row_ids=routing.token_ids, swiglu=True, out_dtype=torch.float32)
    reference = rac.grouped_matmul_reference(act.x_q, gate_up_q, routing.counts, act.residual,
                                             row_ids=routing.token_ids, swiglu=True,
                                             out_dtype=torch.float32)
    assert report_diff(hidden, reference,
                       f"gpu grouped gate/up T={tokens}")[0] <= 2e-3 * reference.abs().max().item()
    if rac.KERNEL_CAPABILITY <= torch.cuda.get_device_capability() < (10, 0):  # the Gluon kernel there
        assert rac._gluon_experts(torch.device("cuda"))
    act = rac.quantize_activation_triton(reference.bfloat16(), codes=True)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
    row_weights = torch.rand(tokens * A, device="cuda")
    y = rac.grouped_matmul_triton(act, rac.chunk_experts(down_q), routing.counts, row_weights=row_weights,
                                  out_dtype=torch.float32)
    reference = rac.grouped_matmul_reference(act.x_q, down_q, routing.counts, row_weights=row_weights,
                                             out_dtype=torch.float32)
    assert report_diff(y, reference, f"gpu grouped down T={tokens}")[0] <= 1e-4 * reference.abs().max().item()


@pytest.mark.cuda
def test_gluon_experts_kernel_matches_the_twin_on_short_tiles_in_every_config():
    # the Qwen3 shapes fill every N tile, and the every-config test's too: here each configuration of the
    # Gluon kernel meets short row tiles (14 to 24 rows an expert, three empty experts) and a short last N
    # tile (gate/up 80 columns, down 208), whose masked rows must neither be stored nor spoil the stored ones
    if not rac._gluon_experts(torch.device("cuda")):
        pytest.skip("the Gluon experts kernel runs on sm_89 and sm_90 only")
    torch.manual_seed(0)
    E, D, I, N_DOWN, tokens, A = 8, 256, 80, 208, 48, 2
    _, routing = _routing_with_empty_experts(E, tokens, A, "cuda")
    x = rac.quantize_activation_triton(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
                                       torch.arange(D // 16, device="cuda") % 2 == 0, codes=True)
    h = rac.quantize_activation_triton(torch.randn(tokens * A, 128, device="cuda", dtype=torch.bfloat16),
                                       codes=True)
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda"))
    down_q = nvfp4.quantize_weight(torch.randn(E, N_DOWN, 128, device="cuda"))
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    row_weights = torch.rand(tokens * A, device="cuda")
    references = (
        rac.grouped_matmul_reference(x.x_q, gate_up_q, routing.counts, x.residual, row_ids=routing.token_ids,
                                     swiglu=True, out_dtype=torch.float32),
        rac.grouped_matmul_reference(h.x_q, down_q, routing.counts, row_weights=row_weights,
                                     out_dtype=torch.float32))
    bucket = rac._m_bucket(-(-tokens * A // E), rac.GLUON_CONFIGS)
    failures = []
    for config in _forced_configs(rac._grouped_gluon_kernel, bucket, relabel=lambda config: True):
        outputs = (
            rac.grouped_matmul_triton(x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True,
                                      out_dtype=torch.float32),
            rac.grouped_matmul_triton(h, down_w, routing.counts, row_weights=row_weights,
                                      out_dtype=torch.float32))
        for name, y, reference in zip(("gate/up", "down"), outputs, references):
            error = ((y - reference).abs().max() / reference.abs().max()).item()
            if not error <= 2e-3:  # NaN fails too
                failures.append(f"{name} {config}: relative error {error:.2e}")
    assert not failures, "\n".join(failures)


def test_configuration_tables_reach_triton_with_their_operand_order_and_register_cap(monkeypatch):
    # the tables' optional 7th and 8th fields (X_FIRST, maxnreg) must reach the autotuner's configurations: a
    # dropped cap compiles another kernel than the one measured
    monkeypatch.setattr(rac, "_INTERPRET", False)
    for table in (rac.DENSE_CONFIGS, rac.GROUPED_CONFIGS):
        entries = [(bucket, entry) for bucket, rows in table.items() for entry in rows]
        configs = rac._configs(table)
        assert len(configs) == len(entries)
        for config, (bucket, entry) in zip(configs, entries):
            kw = config.kwargs
            assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps, config.num_stages,
                    kw["SPLIT_K"], kw["BUCKET"]) == (*entry[:6], bucket)
            assert kw["X_FIRST"] == (len(entry) > 6 and entry[6])
            assert config.maxnreg == (entry[7] if len(entry) > 7 else None)
    assert any(len(entry) > 7 and entry[7] for entry in rac.GROUPED_CONFIGS[16])


def _forced_configs(kernel, bucket, relabel=lambda config: True):
    """Each of the kernel's autotuning configurations in turn: the bucket's own, and those of other
    buckets that `relabel` accepts, relabelled for `bucket` so the pruner keeps them."""
    import triton
    configs = list(kernel.configs)
    try:
        for config in configs:
            if config.kwargs["BUCKET"] != bucket and not relabel(config):
                continue
            kernel.configs = [triton.Config({**config.kwargs, "BUCKET": bucket}, num_warps=config.num_warps,
                                            num_stages=config.num_stages, maxnreg=config.maxnreg)]
            kernel.cache.clear()
            yield config
    finally:
        kernel.configs = configs
        kernel.cache.clear()


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_twin(monkeypatch):
    # Autotuning may pick any configuration, so each one is forced and repeated (a miscompiled one showed
    # as run-to-run differences): the experts on the Gluon kernel at each of its buckets (the last a prefill
    # of 512 evaluation prompts, 26k tokens, the small preset's shapes) and on the Triton one at that prefill,
    # the dense kernel at each decode bucket (split-K; RAC) and at prefill size.
    import triton
    torch.manual_seed(0)
    E, D, I, A, T, repeats = 32, 512, 256, 4, 26112, 10
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda") * 0.05)
    gate_up_w, down_w = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
    w_q = nvfp4.quantize_weight(torch.randn(512, D, device="cuda") * 0.05)
    calls = {}  # name -> (kernel, bucket, relabel, the Triton kernel for the experts?, call, reference)
    for tokens in (32, 64, 128, 512, T):  # 4, 8, 16, 64 rows an expert (the Gluon kernel's buckets), prefill
        routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
        x = rac.quantize_activation_triton(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16),
                                           codes=True)
        h = rac.quantize_activation_triton(torch.randn(tokens * A, I, device="cuda", dtype=torch.bfloat16),
                                           codes=True)
        row_weights = torch.rand(tokens * A, device="cuda")
        experts = {
            "gate/up": (lambda x=x, routing=routing: rac.grouped_matmul_triton(
                x, gate_up_w, routing.counts, row_ids=routing.token_ids, swiglu=True,
                out_dtype=torch.float32),
                rac.grouped_matmul_reference(x.x_q, gate_up_q, routing.counts, row_ids=routing.token_ids,
                                             swiglu=True, out_dtype=torch.float32)),
            "down": (lambda h=h, routing=routing, row_weights=row_weights: rac.grouped_matmul_triton(
                h, down_w, routing.counts, row_weights=row_weights, out_dtype=torch.float32),
                rac.grouped_matmul_reference(h.x_q, down_q, routing.counts, row_weights=row_weights,
                                             out_dtype=torch.float32)),
        }
        rows = triton.cdiv(tokens * A, E)
        for name, (call, reference) in experts.items():
            calls[f"{name} gluon T={tokens}"] = (rac._grouped_gluon_kernel,
                                                 rac._m_bucket(rows, rac.GLUON_CONFIGS), False, False,
                                                 call, reference)
            if tokens == T:
                calls[f"{name} triton T={tokens}"] = (rac._grouped_kernel,
                                                      rac._m_bucket(rows, rac.GROUPED_CONFIGS), False, True,
                                                      call, reference)
    x = rac.quantize_activation_triton(torch.randn(T, D, device="cuda", dtype=torch.bfloat16), codes=True)
    calls["dense prefill"] = (rac._dense_kernel, 4096, True, False,
                              lambda: rac._dense_portable(w_q, torch.float32, act=x),
                              rac.matmul_reference(x.x_q, w_q, out_dtype=torch.float32))
    mask = torch.arange(D // 16, device="cuda") % 2 == 0
    for rows in (2, 16, 64, 256):  # each decode bucket
        x_small = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
        act = rac.quantize_activation_triton(x_small, mask)
        calls[f"dense decode M={rows}"] = (
            rac._dense_kernel, rac._m_bucket(rows, rac.DENSE_CONFIGS), False, False,
            lambda act=act: rac._dense_portable(w_q, torch.float32, act),
            rac.nvfp4_linear_reference(x_small, w_q, mask))
    failures = []
    for name, (kernel, bucket, relabel, triton_experts, call, reference) in calls.items():
        # split-K scratch is sized for the call's own bucket: only configurations without it move to prefill
        def movable(config):
            return relabel and config.kwargs.get("SPLIT_K", 1) == 1
        with monkeypatch.context() as patch:
            if triton_experts:
                patch.setattr(rac, "_gluon_experts", lambda device: False)
            for config in _forced_configs(kernel, bucket, relabel=movable):
                first = call()
                differing = sum(not torch.equal(call(), first) for _ in range(repeats))
                error = ((first - reference).abs().max() / reference.abs().max()).item()
                if differing or not error <= 2e-3:  # NaN fails too
                    failures.append(f"{name} {config}: {differing}/{repeats} repeats differ, "
                                    f"relative error {error:.2e}")
    assert not failures, "\n".join(failures)


# ============================================================================ the native (Blackwell) path
def test_native_path_is_dropped_loudly_when_it_disagrees_or_fails(kernel_device, monkeypatch):
    # stand-ins for the native launches (no Blackwell GPU here): wrong values, a failure, the twins
    def dense_wrong(x_q, residual, w_q, out_dtype, splits=None):
        return torch.zeros(x_q.shape[0], w_q.shape[0], device=x_q.device, dtype=out_dtype)

    def grouped_wrong(act, w_q, counts, row_ids, row_weights, row_weight_ids, y, flags):
        return y.zero_()

    def broken(*args):
        raise RuntimeError("no FP4 tensor cores here")

    def dense_twin(x_q, residual, w_q, out_dtype, splits=None):
        return rac.matmul_reference(x_q, w_q, residual, out_dtype)

    def grouped_twin(act, w_q, counts, row_ids, row_weights, row_weight_ids, y, flags):
        return rac.grouped_matmul_reference(act.x_q, w_q, counts, act.residual, out_dtype=y.dtype)

    device = torch.device(kernel_device)
    for dense, grouped, message in ((dense_wrong, grouped_twin, "dense GEMM disagrees with the portable"),
                                    (dense_twin, grouped_wrong, "grouped GEMM disagrees"),
                                    (broken, grouped_twin, "dense GEMM failed"),
                                    (dense_twin, broken, "grouped GEMM failed")):
        monkeypatch.setattr(rac, "_dense_native", dense)
        monkeypatch.setattr(rac, "_grouped_native", grouped)
        with pytest.warns(UserWarning, match=message):
            assert not rac._native_agrees(device)
    monkeypatch.setattr(rac, "_dense_native", dense_twin)
    monkeypatch.setattr(rac, "_grouped_native", grouped_twin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rac._native_agrees(device)


@pytest.mark.cuda
@torch.no_grad()
def test_pdl_launches_in_a_cuda_graph_give_the_plain_launches_results(monkeypatch):
    # Each replay takes a new input: a kernel that read before the one ahead of it had written would show
    # up as a replay unlike the plain launches' result (a CUDA graph replays the decode step like this).
    E, D, I, A, T = 128, 2048, 768, 8, 256
    torch.manual_seed(0)
    experts = rac.NVFP4Experts(E, D, I, rac_ratio=0.5, device="cuda")
    experts.load_weights(torch.randn(E, 2 * I, D, device="cuda") * 0.05,
                         torch.randn(E, D, I, device="cuda") * 0.05)
    linear = rac.NVFP4Linear(D, 4096, rac_ratio=0.5, device="cuda")
    linear.load_weight(torch.randn(4096, D, device="cuda") * 0.05)
    inputs = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    routes = [torch.rand(T, E, device="cuda").topk(A, dim=-1) for _ in inputs]
    static_x, static_ids, static_w = inputs[0].clone(), routes[0].indices.clone(), routes[0].values.clone()

    def step():
        return experts(static_x, static_ids, static_w), linear(static_x[:64]), linear(static_x[:1])

    def run(pdl):
        monkeypatch.setattr(rac, "_pdl", lambda device: pdl and device.type == "cuda")
        step()  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        results = []
        for x, route in zip(inputs * 3, routes * 3):
            static_x.copy_(x), static_ids.copy_(route.indices), static_w.copy_(route.values)
            graph.replay()
            results.append([y.clone() for y in outputs])
        return results

    plain, pdl = run(False), run(True)
    assert not all(torch.equal(a, b) for a, b in zip(plain[0], plain[1]))  # the inputs do change
    for replay_plain, replay_pdl in zip(plain, pdl):
        assert all(torch.equal(a, b) for a, b in zip(replay_plain, replay_pdl))


def test_backend_is_native_only_on_blackwell_and_only_if_its_check_passes(monkeypatch):
    checks = []
    monkeypatch.setattr(rac, "_native_agrees", lambda device: checks.append(device) or verdict)
    for capability, verdict, expected in (((9, 0), True, "portable"), ((10, 0), False, "portable"),
                                          ((10, 0), True, "native")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr(rac, "_CAPABILITIES", {})
        rac._BACKENDS.clear()
        assert rac.gemm_backend(torch.device("cuda", 0)) == expected
        assert rac.gemm_backend(torch.device("cuda", 0)) == expected  # decided once per device
    assert len(checks) == 2  # Hopper never runs the check
    rac._BACKENDS.clear()
    assert rac.gemm_backend(torch.device("cpu")) == "portable"


_COMPILE_FOR_SM100 = r"""
import re, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
p8, pf, p32, i = "*u8", "*fp32", "*i32", "i32"
common = dict(OUT_BF16=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)
kernels = {
    "dense": (rac._dense_native_kernel,
              [p8, "*fp8e4nv", p8, "*fp8e4nv", pf, p8, "*fp8e4nv", pf, "*i16"] + [i] * 9,
              dict(HAS_RESIDUAL=True, **common)),
    "grouped": (rac._grouped_native_kernel,
                [p8, "*fp8e4nv", p8, "*fp8e4nv", pf, "*i64", pf, "*i64", p8, "*fp8e4nv", pf, "*i64", "*i16"]
                + [i] * 14,
                dict(GATHER=True, ROW_WEIGHTS=False, WEIGHT_IDS=False, SWIGLU=True, HAS_RESIDUAL=True,
                     E_POW2=128, **common)),
    "grouped_down": (rac._grouped_native_kernel,
                     [p8, "*fp8e4nv", p8, "*fp8e4nv", pf, "*i64", pf, "*i64", p8, "*fp8e4nv", pf, "*i64",
                      "*i16"] + [i] * 14,
                     dict(GATHER=False, ROW_WEIGHTS=True, WEIGHT_IDS=True, SWIGLU=False, HAS_RESIDUAL=True,
                          E_POW2=128, **common)),
}
for name, (kernel, types, constants) in kernels.items():
    names = kernel.arg_names
    signature = dict(zip(names, types + ["constexpr"] * len(constants)))
    ptx = compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 100, 32)).asm["ptx"]
    # NVFP4's block-16 scaled MMA: spelled .block16 by Triton 3.9, .scale_vec::4X (its older alias) by 3.6
    print(name, len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale"
                               r"\.(?:block16|scale_vec::4X)\b", ptx)))
"""


def test_native_kernels_compile_to_blackwell_fp4_tensor_core_instructions():
    # This checks the instruction, not the numerics: those stay untested without a Blackwell GPU.
    counts = dict(line.split() for line in _compiled_output(_COMPILE_FOR_SM100))
    assert set(counts) == {"dense", "grouped", "grouped_down"}, counts
    assert all(int(n) > 0 for n in counts.values()), counts


# ============================================================================ RAC
def test_rac_reduces_output_error_monotonically_on_outlier_channels():
    """Inputs with heavy tails and fixed outlier channels; blocks calibrated on one batch, measured on
    another. Asserted margin: ratio 0.5 at most half of naive NVFP4's error (seen: about 0.25-0.3)."""
    torch.manual_seed(0)
    batch = _outlier_activations(64, 256, seed=0, dtype=torch.float32)
    calibration, x = batch(), batch()
    w_q = nvfp4.quantize_weight(torch.randn(96, 256))
    exact = x @ w_q.dequantize(torch.float32).T  # the same weights: only the activation error is measured
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
    selector = rac.RACSelector(8, 0.25)                               # round(0.25 * 8) = 2 blocks
    x = torch.randn(32, 128)
    x[:, 16 * 5 + 3] *= 40.0                                          # blocks 5 and 2 hold large values
    x[:, 16 * 2:16 * 3] *= 10.0
    mask = selector(x)  # never calibrated: the first input decides
    assert mask.tolist() == [i in (2, 5) for i in range(8)]
    x2 = torch.randn(32, 128)
    x2[:, 16 * 7:] *= 30.0
    assert selector(x2).tolist() == mask.tolist()                     # frozen after its first input

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
    monkeypatch.setattr(rac, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


@torch.no_grad()
def test_q_k_v_quantize_their_one_input_once_and_equal_unshared_layers(monkeypatch):
    attention, layers = _shared_attention("cpu")
    assert layers[1].rac is layers[0].rac and layers[2].rac is layers[0].rac   # one selector for one input
    calls = _count_calls(monkeypatch, "quantize_activation_reference")
    x = torch.randn(3, 5, layers[0].in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    mask = layers[0].rac(x.reshape(-1, x.shape[-1]))  # calibrates the shared selector on x
    calls.clear()

    def check(order, x, quantizations):
        calls.clear()
        outputs = [layer(x) for layer in order]
        assert len(calls) == quantizations
        for layer, y in zip(order, outputs):  # the layer's own computation, nothing shared
            expected = rac.nvfp4_linear_reference(x.reshape(-1, x.shape[-1]), layer.weight_q, mask)
            assert same_bits(y, expected.to(x.dtype).view(*x.shape[:-1], -1))

    check(layers, x, 1)                                   # q quantizes, k and v reuse
    assert layers[0].shared_input.input is None           # all three have read it: nothing kept alive
    check((layers[2], layers[0], layers[1]), x, 1)        # in any order
    layers[0](x)
    x.mul_(2.0)                                           # modified in place between two readers
    check(layers[1:], x, 1)
    check(layers, x.clone(), 1)                           # equal values in another tensor: quantized anew
    check((layers[0], layers[0]), x, 2)                   # one layer twice: it reads x anew


def _check_one_stacked_gemm(monkeypatch, layers, x, gemms_expected):
    mask = layers[0].rac(x)
    gemms = _count_calls(monkeypatch, "layer_matmul")
    quantizations = _count_calls(monkeypatch, "layer_input")
    outputs = [layer(x) for layer in layers]
    assert (len(gemms), len(quantizations)) == (gemms_expected, 1)
    for layer, y in zip(layers, outputs):  # each layer's own twin
        reference = rac.nvfp4_linear_reference(x.float(), layer.weight_q, mask)
        assert y.is_contiguous() and relative_error(y, reference) < 1e-2


@torch.no_grad()
def test_q_k_v_run_as_one_stacked_gemm_that_follows_weight_reloads(monkeypatch, kernel_device):
    attention, layers = _shared_attention(kernel_device)
    monkeypatch.setattr(rac, "use_triton", lambda x: True)  # the CUDA path, here under the interpreter
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, layers[0].in_features, generator=generator).to(kernel_device, torch.bfloat16)
    _check_one_stacked_gemm(monkeypatch, layers, x, 1)
    # the layers' buffers are views of the stacked weight: a reload (sync_weights) lands in it
    layers[1].load_weight(torch.randn(layers[1].out_features, layers[1].in_features, generator=generator)
                          .to(kernel_device) * 100)
    _check_one_stacked_gemm(monkeypatch, layers, x.clone(), 1)
    # a buffer replaced (the layer moved, say): the layers run one by one, still correct
    layers[2].weight_data = layers[2].weight_data.clone()
    with pytest.warns(UserWarning, match="no longer views of their stacked weight"):
        _check_one_stacked_gemm(monkeypatch, layers, x.clone(), 3)


@pytest.mark.cuda
@torch.no_grad()
def test_q_k_v_share_the_triton_quantization_and_gemm_on_gpu(monkeypatch):
    attention, layers = _shared_attention("cuda")
    for rows in (1, 96):  # the GEMV, and the tiled GEMM
        _check_one_stacked_gemm(monkeypatch, layers, torch.randn(rows, layers[0].in_features, device="cuda",
                                                                 dtype=torch.bfloat16), 1)


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
            assert isinstance(block.experts, rac.NVFP4Experts if mode == "nvfp4" else fp8.FP8Experts)
            assert type(block.gate) is nn.Linear and type(rollout.lm_head) is nn.Linear  # stay full precision
        errors[(mode, ratio)] = relative_error(rollout(tokens), reference)
    print("relative logit error vs the unconverted model:", errors)
    assert errors[("bf16", 0.0)] == 0.0
    # NVFP4 on a 64-wide model: per-tensor activation scales are coarse, and 2 layers compound them
    assert 0 < 2 * errors[("fp8", 0.0)] < errors[("nvfp4", 0.0)] < 0.3
    assert errors[("nvfp4", 0.5)] < errors[("nvfp4", 0.0)]

    rollout = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4", quantize_router=True,
                                      quantize_lm_head=True)
    assert isinstance(rollout.layers[0].mlp.gate, rac.NVFP4Linear)
    assert isinstance(rollout.lm_head, rac.NVFP4Linear)


def _assert_rollout_weights_are_the_qat_weights(rollout, trainer):
    masters = dict(trainer.named_parameters())
    checked = 0
    for path, module in rollout.named_modules():
        if isinstance(module, rac.NVFP4Linear):
            pairs = [(module.weight_q, masters[f"{path}.weight"])]
        elif isinstance(module, rac.NVFP4Experts):
            pairs = [(rac.unchunk_experts(module.gate_up_w), masters[f"{path}.gate_up_proj"]),
                     (rac.unchunk_experts(module.down_w), masters[f"{path}.down_proj"])]
        else:
            continue
        for quantized, master in pairs:
            with torch.no_grad():
                assert same_bits(quantized.dequantize(master.dtype), nvfp4.fake_quantize_weight(master)), path
            checked += 1
    assert checked == 2 * (4 + 2)
    for name, param in rollout.named_parameters():  # norms, embeddings, routers, LM head: copied
        assert torch.equal(param, masters[name]), name


@torch.no_grad()
def test_the_twin_path_dequantizes_a_weight_again_whenever_it_changes():
    torch.manual_seed(0)
    layer = rac.NVFP4Linear.from_float(nn.Linear(64, 24, bias=False))
    x = torch.randn(5, 64)

    def twin():  # dequantizes the weight itself, every call
        return rac.nvfp4_linear_reference(x, layer.weight_q)

    first = layer(x)
    assert same_bits(first, twin()) and same_bits(layer(x), first)
    layer.load_weight(torch.randn(24, 64))                    # what sync_weights does
    assert same_bits(layer(x), twin()) and not torch.equal(layer(x), first)
    layer.weight_global_scale.mul_(2.0)                        # any in-place write to a buffer
    assert same_bits(layer(x), twin())
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


def test_sync_weights_reloads_exactly_the_qat_weights():
    trainer = tiny_model(vocab_size=48)
    rollout = rac.convert_for_rollout(copy.deepcopy(trainer), "nvfp4", rac_ratio=0.5)
    with torch.no_grad():
        for p in trainer.parameters():  # a training step happened: the rollout copy is stale
            p.add_(torch.randn_like(p) * 0.05)
    assert not same_bits(rollout.layers[0].attn.q_proj.weight_q.dequantize(torch.float32),
                          nvfp4.fake_quantize_weight(trainer.layers[0].attn.q_proj.weight).detach())
    rac.sync_weights(rollout, trainer)
    _assert_rollout_weights_are_the_qat_weights(rollout, trainer)

    qat.convert_for_training(trainer, "qat")  # same parameter names: sync works unchanged
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
    torch.testing.assert_close(fast.float(), twin.float(), rtol=2e-2, atol=2e-2 * twin.abs().max().item())
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
    act = rac.Activation(None, None, torch.zeros(2, rows, K // 2, dtype=torch.float16), torch.ones(()))
    return act, rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 16, K))), torch.tensor([rows, 0])


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    *[(f"{label} ({name})", lambda q=quantize, args=args: q(*args), names, problem)
      for name, quantize in (("twin", rac.quantize_activation_reference),
                             ("Triton", rac.quantize_activation_triton))[:2 if HAS_TRITON else 1]
      for label, args, names, problem in (
          ("activation K", (torch.randn(2, 40),), "K=40", "not a multiple of the NVFP4 block size 16"),
          ("activation dtype", (torch.randint(0, 4, (2, 32)),), "activations", "got dtype torch.int64"),
          ("rac_mask shape", (torch.randn(2, 32), torch.ones(3, dtype=torch.bool)), "rac_mask",
           "(G,) = (2,), got torch.bool (3,)"))],
    ("K mismatch", lambda: rac.matmul_reference(nvfp4.quantize(torch.randn(2, 32)),
                                                nvfp4.quantize(torch.randn(4, 48))),
    "K differs", "x_q (2, 32) vs w_q (4, 48)"),
    ("residual scale", lambda: rac.matmul_reference(nvfp4.quantize(torch.randn(2, 32)),
                                                    nvfp4.quantize(torch.randn(4, 32)),
                                                    nvfp4.quantize(torch.randn(2, 32))),
    "residual", "must share x_q's global scale"),
    ("x_q type", lambda: rac.matmul_reference(torch.randn(2, 32), nvfp4.quantize(torch.randn(4, 32))),
     "x_q", "must be an NVFP4Tensor, got Tensor"),
    ("router weight ids", lambda: rac.grouped_matmul_triton(*_grouped_call(), row_weights=torch.ones(6),
                                                            row_weight_ids=torch.arange(3)),
     "row_weight_ids", "one id per row (4,), got (3,) and row_weights (6,)"),
    ("router weights", lambda: rac.grouped_matmul_triton(*_grouped_call(), row_weights=torch.ones(5)),
     "row_weights", "one weight per row (4,), got (5,)"),
    ("experts layout", lambda: rac.grouped_matmul_triton(_grouped_call()[0], rac.unchunk_experts(
        _grouped_call()[1]), _grouped_call()[2]), "w must be ExpertWeights", "got NVFP4Tensor"),
    ("experts rows", lambda: rac.chunk_experts(nvfp4.quantize_weight(torch.randn(2, 8, 32))), "N=8 rows",
     "not a multiple of 16"),
    ("router weight ids (twin)", lambda: rac.grouped_matmul_reference(
        nvfp4.quantize(torch.randn(4, 32)), *_grouped_call()[1:], row_weights=torch.ones(6),
        row_weight_ids=torch.arange(3)), "grouped_matmul_reference: row_weight_ids", "one id per row (4,)"),
    ("kernel K", lambda: rac.nvfp4_linear_triton(torch.randn(2, 40), nvfp4.quantize(torch.randn(4, 48))),
     "K=40", "not a multiple of"),
    ("x vs weight", lambda: rac.nvfp4_linear_triton(torch.randn(2, 32), nvfp4.quantize(torch.randn(4, 48))),
     "x (2, 32)", "does not match the weight (4, 48)"),
    ("out_dtype", lambda: rac.nvfp4_linear_triton(torch.randn(2, 32).half(),
                                                  nvfp4.quantize(torch.randn(4, 32)), out_dtype=torch.int8),
    "out_dtype", "got torch.int8"),
    ("rac_mask dtype", lambda: rac.nvfp4_linear_triton(torch.randn(2, 32),
                                                       nvfp4.quantize(torch.randn(4, 32)), torch.ones(2)),
    "rac_mask", "must be a bool tensor of shape (G,) = (2,), got torch.float32 (2,)"),
    ("splits sum", lambda: rac.nvfp4_linear_triton(torch.randn(2, 32), _stacked([torch.randn(4, 32)] * 3)[1],
                                                   splits=(4, 4, 5)),
    "splits (4, 4, 5)", "adding up to the weight's N = 12"),
    ("splits scales", lambda: rac.nvfp4_linear_triton(torch.randn(2, 32),
                                                      _stacked([torch.randn(4, 32)] * 3)[1]),
    "3 global scales", "expected 1 (one per stacked weight)"),
    ("layer features", lambda: rac.NVFP4Linear(40, 8), "40 features",
     "not a multiple of the NVFP4 block size"),
    ("input device", lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 32, device="meta")), "input on meta",
     "but weights on cpu"),
    ("input dtype", lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 32).to(torch.float8_e4m3fn)), "NVFP4Linear",
     "bfloat16/float16/float32 tensor, got torch.float8_e4m3fn"),
    ("input width", lambda: rac.NVFP4Linear(32, 8)(torch.randn(2, 48)), "last dim 32", "got shape (2, 48)"),
    ("selector ratio", lambda: rac.RACSelector(4, 1.5), "rac_ratio", "in [0, 1], got 1.5"),
    ("convert ratio", lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "nvfp4", rac_ratio=-0.1),
     "rac_ratio", "in [0, 1], got -0.1"),
    ("mode", lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "int4"), "'int4'",
     "unknown rollout mode"),
    ("fp8 with RAC", lambda: rac.convert_for_rollout(tiny_model(vocab_size=48), "fp8", rac_ratio=0.5),
     "rac_ratio=0.5", "compensates NVFP4 activations; mode 'fp8' has none"),
    ("sync target", lambda: rac.sync_weights(rac.convert_for_rollout(tiny_model(vocab_size=48), "nvfp4"),
                                             nn.Linear(2, 2)),
     "sync_weights", "has no parameter 'layers.0.attn.q_proj.weight'"),
]


@pytest.mark.parametrize("call, names, problem", [case[1:] for case in BAD_CALLS],
                         ids=[case[0] for case in BAD_CALLS])
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)
