"""gpu_kernels/w4a4_common.py: what the Hopper W4A4 GEMMs share, apart from the decode and the main
loop (held to the references through the dense and the experts' kernels' tests): the autotuning
tables' rows reach Triton's configurations field by field, the interpreter's configurations cover
the tables' buckets, the fp16 operand planes are 16-byte aligned, and an operand's global scale is
one or one per row (on the CPU under TRITON_INTERPRET=1, on a GPU natively)."""

import pytest
import torch
from conftest import raises_one_line

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w4a4_common, w4a4_dense, w4a4_experts  # noqa: E402


def test_configuration_table_reaches_triton_with_its_operand_order_and_register_cap(monkeypatch):
    # the table's optional 7th and 8th fields (X_FIRST, maxnreg) must reach the autotuner's
    # configurations: a dropped cap compiles another kernel than the one measured; the dense
    # kernel's have no X_FIRST
    monkeypatch.setattr(w4a4_common, "INTERPRET", False)
    # the dense table, its 16-row bucket a row with X_FIRST and a register cap
    table = {**w4a4_dense.DENSE_CONFIGS, 16: [(16, 64, 256, 4, 2, 1, True, 128)]}
    entries = [(bucket, entry) for bucket, rows in table.items() for entry in rows]
    configs = w4a4_common.autotune_configs(table)
    assert len(configs) == len(entries)
    for config, (bucket, entry) in zip(configs, entries):
        kw = config.kwargs
        assert (
            kw["BLOCK_M"],
            kw["BLOCK_N"],
            kw["BLOCK_K"],
            config.num_warps,
            config.num_stages,
            kw["SPLIT_K"],
            kw["BUCKET"],
        ) == (*entry[:6], bucket)
        assert kw["X_FIRST"] == (len(entry) > 6 and entry[6])
        assert config.maxnreg == (entry[7] if len(entry) > 7 else None)
    assert not any(
        "X_FIRST" in config.kwargs for config in w4a4_common.autotune_configs(table, x_first=False)
    )


def test_the_interpreters_configurations_cover_every_bucket_and_both_epilogues(monkeypatch):
    # one small configuration a bucket, for the buckets of both tables; K split in two in the decode
    # buckets (the split-K epilogue runs in the tests) and X_FIRST in two (both operand orders do)
    assert set(w4a4_common.INTERPRETER_CONFIGS) == set(w4a4_dense.DENSE_CONFIGS)
    assert set(w4a4_common.INTERPRETER_CONFIGS) == set(w4a4_experts.GROUPED_CONFIGS)
    monkeypatch.setattr(w4a4_common, "INTERPRET", True)
    configs = w4a4_common.autotune_configs(w4a4_experts.GROUPED_CONFIGS)
    assert [c.kwargs["BUCKET"] for c in configs] == [16, 64, 256, 4096]
    assert [c.kwargs["SPLIT_K"] for c in configs] == [2, 2, 1, 1]
    assert [c.kwargs["X_FIRST"] for c in configs] == [True, False, True, False]


def test_operand_planes_are_16_byte_aligned_and_a_scale_is_one_or_one_per_row(kernel_device):
    planes = w4a4_common.empty_planes(3, 40, kernel_device)  # 120 elements a plane, 128 apart
    assert planes.shape == (2, 3, 40) and planes.dtype == torch.float16
    assert planes.stride(0) == 128 and planes[1].data_ptr() - planes[0].data_ptr() == 256
    per_row = w4a4_common.x_scale_is_per_row
    assert not per_row(torch.ones((), device=kernel_device), 3, "dense_matmul")
    assert not per_row(torch.ones(1, device=kernel_device), 3, "dense_matmul")
    assert per_row(torch.ones(3, device=kernel_device), 3, "dense_matmul")
    raises_one_line(
        lambda: per_row(torch.ones(4, device=kernel_device), 3, "grouped_matmul"),
        "grouped_matmul: x_global_scale",
        "one per operand row (3,), got shape (4,)",
    )
