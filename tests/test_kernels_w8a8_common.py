"""gpu_kernels/w8a8_common.py: what the FP8 GEMMs share, apart from the main loop and the x tile
(held to the references through the dense and the experts' kernels' tests): a table's rows reach
Triton's configurations field by field, SPLIT_K only for the kernel that takes it, and under the
interpreter one small configuration per bucket, splitting K in the decode buckets."""

import pytest

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w8a8_common, w8a8_dense, w8a8_experts  # noqa: E402


def _fields(config):
    """A Triton configuration -> the table row it should come from, and its bucket."""
    kwargs = dict(config.kwargs)
    row = [kwargs.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
    row += [config.num_warps, config.num_stages]
    if "SPLIT_K" in kwargs:
        row.append(kwargs.pop("SPLIT_K"))
    bucket = kwargs.pop("BUCKET")
    assert not kwargs, f"unexpected fields {kwargs}"
    return bucket, tuple(row)


@pytest.mark.parametrize(
    "table, has_split_k",
    [(w8a8_dense.DENSE_CONFIGS, True), (w8a8_experts.GROUPED_CONFIGS, False)],
    ids=["dense", "grouped"],
)
def test_table_rows_reach_triton_field_by_field(monkeypatch, table, has_split_k):
    # on a GPU every row of every bucket is a candidate, in the table's order; the grouped kernel
    # has no SPLIT_K argument, so its configurations must not carry one
    monkeypatch.setattr(w8a8_common, "INTERPRET", False)
    configs = w8a8_common.autotune_configs(table, has_split_k)
    expected = [(bucket, row) for bucket, rows in table.items() for row in rows]
    assert [_fields(config) for config in configs] == expected
    assert all(("SPLIT_K" in config.kwargs) == has_split_k for config in configs)


def test_interpreter_takes_one_small_configuration_per_bucket(monkeypatch):
    # the interpreter's table covers the dense buckets, and the experts' buckets map onto it
    assert list(w8a8_common.INTERPRETER_CONFIGS) == list(w8a8_dense.DENSE_CONFIGS)
    monkeypatch.setattr(w8a8_common, "INTERPRET", True)
    dense = w8a8_common.autotune_configs(w8a8_dense.DENSE_CONFIGS, has_split_k=True)
    assert [_fields(config) for config in dense] == [
        (16, (16, 32, 64, 4, 1, 2)),
        (64, (16, 32, 64, 4, 1, 2)),
        (256, (16, 32, 64, 4, 1, 1)),
        (4096, (16, 32, 64, 4, 1, 1)),
    ]
    grouped = w8a8_common.autotune_configs(w8a8_experts.GROUPED_CONFIGS, has_split_k=False)
    assert [_fields(config) for config in grouped] == [
        (bucket, (16, 32, 64, 4, 1)) for bucket in w8a8_experts.GROUPED_CONFIGS
    ]
