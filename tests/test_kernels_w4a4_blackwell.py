"""gpu_kernels/w4a4_blackwell.py: the native FP4 kernels compile for sm_100 to Blackwell's
block-scaled FP4 tensor-core instruction (with one x scale or one per row), and their first-use
check against the Hopper kernels names what fails. Their numerics stay untested without a Blackwell
GPU."""

import pytest
import torch
from test_kernels_w4a4_quantize import compiled_output

import nvfp4

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w4a4_blackwell  # noqa: E402,F401

_COMPILE_FOR_SM100 = r"""
import re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from gpu_kernels import w4a4_blackwell
p8, pf, p32, i = "*u8", "*fp32", "*i32", "i32"
grouped_types = [p8, "*fp8e4nv", p8, "*fp8e4nv", pf, "*i64", pf, "*i64", p8, "*fp8e4nv", pf, "*i64"]
grouped_types += ["*i16"] + [i] * 14
kernels = {}
for row_scale in (False, True):
    common = dict(OUT_BF16=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, ROW_SCALE=row_scale)
    kernels.update({name + "_row" * row_scale: kernel for name, kernel in {
        "dense": (w4a4_blackwell.dense_native_kernel,
                  [p8, "*fp8e4nv", p8, "*fp8e4nv", pf, p8, "*fp8e4nv", pf, "*i16"] + [i] * 9,
                  dict(HAS_RESIDUAL=True, **common)),
        "grouped": (w4a4_blackwell.grouped_native_kernel, grouped_types,
                    dict(GATHER=True, ROW_WEIGHTS=False, WEIGHT_IDS=False, SWIGLU=True,
                         HAS_RESIDUAL=True, E_POW2=128, **common)),
        "grouped_down": (w4a4_blackwell.grouped_native_kernel, grouped_types,
                         dict(GATHER=False, ROW_WEIGHTS=True, WEIGHT_IDS=True, SWIGLU=False,
                              HAS_RESIDUAL=True, E_POW2=128, **common)),
    }.items()})
for name, (kernel, types, constants) in kernels.items():
    signature = dict(zip(kernel.arg_names, types + ["constexpr"] * len(constants)))
    compiled = compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 100, 32))
    ptx = compiled.asm["ptx"]
    # NVFP4's block-16 scaled MMA: spelled .block16 by Triton 3.9, .scale_vec::4X (its older alias)
    # by 3.6
    print(name, len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale"
                               r"\.(?:block16|scale_vec::4X)\b", ptx)))
"""


def test_native_kernels_compile_to_blackwell_fp4_tensor_core_instructions():
    # This checks the instruction, not the numerics: those stay untested without a Blackwell GPU.
    counts = dict(line.split() for line in compiled_output(_COMPILE_FOR_SM100))
    assert set(counts) == {
        name + row for name in ("dense", "grouped", "grouped_down") for row in ("", "_row")
    }, counts
    assert all(int(n) > 0 for n in counts.values()), counts


def test_disagreement_names_the_kernel_that_fails_or_differs(kernel_device, monkeypatch):
    # stand-ins for the native launches (no Blackwell GPU here): right, wrong and failing; the
    # Hopper side is the real kernels (on the CPU under the interpreter)
    import rac

    w4a4_blackwell = rac.w4a4_blackwell

    def codes(x_data, x_scale, r_data, r_scale, global_scale):
        residual = None if r_data is None else nvfp4.NVFP4Tensor(r_data, r_scale, global_scale)
        return nvfp4.NVFP4Tensor(x_data, x_scale, global_scale), residual

    def dense_reference(
        x_data, x_scale, r_data, r_scale, x_global, w_data, w_scale, w_global, out_dtype
    ):
        x_q, residual = codes(x_data, x_scale, r_data, r_scale, x_global)
        return rac.matmul_reference(
            x_q, nvfp4.NVFP4Tensor(w_data, w_scale, w_global), residual, out_dtype
        )

    def grouped_reference(
        x_data, x_scale, r_data, r_scale, x_global, w_data, w_scale, w_global, counts, out_dtype
    ):
        x_q, residual = codes(x_data, x_scale, r_data, r_scale, x_global)
        return rac.grouped_matmul_reference(
            x_q, rac.ExpertWeights(w_data, w_scale, w_global), counts, residual, out_dtype=out_dtype
        )

    def wrong(reference):
        return lambda *args: reference(*args) * 1.01

    def broken(*args):
        raise RuntimeError("no FP4 tensor cores here")

    device = torch.device(kernel_device)
    for dense, grouped, expected in (
        (dense_reference, grouped_reference, None),
        (
            wrong(dense_reference),
            grouped_reference,
            "the native FP4 dense GEMM disagrees with the Hopper",
        ),
        (dense_reference, wrong(grouped_reference), "the native FP4 grouped GEMM disagrees"),
        (broken, grouped_reference, "the native FP4 dense GEMM failed on"),
        (dense_reference, broken, "the native FP4 grouped GEMM failed on"),
    ):
        monkeypatch.setattr(w4a4_blackwell, "dense_matmul", dense)
        monkeypatch.setattr(w4a4_blackwell, "grouped_matmul", grouped)
        problem = w4a4_blackwell.disagreement(device)
        assert (
            (problem is None) if expected is None else (expected in problem and "\n" not in problem)
        ), problem
