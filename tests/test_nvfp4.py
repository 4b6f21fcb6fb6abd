"""Tests for nvfp4.py: the format against an independent float64 oracle (every bf16 bit pattern
included), signs, packing, edge cases, the error bound, and the public API on both paths (the torch
reference, and the Triton kernels of gpu_kernels/nvfp4_quantize.py; their own tests are in
test_kernels_nvfp4_quantize.py)."""

import re

import pytest
import torch
from conftest import assert_same_quantization, bits, raises_one_line, report_diff, same_bits

import nvfp4

GRID = nvfp4.E2M1_VALUES


# ------------------------------------------------------------------ an independent oracle (float64)
def _oracle_e4m3(v):
    """Nearest E4M3 value to v >= 0 (float64) by enumerating the grid, ties to the even mantissa,
    clamped to 448."""
    # every (exponent, mantissa) but 0x7F, which is NaN
    fields = [(e, m) for e in range(16) for m in range(8) if not (e == 15 and m == 7)]
    grid = torch.tensor(
        [(1 + m / 8) * 2.0 ** (e - 7) if e else m / 8 * 2.0**-6 for e, m in fields],
        dtype=torch.float64,
    )
    mant_even = torch.tensor([m % 2 == 0 for _, m in fields])
    v = v.clamp(0, 448).unsqueeze(-1)
    dist = (grid - v).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # among the nearest (one, or two at a tie) prefer the even mantissa
    score = torch.where(dist == best, 0, 2) + torch.where(mant_even, 0, 1)
    return grid[score.argmin(dim=-1)]


def _oracle_e2m1(q, sign_of):
    """Nearest E2M1 magnitude to |q| (float64), ties to the even code, saturating at 6, carrying the
    sign bit of `sign_of` (IEEE rounding keeps the sign of a result that rounds to zero)."""
    mags = torch.tensor(GRID, dtype=torch.float64)
    dist = (mags - q.abs().clamp(max=6.0).unsqueeze(-1)).abs()  # saturate first
    best = dist.min(dim=-1, keepdim=True).values
    code_parity = torch.arange(8) % 2
    score = torch.where(dist == best, 0, 2) + code_parity
    return torch.copysign(mags[score.argmin(dim=-1)], sign_of.double())


def _oracle_global_scale(x):
    """amax / 2688 correctly rounded to fp32 (a float64 quotient rounds to the same fp32 number)."""
    return (x.double().abs().max() / 2688).float()


def _oracle_dequantize(x, global_scale):
    """float64 oracle of dequantize(quantize(x, global_scale)) in fp32, for finite blocks of x
    (..., K): block scales by enumerating E4M3, elements rounded to the E2M1 value nearest x / unit
    (a true division, ties to even). Returns (value, alternative). The format compares |x| with fp32
    products m * unit instead of dividing; where such a product is inexact and |x| lies between it
    and the exact m * unit, the neighbour across m is just as right, and `alternative` holds it
    (elsewhere it equals `value`)."""
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32).double()
    blocks = x.double().reshape(-1, 16)
    amax = blocks.abs().amax(dim=-1)
    scale_f32 = ((amax / 6).float().double() / global_scale).float()  # the two fp32 divisions
    block_scale = _oracle_e4m3(scale_f32.double())
    unit = (block_scale * global_scale).float().double()[:, None]  # (blocks, 1)
    q = torch.where(unit > 0, blocks / unit, torch.zeros_like(blocks))
    value = _oracle_e2m1(q, sign_of=blocks)
    alternative = value.clone()
    for i, mid in enumerate(nvfp4.E2M1_MIDPOINTS):
        exact = mid * unit  # exact in float64
        product = exact.float().double()  # what the format compares with
        mag = blocks.abs()
        between = (mag >= torch.minimum(exact, product)) & (mag <= torch.maximum(exact, product))
        across = torch.where(value.abs() == GRID[i], GRID[i + 1], GRID[i])
        alternative = torch.where(
            between & (exact != product), torch.copysign(across, blocks), alternative
        )
    scale = block_scale[:, None] * global_scale  # products exact in float64
    return tuple((v * scale).float().reshape(x.shape) for v in (value, alternative))


def _assert_equals_oracle(got, x, global_scale):
    """got (any dtype) holds, bit for bit and with the signs of zeros, the oracle's values in its
    dtype."""
    value, alternative = (bits(v.to(got.dtype)) for v in _oracle_dequantize(x, global_scale))
    ok = (bits(got) == value) | (bits(got) == alternative)
    assert ok.all(), f"{int((~ok).sum())} of {ok.numel()} elements differ from the oracle"


