"""What the GEMM kernels share around their main loops: the W4A4 Hopper kernels (w4a4_dense.py,
w4a4_experts.py, w4a4_experts_gluon.py), the native Blackwell ones (w4a4_blackwell.py) and the FP8
ones (w8a8_*.py). Each kernel file keeps its own main loop and tables; this is the rest.

Autotuning by bucket of rows. A kernel's table lists a few configurations per bucket of M (rows, or
rows per expert for the grouped kernels); a call passes its bucket (m_bucket) as the autotuning key,
the autotuner times only that bucket's candidates (prune_to_bucket), as CUDA-graph replays
(bench_in_graph), and EVEN_K_HEURISTICS says whether BLOCK_K divides K (masks constant along K).

The epilogue's stores. A (columns, rows) fp32 tile goes into y (M, N) (store_tile), BF16 rounded to
nearest even by integer arithmetic through an int16 view of y (as_int16, rounding.to_bf16_bits); or
into the outputs of up to three weights stacked along N, each its own (M, n) tensor (split_columns,
store_split; on the host column_splits and split_output).

The grouped (experts) GEMMs' scheduling. Rows are sorted by expert, counts (E,) rows each. A program
finds its (expert, row tile) from the counts on the device (expert_tile: a prefix sum, no host sync,
the grid an upper bound whose surplus programs exit), its rows and the activation rows they read
(tile_rows: gathered through row_ids, router weights through routing.order), its weight rows
(expert_weight_rows: SwiGLU's gate rows stacked on the matching up rows, so that one product holds
both halves) and its epilogue (grouped_store: scales, SwiGLU, router weights). grouped_output
allocates y and the flags every grouped launch passes.

Shape letters: M rows, N output columns (weight rows), K reduction dim, E experts.
"""

import itertools

import torch
import triton
import triton.language as tl

from gpu_kernels.rounding import to_bf16_bits


# ------------------------------------------------------------------ autotuning
def m_bucket(m, table):
    """The bucket of `table` that m rows (or rows an expert) fall in: the first that holds them,
    and 4096 for more."""
    return next(b for b in table if m <= b or b == 4096)


def prune_to_bucket(configs, named_args, **kwargs):
    """Keep the configs of the call's M bucket: autotuning times 2-4 candidates, not all of them."""
    return [c for c in configs if c.kwargs["BUCKET"] == named_args["M_BUCKET"]]


EVEN_K_HEURISTICS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0}


def bench_in_graph(kernel_call, quantiles):
    """Autotuning times candidates as CUDA-graph replays: decode kernels run for a few microseconds,
    where eager timing is mostly launch overhead and picked poor configurations
    (seen on the H200)."""
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


# ------------------------------------------------------------------ the epilogue's stores
@triton.jit
def store_at(y_ptr, offs, mask, value, OUT_BF16: tl.constexpr):
    """Store fp32 values at element offsets of y. BF16 rounds to nearest-even by integer arithmetic
    through an int16 view of y (the interpreter's own cast truncates)."""
    if OUT_BF16:
        tl.store(y_ptr + offs, to_bf16_bits(value).to(tl.int16), mask=mask)
    else:
        tl.store(y_ptr + offs, value.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, value, OUT_BF16: tl.constexpr):
    """Store a (cols, rows) tile of fp32 values into y (M, N)."""
    offs = rows[None, :].to(tl.int64) * stride_y + cols[:, None]
    store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)


@triton.jit
def split_columns(cols, M, N, N1, N2):
    """Up to three weights stacked along N, split at columns N1 and N2 (N1 = N2 = N: one weight).
    Their outputs lie one after another in y, each (M, its N) row-major. -> per column (cols,):
    which weight (its global scale's index), y's offset of its row 0, and the row stride."""
    which = (cols >= N1).to(tl.int32) + (cols >= N2).to(tl.int32)
    start = tl.where(which == 0, 0, tl.where(which == 1, N1, N2)).to(tl.int64)
    end = tl.where(which == 0, N1, tl.where(which == 1, N2, N)).to(tl.int64)
    return which, M * start + cols - start, end - start


@triton.jit
def store_split(
    y_ptr, rows, row_mask, col_base, col_stride, col_mask, value, OUT_BF16: tl.constexpr
):
    """Store a (cols, rows) tile at split_columns' offsets."""
    offs = rows[None, :].to(tl.int64) * col_stride[:, None] + col_base[:, None]
    store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)


def as_int16(y):
    """The kernels store bf16 through an int16 view (store_at rounds by integer arithmetic)."""
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y


def split_output(y, M, N, splits):
    """The flat output -> (M, N), or one contiguous (M, n) tensor per stacked weight."""
    if splits is None:
        return y.view(M, N)
    return tuple(part.view(M, n) for part, n in zip(y.split([M * n for n in splits]), splits))


