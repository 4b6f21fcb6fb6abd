"""gpu_kernels/gemm_common.py: what the GEMM kernels share, against hand-computed values and loops:
the autotuner's bucket of rows and its pruning, the stacked weights' column offsets (every element
stored where its own weight's (M, n) output holds it), and the grouped kernels' tile schedule (each
program's expert and rows against a loop laying every expert's tiles end to end) (on the CPU under
TRITON_INTERPRET=1, on a GPU natively)."""

import pytest
import torch

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_kernels import gemm_common  # noqa: E402
from gpu_kernels.gemm_common import expert_tile, split_columns  # noqa: E402


def test_a_call_is_tuned_among_the_configurations_of_its_bucket_of_rows():
    table = {16: [], 64: [], 256: [], 4096: []}
    buckets = [gemm_common.m_bucket(m, table) for m in (1, 16, 17, 64, 65, 256, 257, 10**6)]
    assert buckets == [16, 16, 64, 64, 256, 256, 4096, 4096]
    # the experts' FP8 table starts at 4 rows an expert
    assert [gemm_common.m_bucket(m, {4: [], 16: [], 4096: []}) for m in (3, 5)] == [4, 16]
    configs = [triton.Config({"BLOCK_M": m, "BUCKET": b}) for b in (16, 64) for m in (16, 32)]
    kept = gemm_common.prune_to_bucket(configs, {"M_BUCKET": 64})
    assert [(c.kwargs["BUCKET"], c.kwargs["BLOCK_M"]) for c in kept] == [(64, 16), (64, 32)]


def test_stacked_weights_columns_split_where_each_weight_begins():
    # q/k/v of 4096, 512 and 512 rows: the second weight's global scale from column 4096 on, the
    # third's from 4608; one weight: no split before N
    assert gemm_common.column_splits(5120, (4096, 512, 512)) == (4096, 4608)
    assert gemm_common.column_splits(64, (40, 24)) == (40, 64)
    assert gemm_common.column_splits(96, None) == (96, 96)
    y = torch.zeros(6, dtype=torch.bfloat16)
    assert gemm_common.as_int16(y).dtype == torch.int16
    assert gemm_common.as_int16(y).data_ptr() == y.data_ptr()
    y = torch.zeros(6)
    assert gemm_common.as_int16(y) is y


@triton.jit
def _split_columns_kernel(out_ptr, M, N, N1, N2, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    which, col_base, col_stride = split_columns(cols, M, N, N1, N2)
    tl.store(out_ptr + cols * 3, which.to(tl.int64), mask=mask)
    tl.store(out_ptr + cols * 3 + 1, col_base, mask=mask)
    tl.store(out_ptr + cols * 3 + 2, col_stride, mask=mask)


@pytest.mark.parametrize("splits", [(40, 24, 8), (40, 32), None])
def test_every_element_of_a_stacked_output_lands_in_its_own_weights_output(kernel_device, splits):
    # element (row r, column c) of the stacked (M, N) product is stored at col_base[c] + r *
    # col_stride[c]; split_output must then give each weight's columns as its own (M, n) tensor
    M, N = 3, sum(splits or (72,))
    n1, n2 = gemm_common.column_splits(N, splits)
    out = torch.empty(N, 3, dtype=torch.int64, device=kernel_device)
    _split_columns_kernel[(1,)](out, M, N, n1, n2, BLOCK=128)
    which, col_base, col_stride = out.cpu().unbind(1)
    starts = [0, n1, n2][: len(splits or (N,))]
    assert which.tolist() == [sum(c >= s for s in starts[1:]) for c in range(N)]
    product = torch.arange(M * N, dtype=torch.float32).view(M, N)
    y = torch.full((M * N,), float("nan"))
    rows = torch.arange(M)[:, None]
    y[col_base[None, :] + rows * col_stride[None, :]] = product
    parts = gemm_common.split_output(y, M, N, splits)
    if splits is None:
        assert torch.equal(parts, product)
    else:
        for part, columns in zip(parts, product.split(list(splits), dim=1)):
            assert part.is_contiguous() and torch.equal(part, columns)


@triton.jit
def _expert_tile_kernel(counts_ptr, out_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    pid_m = tl.program_id(0)
    expert, row0, end_row = expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    tl.store(out_ptr + pid_m * 3, expert)
    tl.store(out_ptr + pid_m * 3 + 1, row0)
    tl.store(out_ptr + pid_m * 3 + 2, end_row)


def test_each_program_finds_its_experts_row_tile_and_the_surplus_ones_none(kernel_device):
    # experts without rows, one with less than a tile, one with several; the grid is the launches'
    # upper bound cdiv(rows, BLOCK_M) + min(E, rows), its last programs beyond the last tile
    counts = [3, 0, 17, 1, 0, 8]
    block_m = 4
    tiles = []  # the oracle: (expert, first row, end row) of each tile, experts end to end
    start = 0
    for expert, rows in enumerate(counts):
        tiles += [(expert, start + t, start + rows) for t in range(0, rows, block_m)]
        start += rows
    E, n_rows = len(counts), sum(counts)
    grid = triton.cdiv(n_rows, block_m) + min(E, n_rows)
    row_counts = torch.tensor(counts, dtype=torch.int64, device=kernel_device)
    out = torch.empty(grid, 3, dtype=torch.int32, device=kernel_device)
    E_POW2 = triton.next_power_of_2(E)
    _expert_tile_kernel[(grid,)](row_counts, out, E, BLOCK_M=block_m, E_POW2=E_POW2)
    found = [tuple(row) for row in out.cpu().tolist()]
    assert found[: len(tiles)] == tiles
    assert all(expert >= E for expert, _, _ in found[len(tiles) :])


def test_a_grouped_launch_gets_its_output_flags_and_row_tensors():
    row_ids = torch.arange(5)
    for counts, e_pow2 in ((torch.tensor([2, 0, 3]), 4), (torch.tensor([5]), 2)):  # at least 2
        y, flags, row_tensors = gemm_common.grouped_output(
            5, 8, counts, torch.bfloat16, row_ids, None, None, True
        )
        assert y.shape == (5, 4) and y.dtype == torch.bfloat16  # SwiGLU: half the weight's rows
        expected_flags = dict(GATHER=True, ROW_WEIGHTS=False, WEIGHT_IDS=False, SWIGLU=True)
        assert flags == dict(expected_flags, E_POW2=e_pow2)
        # an absent row tensor is replaced by counts: a pointer the kernel never reads
        assert row_tensors[0] is row_ids and row_tensors[1] is counts and row_tensors[2] is counts