def _sign_bits(x):
    """The sign bit of every element, read from the bit pattern."""
    return bits(x) < 0


# ------------------------------------------------------------------ the two paths of the public API
@pytest.fixture(params=["torch twin", "triton kernels"])
def api_device(request, monkeypatch):
    """Where the public API runs: on the CPU through the torch twin, or through the Triton kernels
    (natively on a GPU; on the CPU they are forced, under the interpreter)."""
    if request.param == "torch twin":
        return "cpu"
    if nvfp4.nvfp4_quantize is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setattr(nvfp4, "_use_triton", lambda x: True)
    return "cpu"


# ------------------------------------------------------------------ codes and packing
def test_every_code_round_trips_through_decode_and_encode():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.decode_e2m1(codes)
    assert values.tolist() == [*GRID, *(-v for v in GRID)]
    assert _sign_bits(values).tolist() == [False] * 8 + [True] * 8  # code 8 is -0.0
    assert torch.equal(nvfp4.encode_e2m1(values), codes)


def test_packing_is_an_exact_inverse_of_unpacking():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(nvfp4.unpack_codes(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(every_byte)), every_byte)
    # low nibble first
    assert nvfp4.pack_codes(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21


# ------------------------------------------------------------------ every bf16 bit pattern
ANCHORED_SCALE = 2.0**-8


def _every_bf16_pattern():
    """All 65,536 bf16 bit patterns in three groups of 16-element blocks:
    - "small" (|v| <= 6): 15 to a block beside an anchor 6.0 (padded with +0). With the global scale
      2^-8 the anchor makes block_scale 256 and the block's divisor exactly 1, so each v is rounded
      on the bare E2M1 grid;
    - "large" (finite, |v| > 6) and "non-finite" (+-Inf, NaN): 16 to a block in bit-pattern
      order."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = patterns.isfinite()
    small = patterns[finite & (patterns.abs() <= 6)]
    large = patterns[finite & (patterns.abs() > 6)]
    small = torch.cat([small, small.new_zeros(-small.numel() % 15)]).view(-1, 15)
    anchor = torch.full((small.shape[0], 1), 6.0, dtype=torch.bfloat16)
    large = torch.cat([large, large[: -large.numel() % 16]]).view(-1, 16)
    return {
        "small": torch.cat([small, anchor], dim=1),
        "large": large,
        "non-finite": patterns[~finite].view(-1, 16),
    }


EVERY_BF16 = _every_bf16_pattern()


def test_every_bf16_pattern_lands_on_the_oracle_value_with_its_sign():
    assert (
        sum(x.numel() for x in EVERY_BF16.values()) >= 65536
        and EVERY_BF16["non-finite"].numel() == 256
    )
    for name, x in EVERY_BF16.items():
        out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, ANCHORED_SCALE), torch.float32)
        if name == "non-finite":
            assert out.isnan().all()  # a block holding NaN or Inf is NaN
            continue
        assert same_bits(*_oracle_dequantize(x, ANCHORED_SCALE)), name  # exact products: one answer
        _assert_equals_oracle(out, x, ANCHORED_SCALE)
    # the anchored values are exactly the round-to-nearest-even E2M1 value of v itself
    small = EVERY_BF16["small"][:, :15]
    q = nvfp4.quantize_reference(EVERY_BF16["small"], ANCHORED_SCALE)
    out = nvfp4.dequantize_reference(q, torch.float32)
    assert same_bits(out[:, :15], _oracle_e2m1(small.double(), sign_of=small).float())
    assert (out[:, 15] == 6).all()


def test_every_code_keeps_the_sign_bit_of_its_input():
    """Checked against the bit pattern of every bf16 value, in ordinary blocks (the small group), in
    saturated blocks (large), in NaN blocks (non-finite) and in zero blocks (the small group under a
    global scale so large that every block scale rounds to 0)."""
    cases = [(x, ANCHORED_SCALE) for x in EVERY_BF16.values()] + [(EVERY_BF16["small"], 1e30)]
    for x, global_scale in cases:
        q = nvfp4.quantize_reference(x, global_scale)
        codes = nvfp4.unpack_codes(q.data)
        assert torch.equal((codes & 8) != 0, _sign_bits(x))
        if global_scale == 1e30:
            assert (bits(q.block_scale) == 0).all() and ((codes & 7) == 0).all()  # all zero blocks
        finite = x.isfinite().all(dim=-1)
        out = nvfp4.dequantize_reference(q, torch.float32)[finite]
        assert torch.equal(_sign_bits(out), _sign_bits(x[finite]))  # zeros keep the input's sign


# ------------------------------------------------------------------ rounding rules
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_each_tie_of_the_grid_rounds_to_the_even_code(sign):
    # with block [6, ties...] and global scale 2^-8 the divisor is exactly 1
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6: all even
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1:8] = sign * torch.tensor(ties)
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0**-8), torch.float32)
    assert out[0, 1:8].tolist() == [sign * e for e in expected]
    # one ulp either side of a tie goes to the nearer neighbour
    above = torch.nextafter(torch.tensor(ties), torch.tensor(10.0))
    below = torch.nextafter(torch.tensor(ties), torch.tensor(-10.0))
    x[0, 1:8] = sign * above
    up = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0**-8), torch.float32)[0, 1:8]
    x[0, 1:8] = sign * below
    down = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0**-8), torch.float32)[0, 1:8]
    assert up.abs().tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert down.abs().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_values_beyond_six_times_the_scale_saturate():
    gs = torch.tensor(0.01)
    top = 6 * 448 * 0.01
    x = torch.tensor([[1e3, -1e3, 5e4, -float(top) * 1.01] + [0.0] * 12])
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, gs), torch.float32)
    limit = 6 * 448 * gs.item()
    assert out[0, :4].tolist() == pytest.approx([limit, -limit, limit, -limit], rel=1e-6)


# ------------------------------------------------------------------ edge cases (one behaviour each)
def test_all_zero_tensor_has_global_scale_one_and_dequantizes_to_signed_zeros():
    x = torch.zeros(2, 32)
    x[1] = -0.0
    q = nvfp4.quantize_reference(x)
    assert q.global_scale.item() == 1.0 and (q.block_scale.float() == 0).all()
    assert nvfp4.unpack_codes(q.data).tolist() == [[0] * 32, [8] * 32]
    assert same_bits(nvfp4.dequantize_reference(q, torch.float32), x)


def test_zero_block_beside_nonzero_blocks_is_stored_as_signed_zeros():
    x = torch.randn(1, 64)
    x[0, 16:32] = 0
    x[0, 32:48] = 1e-12  # far below the tensor's largest value: its scale rounds to 0
    x[0, 48:64] = -1e-12
    q = nvfp4.quantize_reference(x)
    assert (q.block_scale.float()[0, 1:] == 0).all() and q.block_scale.float()[0, 0] > 0
    assert nvfp4.unpack_codes(q.data)[0, 16:].tolist() == [0] * 32 + [8] * 16
    assert same_bits(nvfp4.dequantize_reference(q, torch.float32)[0, 16:], x[0, 16:] * 0)


def test_negative_values_rounding_to_zero_are_stored_as_negative_zero():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1:5] = torch.tensor([-0.1, -0.25, 0.1, -0.0])  # -0.25 is a tie: rounds to the even code 0
    q = nvfp4.quantize_reference(x, 2.0**-8)
    assert nvfp4.unpack_codes(q.data)[0, 1:6].tolist() == [8, 8, 0, 8, 0]
    out = nvfp4.dequantize_reference(q, torch.float32)
    assert (out[0, 1:5] == 0).all() and _sign_bits(out[0, 1:6]).tolist() == [
        True,
        True,
        False,
        True,
        False,
    ]


def test_subnormal_inputs_are_quantized_not_flushed():
    tiny = torch.finfo(torch.bfloat16).tiny  # smallest normal; everything below is subnormal
    x = (torch.rand(4, 32) * tiny * 0.99).to(torch.bfloat16)
    assert (x.float().abs() < tiny).all()
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x), torch.float32)
    assert out.abs().sum() > 0
    # float64: squares underflow in fp32
    rel = (out.double() - x.double()).norm() / x.double().norm()
    assert rel < 0.2


def test_nan_and_inf_propagate_as_nan():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    # computed global scale: the tensor amax is not finite, so everything is NaN
    q = nvfp4.quantize_reference(x)
    assert q.global_scale.isnan()
    assert nvfp4.dequantize_reference(q, torch.float32).isnan().all()
    # caller global scale: only the blocks holding NaN/Inf are NaN
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 0.01), torch.float32)
    assert out[0, :16].isnan().all() and out[1, 16:].isnan().all()
    assert torch.isfinite(out[0, 16:]).all() and torch.isfinite(out[1, :16]).all()


# ------------------------------------------------------------------ error bound
def test_dequantization_error_is_within_the_format_bound():
    """Per element, |x - dq(q(x))| <= block_scale * global_scale: half the widest grid gap (4 -> 6)
    is 1 unit of the block's divisor, and saturation of a block maximum that the E4M3 rounding
    pushed past 6 costs at most 6 / 16 units (E4M3 has 3 mantissa bits: relative rounding <= 2^-4).
    With block_scale * global_scale <= (block_amax / 6) * (1 + 2^-4), the bound is about 18% of the
    block amax. For normal data the relative RMS error is measured at about 9.4%; we also require
    < 11%."""
    torch.manual_seed(0)
    x = torch.randn(256, 1024)
    q = nvfp4.quantize_reference(x)
    out = nvfp4.dequantize_reference(q, torch.float32)
    divisor = (q.block_scale.float() * q.global_scale).repeat_interleave(16, dim=-1)
    assert ((out - x).abs() <= divisor).all()
    block_amax = x.abs().reshape(256, 64, 16).amax(-1).repeat_interleave(16, dim=-1)
    assert (divisor <= block_amax / 6 * (1 + 2**-4)).all()
    rel = ((out - x).norm() / x.norm()).item()
    print(f"relative RMS error on N(0,1): {rel:.4f}")
    assert rel < 0.11


@pytest.mark.cuda
def test_quantize_on_cuda_uses_the_kernel_and_matches_reference_at_scale():
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x[:, 17] *= 50  # an outlier channel
    q = nvfp4.quantize(x)
    assert_same_quantization(nvfp4.quantize_reference(x.cpu()), q)
    assert same_bits(
        nvfp4.dequantize(q), nvfp4.dequantize_reference(nvfp4.quantize_reference(x.cpu()))
    )
    assert same_bits(nvfp4.fake_quantize(x), nvfp4.dequantize(q))


# ------------------------------------------------------------------ the public API, on both paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_and_quantize_then_dequantize_equal_the_oracle(api_device, dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.logspace(-7, 2, 6)[:, None]  # rows of very different scales
    x[5, :16] = -x[5, :16].abs() * 1e-9  # negative values that round to -0
    x = x.to(dtype)
    global_scale = _oracle_global_scale(x)
    fake = nvfp4.fake_quantize(x.to(api_device))
    report_diff(fake.cpu(), x, "fake_quantize vs x")
    _assert_equals_oracle(fake, x, global_scale)
    _assert_equals_oracle(
        nvfp4.dequantize(nvfp4.quantize(x.to(api_device)), dtype), x, global_scale
    )


def test_gradient_of_fake_quantize_is_the_identity(api_device):
    x = torch.randn(3, 32, device=api_device, requires_grad=True)
    upstream = torch.randn(3, 32, device=api_device)
    (nvfp4.fake_quantize(x) * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)


def test_a_given_global_scale_is_the_one_the_blocks_are_scaled_by(api_device):
    torch.manual_seed(0)
    a, b = torch.randn(8, 32), torch.randn(4, 32) * 10
    shared = nvfp4.compute_global_scale(torch.cat([a, b]))
    assert same_bits(shared, _oracle_global_scale(torch.cat([a, b])))
    for given in (shared, shared.item()):  # a tensor or a Python float
        q = nvfp4.quantize(
            a.to(api_device), given if isinstance(given, float) else given.to(api_device)
        )
        assert same_bits(q.global_scale, shared)
        _assert_equals_oracle(nvfp4.dequantize(q, torch.float32), a, shared)
    # a's own scale is about 10x smaller: its block scales, and so its values, differ
    assert not torch.equal(bits(nvfp4.quantize(a).block_scale), bits(q.block_scale))


@pytest.mark.parametrize("shape", [(24, 64), (3, 16, 32)], ids=["linear", "experts"])
def test_weight_rule_gives_trainer_and_rollout_the_oracle_values(api_device, shape):
    """One global scale per (N, K) matrix: the three experts differ 100-fold in size, so a
    tensor-wide scale would round the small ones differently."""
    torch.manual_seed(0)
    w = torch.randn(shape)
    if len(shape) == 3:
        w *= torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    w = w.to(torch.bfloat16)
    matrices = w.reshape(-1, *shape[-2:])
    scales = torch.stack([_oracle_global_scale(m) for m in matrices])
    q = nvfp4.quantize_weight(w.to(api_device))  # the rollout's packed weight
    assert q.global_scale.shape == shape[:-2] and same_bits(q.global_scale.reshape(-1), scales)
    rollout_weight = nvfp4.dequantize(q, w.dtype).reshape(matrices.shape)
    trainer_weight = nvfp4.fake_quantize_weight(w.to(api_device)).reshape(matrices.shape)
    assert same_bits(trainer_weight, rollout_weight)
    for e, (matrix, scale) in enumerate(zip(matrices, scales)):
        _assert_equals_oracle(trainer_weight[e], matrix, scale)


# --------------------------------------------------------------- per-matrix global scales (experts)
def test_per_matrix_global_scale_equals_quantizing_each_matrix_alone():
    torch.manual_seed(3)
    w = torch.randn(5, 8, 32) * torch.tensor([0.01, 1.0, 30.0, 0.5, 2.0]).view(5, 1, 1)
    gs = nvfp4.compute_global_scale(w, per_matrix=True)
    assert gs.shape == (5,)
    stacked = nvfp4.quantize_reference(w, gs)
    for e in range(5):
        alone = nvfp4.quantize_reference(w[e])
        assert torch.equal(stacked.data[e], alone.data)
        assert torch.equal(bits(stacked.block_scale[e]), bits(alone.block_scale))
        assert stacked.global_scale[e] == alone.global_scale


# ------------------------------------------------------------------ bad input
def _on_mixed_devices():
    q = nvfp4.quantize(torch.randn(2, 16))
    return nvfp4.NVFP4Tensor(q.data, q.block_scale.to("meta"), q.global_scale)


BAD_CALLS = [  # (id, call, the argument the message names, the problem it states)
    ("list", lambda: nvfp4.quantize([1.0] * 16), "x", "torch.Tensor"),
    ("int32", lambda: nvfp4.quantize(torch.ones(4, 16, dtype=torch.int32)), "x", "torch.int32"),
    (
        "fp8",
        lambda: nvfp4.quantize(torch.ones(4, 16).to(torch.float8_e4m3fn)),
        "x",
        "float8_e4m3fn",
    ),
    ("empty", lambda: nvfp4.quantize(torch.empty(0, 16)), "x", "non-empty"),
    ("0-dim", lambda: nvfp4.quantize(torch.tensor(1.0)), "x", "at least one dim"),
    (
        "K=20",
        lambda: nvfp4.quantize(torch.randn(4, 20)),
        "last dim",
        "multiple of the block size 16",
    ),
    ("fake K=20", lambda: nvfp4.fake_quantize(torch.randn(4, 20)), "fake_quantize", "multiple of"),
    (
        "fake int32",
        lambda: nvfp4.fake_quantize(torch.ones(4, 16, dtype=torch.int32)),
        "fake_quantize",
        "int32",
    ),
    (
        "scale device",
        lambda: nvfp4.quantize(torch.randn(2, 16), torch.tensor(1.0, device="meta")),
        "global_scale",
        "meta",
    ),
    (
        "scale shape",
        lambda: nvfp4.quantize(torch.randn(4, 8, 32), torch.ones(8)),
        "global_scale",
        "one per matrix",
    ),
    (
        "scale of 2-D",
        lambda: nvfp4.quantize(torch.randn(2, 16), torch.ones(3)),
        "global_scale",
        "one per row (shape (2,)), got shape (3,)",
    ),
    (
        "per_matrix 2-D",
        lambda: nvfp4.compute_global_scale(torch.randn(8, 32), per_matrix=True),
        "per_matrix",
        "(..., N, K)",
    ),
    ("not NVFP4", lambda: nvfp4.dequantize(torch.zeros(2, 8)), "q", "NVFP4Tensor"),
    ("mixed devices", lambda: nvfp4.dequantize(_on_mixed_devices()), "block_scale", "one device"),
    ("odd codes", lambda: nvfp4.pack_codes(torch.zeros(3, dtype=torch.uint8)), "code", "even"),
]


@pytest.mark.parametrize(
    "call, argument, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, argument, problem):
    message = raises_one_line(call, argument, problem)
    assert re.search(rf"\b{re.escape(argument)}\b", message), message  # the name as a word
