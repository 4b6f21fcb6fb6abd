"""The row-wise E4M3 quantizer of the FP8 W8A8 path (sm_89 / sm_90): x (M, K) -> codes (M, K)
E4M3, scales (M, 1) fp32, in one launch. It equals fp8.quantize_rowwise bit for bit:

    x[m, k] ~ xc[m, k] * sx[m]   sx[m] = amax |x[m, :]| / 448 (1 for a zero row); xc = e4m3(x / sx)

A program reduces its rows' amax, then divides by the scale (IEEE division, as torch does) and
rounds to nearest even. The weight takes the same rule per output row (fp8.quantize_weight, once
per weight sync, in PyTorch).

The per-tile steps are public, because the fused dense GEMM (w8a8_dense.py, through
w8a8_common.py's x tile) quantizes its activation tiles in registers with them, bit for bit what
this quantizer stores: rows_amax (a row's amax over all of K), row_scale (amax -> scale),
quantize_tile (divide, clamp, round) and to_e4m3 (the rounding, exact in the interpreter too).
With them the input checks every W8A8 launcher starts with (check, check_rows); the GEMMs' own
checks are in w8a8_common.py.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET

E4M3_MAX = 448.0
_MAX = tl.constexpr(E4M3_MAX)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------ the row-wise quantizer
@triton.jit
def to_e4m3(value, GPU: tl.constexpr):
    """fp32 values in [-448, 448] -> float8e4nv, nearest-even, as torch's .to(float8_e4m3fn). GPU:
    the hardware conversion (cvt.rn.satfinite). The interpreter's own cast rounds ties away from
    zero and truncates subnormals, so there the value is first put on the E4M3 grid in fp32
    (the cast is then exact): a normal value keeps 3 mantissa bits (integer rounding of its bit
    pattern; a carry runs into the exponent, as it should), a subnormal one (below 2^-6) becomes a
    multiple of 2^-9 (adding and subtracting 1.5 * 2^23 rounds |v| * 2^9 to an integer, ties to
    even), its sign put back so that -0.0 stays -0.0; a NaN becomes 0x7F, as torch's."""
    if GPU:
        return value.to(tl.float8e4nv)
    bits = value.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(value) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    subnormal = tl.where(bits < 0, -magnitude, magnitude)
    on_grid = tl.where(tl.abs(value) < 0.015625, subnormal, normal)
    byte = on_grid.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(value == value, byte, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def row_scale(amax):
    """fp8.quantize_rowwise's scale: amax / 448 (IEEE division, as torch's), 1.0 for an all-zero row
    (and, as torch's `amax > 0` test has it, for a row holding a NaN)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, _MAX), 1.0)


@triton.jit
def quantize_tile(x, scale, GPU: tl.constexpr):
    """x (R, C) fp32 and its rows' scales (R,) -> E4M3 codes: x / scale (IEEE division), clamped to
    +-448 (a NaN stays NaN, as torch's clamp keeps it), rounded."""
    value = tl.math.div_rn(x, scale[:, None])
    value = tl.minimum(
        tl.maximum(value, -_MAX, propagate_nan=tl.PropagateNan.ALL),
        _MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    return to_e4m3(value, GPU)


@triton.jit
def rows_amax(x_ptr, rows, row_mask, stride_x, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """max |x| of each of ROWS rows over all K columns -> (ROWS,) fp32. Taken on the bit patterns of
    |x| as integers (their order is the magnitudes' for non-negative floats, with NaN above Inf), so
    that a NaN wins as in torch's amax, on the GPU and in the interpreter alike."""
    running = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + cols[None, :],
            mask=row_mask[:, None] & (cols < K)[None, :],
            other=0.0,
        )
        running = tl.maximum(running, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    return tl.max(running, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kernel(
    # pointers: the input, its codes and its row scales
    x_ptr,
    codes_ptr,
    scale_ptr,
    # sizes and strides (elements)
    M,
    K,
    stride_x,
    stride_codes,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GPU: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    scale = row_scale(rows_amax(x_ptr, rows, row_mask, stride_x, K, ROWS, BLOCK_K))
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    for k0 in range(0, K, BLOCK_K):  # the second read of the rows comes from L1 / L2
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        tl.store(
            codes_ptr + rows[:, None] * stride_codes + cols[None, :],
            quantize_tile(x, scale, GPU),
            mask=mask,
        )


# ------------------------------------------------------------------ input checks (one line each)
def check(ok, message):
    if not ok:
        raise ValueError(message)


def check_rows(name, x, dtypes, what):
    """x checked to be a 2-D tensor of one of `dtypes`, with unit stride along its last dim
    (a copy if not)."""
    check(
        isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in dtypes,
        f"w8a8: {name} must be a 2-D {what} tensor, got "
        f"{(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__}",
    )
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


# ------------------------------------------------------------------ launch
def quantize_rows(x):
    """x (M, K) bf16/fp16/fp32 -> (codes (M, K) float8_e4m3fn, scale (M, 1) fp32):
    fp8.quantize_rowwise, bit for bit, in one launch."""
    x = check_rows("x", x, FLOATS, "bfloat16/float16/float32")
    M, K = x.shape
    codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return codes, scale
    block_k = min(triton.next_power_of_2(max(K, 16)), 2048)
    # about 4096 elements a program, but two programs an SM at least, for short latency
    rows = max(1, min(8, 4096 // block_k))
    while rows > 1 and triton.cdiv(M, rows) < 264:
        rows //= 2
    quantize_kernel[(triton.cdiv(M, rows),)](
        x, codes, scale, M, K, x.stride(0), K, ROWS=rows, BLOCK_K=block_k, GPU=not INTERPRET
    )
    return codes, scale