def column_splits(N, splits):
    """(N1, N2) for the per-column weight global scale: N rows stacking len(splits) weights."""
    # where weights 2 and 3 begin, else N
    ends = list(itertools.accumulate(splits or ()))[:-1] + [N, N]
    return ends[0], ends[1]


# ------------------------------------------------------------------ grouped (experts) scheduling
@triton.jit
def expert_tile(counts_ptr, E, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Which (expert, row tile) is program pid_m's? Expert e owns cdiv(counts[e], BLOCK_M) tiles,
    laid end to end; a prefix sum over the E counts answers it on the device. -> (expert, first
    sorted row of the tile, end row of the expert); expert >= E: beyond the last tile, no work.
    Tiles and rows share one int64 prefix sum (tiles in the high 32 bits, rows below: no carry as
    long as there are fewer than 2^32 rows), so the program takes one cumulative sum and two
    reductions, each a round of barriers, where it took two and five."""
    experts = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int64)  # (E_POW2,)
    packed = (((counts + BLOCK_M - 1) // BLOCK_M) << 32) + counts
    ends = tl.cumsum(packed, axis=0)  # (tile end << 32) + row end
    expert = tl.sum(((ends >> 32) <= pid_m).to(tl.int32), axis=0)
    start = tl.sum(tl.where(experts == expert, ends - packed, 0), axis=0)
    first_tile = start >> 32
    first_row = (start - (first_tile << 32)).to(tl.int32)
    rows = tl.load(counts_ptr + expert, mask=expert < E, other=0).to(tl.int32)
    return expert, first_row + (pid_m - first_tile.to(tl.int32)) * BLOCK_M, first_row + rows


@triton.jit
def tile_rows(
    row_ids_ptr,
    weight_ids_ptr,
    row0,
    end_row,
    GATHER: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """A row tile -> (its sorted rows, their mask, the activation rows they read (GATHER: row_ids),
    where their router weights are (WEIGHT_IDS: weight_ids, routing.order))."""
    sorted_rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = sorted_rows < end_row
    x_rows = tl.load(row_ids_ptr + sorted_rows, mask=row_mask, other=0) if GATHER else sorted_rows
    weight_rows = (
        tl.load(weight_ids_ptr + sorted_rows, mask=row_mask, other=0) if WEIGHT_IDS else sorted_rows
    )
    return sorted_rows, row_mask, x_rows, weight_rows


@triton.jit
def expert_weight_rows(pid_n, n_out, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight rows of N tile pid_n -> (rows, mask): BLOCK_N rows, or SWIGLU's stacked tile of
    2 BLOCK_N, the gate rows (of [0, I)) then the up rows I + the same, so that one product holds
    both halves of the SwiGLU."""
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    stacked = tl.arange(0, W_ROWS)
    cols = pid_n * BLOCK_N + stacked % BLOCK_N
    return (cols + (stacked // BLOCK_N) * n_out).to(tl.int64), cols < n_out


@triton.jit
def swiglu_tile(acc, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WEIGHT_ROWS_FIRST: tl.constexpr):
    """silu(gate) * up of a stacked tile's product: (2 BLOCK_N, BLOCK_M) if WEIGHT_ROWS_FIRST (the
    Hopper kernel's) else (BLOCK_M, 2 BLOCK_N); the result keeps the order."""
    if WEIGHT_ROWS_FIRST:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def grouped_store(
    acc,
    scale,
    y_ptr,
    row_weights_ptr,
    weight_rows,
    sorted_rows,
    row_mask,
    tile,
    n_out,
    stride_y,
    ROW_WEIGHTS: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Epilogue of N tile `tile`, its (W_ROWS, BLOCK_M) product: scales, SwiGLU, router weights."""
    out = acc * scale  # (W_ROWS, BLOCK_M)
    if SWIGLU:
        out = swiglu_tile(out, BLOCK_N, BLOCK_M, True)  # (BLOCK_N, BLOCK_M)
    if ROW_WEIGHTS:
        router_weight = tl.load(row_weights_ptr + weight_rows, mask=row_mask, other=0.0)
        out = out * router_weight.to(tl.float32)[None, :]
    cols = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    store_tile(y_ptr, sorted_rows, row_mask, cols, cols < n_out, stride_y, out, OUT_BF16)


def grouped_output(n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu):
    """What every grouped launch prepares: y (n_rows, N or N/2), the kernel's flags, and the three
    optional row tensors (counts stands in for an absent one: a pointer the kernel never reads)."""
    y = torch.empty((n_rows, N // 2 if swiglu else N), dtype=out_dtype, device=counts.device)
    flags = dict(
        GATHER=row_ids is not None,
        ROW_WEIGHTS=row_weights is not None,
        WEIGHT_IDS=row_weight_ids is not None,
        SWIGLU=swiglu,
        E_POW2=max(2, triton.next_power_of_2(counts.numel())),
    )
    row_tensors = [t if t is not None else counts for t in (row_ids, row_weights, row_weight_ids)]
    return y, flags, row_tensors
