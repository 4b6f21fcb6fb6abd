"""Tests for nvfp4.py: the format's grid, packing, edge cases, error bound, and the Triton kernels
against the torch reference (bit for bit; on the CPU under TRITON_INTERPRET=1, on a GPU natively)."""
import math

import pytest
import torch

import nvfp4
from conftest import report_diff

GRID = nvfp4.E2M1_VALUES


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same_quantization(a, b):
    assert torch.equal(a.data.cpu(), b.data.cpu()), "packed codes differ"
    assert torch.equal(_bits(a.block_scale).cpu(), _bits(b.block_scale).cpu()), "block scales differ"
    assert torch.equal(a.global_scale.cpu(), b.global_scale.cpu()) or (
        a.global_scale.isnan().item() and b.global_scale.isnan().item()), "global scales differ"


def _same_bits(a, b):
    """Bitwise equality of two float tensors (-0 != +0); NaNs must sit in the same places, their
    payload and sign bits are not part of the format's contract."""
    a, b = a.cpu(), b.cpu()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(view), b[~nan].view(view))


# ------------------------------------------------------------------ an independent oracle (float64)
def _oracle_e4m3(v):
    """Nearest E4M3 value to v >= 0 by enumeration, ties to the even mantissa (clamped to 448)."""
    grid = torch.tensor([(1 + m / 8) * 2.0 ** (e - 7) if e else m / 8 * 2.0 ** -6
                         for e in range(16) for m in range(8) if not (e == 15 and m == 7)], dtype=torch.float64)
    mant_even = torch.tensor([m % 2 == 0 for e in range(16) for m in range(8) if not (e == 15 and m == 7)])
    v = v.clamp(0, 448).unsqueeze(-1)
    dist = (grid - v).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # among the nearest (one, or two at a tie) prefer the even mantissa
    score = torch.where(dist == best, 0, 2) + torch.where(mant_even, 0, 1)
    return grid[score.argmin(dim=-1)]


def _oracle_e2m1(q):
    """Nearest signed E2M1 value to q (float), ties to the even code, saturating at 6."""
    mags = torch.tensor(GRID, dtype=torch.float64)
    dist = (mags - q.abs().clamp(max=6.0).unsqueeze(-1)).abs()  # saturate first
    best = dist.min(dim=-1, keepdim=True).values
    code_parity = torch.arange(8) % 2
    score = torch.where(dist == best, 0, 2) + code_parity
    return torch.sign(q) * mags[score.argmin(dim=-1)]


# ------------------------------------------------------------------ codes and packing
def test_every_code_round_trips_through_decode_and_encode():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.decode_e2m1(codes)
    assert values.tolist() == [*GRID, *(-v for v in GRID)]
    back = nvfp4.encode_e2m1(values)
    expected = codes.clone()
    expected[8] = 0  # -0 is stored as +0: one zero
    assert torch.equal(back, expected)


def test_packing_is_an_exact_inverse_of_unpacking():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(nvfp4.unpack_codes(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(every_byte)), every_byte)
    # low nibble first
    assert nvfp4.pack_codes(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21


# ------------------------------------------------------------------ exhaustive bf16
def _all_bf16_in_anchored_blocks():
    """Every bf16 bit pattern v in its own block [v, 6, 0, ..., 0]; quantized with global scale 2^-8
    the anchor makes block_scale = 256 and block_scale * global_scale = 1 whenever |v| <= 6, so v is
    rounded on the bare E2M1 grid."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(65536, 16, dtype=torch.bfloat16)
    x[:, 0] = patterns
    x[:, 1] = 6.0
    return x


def _oracle_dequantize(x, global_scale):
    """float64 oracle of dequantize(quantize(x)) for finite blocks (per DESIGN.md's formulas)."""
    blocks = x.double().reshape(-1, 16)
    amax = blocks.abs().amax(dim=-1)
    scale_f32 = ((amax.float() / 6) / global_scale).double()  # the fp32 divisions the format specifies
    block_scale = _oracle_e4m3(scale_f32)
    denom = (block_scale.float() * global_scale).double()
    q = (blocks.float() / denom.float().unsqueeze(-1)).double()
    q = torch.where(denom.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return (_oracle_e2m1(q) * block_scale.unsqueeze(-1) * global_scale).reshape(x.shape)


def test_all_65536_bf16_patterns_land_on_the_documented_value():
    x = _all_bf16_in_anchored_blocks()
    gs = torch.tensor(2.0 ** -8)
    q = nvfp4.quantize_reference(x, gs)
    out = nvfp4.dequantize_reference(q, torch.float32).double()
    finite = torch.isfinite(x[:, 0])
    assert (~finite).sum() == 256  # exponent all ones: +-Inf and 254 NaNs
    # non-finite inputs: the whole block is NaN
    assert out[~finite].isnan().all()
    expected = _oracle_dequantize(x[finite], gs)
    assert torch.equal(out[finite], expected)
    # and within |v| <= 6 the value is exactly the round-to-nearest-even E2M1 value of v itself
    small = finite & (x[:, 0].float().abs() <= 6)
    assert torch.equal(out[small][:, 0], _oracle_e2m1(x[small][:, 0].double()))
    assert (out[small][:, 1] == 6).all()


def test_all_bf16_patterns_match_between_kernel_and_reference(kernel_device):
    x = _all_bf16_in_anchored_blocks()
    gs = torch.tensor(2.0 ** -8)
    ref = nvfp4.quantize_reference(x, gs)
    fast = nvfp4.quantize_triton(x.to(kernel_device), gs.to(kernel_device))
    _assert_same_quantization(ref, fast)


# ------------------------------------------------------------------ rounding rules
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_each_tie_of_the_grid_rounds_to_the_even_code(sign):
    # with block [6, ties...] and global scale 2^-8 the divisor is exactly 1
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6: all even
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1:8] = sign * torch.tensor(ties)
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0 ** -8), torch.float32)
    assert out[0, 1:8].tolist() == [sign * e if e else 0.0 for e in expected]
    # one ulp either side of a tie goes to the nearer neighbour
    above = torch.nextafter(torch.tensor(ties), torch.tensor(10.0))
    below = torch.nextafter(torch.tensor(ties), torch.tensor(-10.0))
    x[0, 1:8] = sign * above
    up = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0 ** -8), torch.float32)[0, 1:8]
    x[0, 1:8] = sign * below
    down = nvfp4.dequantize_reference(nvfp4.quantize_reference(x, 2.0 ** -8), torch.float32)[0, 1:8]
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
def test_all_zero_tensor_has_global_scale_one_and_dequantizes_to_zero():
    q = nvfp4.quantize_reference(torch.zeros(2, 32))
    assert q.global_scale.item() == 1.0
    assert (q.data == 0).all() and (q.block_scale.float() == 0).all()
    assert (nvfp4.dequantize_reference(q) == 0).all()


def test_zero_block_beside_nonzero_blocks_is_stored_as_zero():
    x = torch.randn(1, 48)
    x[0, 16:32] = 0
    x[0, 32:48] = 1e-12  # far below the tensor's largest value: its scale rounds to 0
    q = nvfp4.quantize_reference(x)
    assert q.block_scale.float()[0, 1] == 0 and q.block_scale.float()[0, 2] == 0
    out = nvfp4.dequantize_reference(q, torch.float32)
    assert (out[0, 16:] == 0).all()


def test_negative_values_rounding_to_zero_are_stored_as_positive_zero():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = -0.1
    q = nvfp4.quantize_reference(x, 2.0 ** -8)
    assert nvfp4.unpack_codes(q.data)[0, 1] == 0


def test_subnormal_inputs_are_quantized_not_flushed():
    tiny = torch.finfo(torch.bfloat16).tiny  # smallest normal; everything below is subnormal
    x = (torch.rand(4, 32) * tiny * 0.99).to(torch.bfloat16)
    assert (x.float().abs() < tiny).all()
    out = nvfp4.dequantize_reference(nvfp4.quantize_reference(x), torch.float32)
    assert out.abs().sum() > 0
    rel = (out.double() - x.double()).norm() / x.double().norm()  # float64: squares underflow in fp32
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
    is 1 unit of the block's divisor, and saturation of a block maximum that the E4M3 rounding pushed
    past 6 costs at most 6 / 16 units (E4M3 has 3 mantissa bits: relative rounding <= 2^-4). With
    block_scale * global_scale <= (block_amax / 6) * (1 + 2^-4), the bound is about 18% of the block
    amax. For normal data the relative RMS error is measured at about 9.4%; we also require < 11%."""
    torch.manual_seed(0)
    x = torch.randn(256, 1024)
    q = nvfp4.quantize_reference(x)
    out = nvfp4.dequantize_reference(q, torch.float32)
    divisor = (q.block_scale.float() * q.global_scale).repeat_interleave(16, dim=-1)
    assert ((out - x).abs() <= divisor).all()
    block_amax = x.abs().reshape(256, 64, 16).amax(-1).repeat_interleave(16, dim=-1)
    assert (divisor <= block_amax / 6 * (1 + 2 ** -4)).all()
    rel = ((out - x).norm() / x.norm()).item()
    print(f"relative RMS error on N(0,1): {rel:.4f}")
    assert rel < 0.11


# ------------------------------------------------------------------ kernel vs reference
SHAPES = [(1, 16), (3, 5, 48), (7, 1, 32), (2, 3, 4, 16), (33, 160)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_quantize_matches_reference_on_random_data(kernel_device, shape, dtype):
    torch.manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape) * 3).to(dtype)
    ref = nvfp4.quantize_reference(x)
    fast = nvfp4.quantize_triton(x.to(kernel_device))
    _assert_same_quantization(ref, fast)
    deq_ref = nvfp4.dequantize_reference(ref, dtype)
    assert _same_bits(nvfp4.dequantize_triton(fast, dtype), deq_ref)
    assert _same_bits(nvfp4.fake_quantize_triton(x.to(kernel_device)), deq_ref)


def _adversarial(dtype):
    torch.manual_seed(1)
    x = torch.randn(12, 64)
    x[0] *= 1e-3
    x[1, 5] = 1e4                                      # one outlier: most blocks become tiny or zero
    x[2, :16] = 0                                      # zero block
    x[3] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 8)  # grid ties
    x[4] = -x[3]
    x[5] = torch.finfo(torch.float32).tiny * torch.rand(64)  # subnormal-scale values
    x[6, 7] = float("nan")
    x[7, 40] = float("inf")
    x[8, 1] = float("-inf")
    x[9] = 447.9 * 6 * 0.01 * torch.sign(torch.randn(64))  # block scales near the E4M3 maximum
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("global_scale", [None, 0.01, 2.0 ** -8])
def test_triton_quantize_matches_reference_on_adversarial_data(kernel_device, dtype, global_scale):
    x = _adversarial(dtype)
    if global_scale is None:
        x = x[x.isfinite().all(dim=-1)]  # with a computed scale a single NaN makes everything NaN
    gs = None if global_scale is None else torch.tensor(global_scale)
    ref = nvfp4.quantize_reference(x, gs)
    fast = nvfp4.quantize_triton(x.to(kernel_device), None if gs is None else gs.to(kernel_device))
    _assert_same_quantization(ref, fast)
    assert _same_bits(nvfp4.dequantize_triton(fast, dtype), nvfp4.dequantize_reference(ref, dtype))


def test_triton_quantize_of_a_tensor_with_nan_gives_nan_everywhere(kernel_device):
    x = _adversarial(torch.float32).to(kernel_device)
    assert nvfp4.dequantize_triton(nvfp4.quantize_triton(x), torch.float32).isnan().all()


@pytest.mark.cuda
def test_quantize_on_cuda_uses_the_kernel_and_matches_reference_at_scale():
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x[:, 17] *= 50  # an outlier channel
    q = nvfp4.quantize(x)
    _assert_same_quantization(nvfp4.quantize_reference(x.cpu()), q)
    assert _same_bits(nvfp4.dequantize(q), nvfp4.dequantize_reference(nvfp4.quantize_reference(x.cpu())))
    assert _same_bits(nvfp4.fake_quantize(x), nvfp4.dequantize(q))


# ------------------------------------------------------------------ fake quantize and its gradient
def test_fake_quantize_equals_dequantize_of_quantize():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(nvfp4.fake_quantize(x), nvfp4.dequantize(nvfp4.quantize(x), torch.bfloat16))
    report_diff(nvfp4.fake_quantize(x), x, "fake_quantize vs x")


def test_gradient_of_fake_quantize_is_the_identity():
    x = torch.randn(3, 32, requires_grad=True)
    upstream = torch.randn(3, 32)
    (nvfp4.fake_quantize(x) * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)


def test_shared_global_scale_is_used_as_given():
    a, b = torch.randn(8, 32), torch.randn(4, 32) * 10
    shared = nvfp4.compute_global_scale(torch.cat([a, b]))
    qa = nvfp4.quantize(a, shared)
    assert qa.global_scale.item() == shared.item()


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad, message", [
    (torch.randn(4, 20), "multiple of the block size 16"),
    (torch.ones(4, 16, dtype=torch.int32), "dtype torch.int32"),
    (torch.empty(0, 16), "non-empty"),
    (torch.tensor(1.0), "non-empty"),
    ([1.0] * 16, "torch.Tensor"),
])
def test_bad_input_raises_a_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        nvfp4.quantize(bad)
    with pytest.raises(ValueError, match=message.split(" ")[0]):
        nvfp4.fake_quantize(bad)


def test_mixed_devices_raise_a_clear_value_error():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="global_scale is on meta"):
        nvfp4.quantize(x, torch.tensor(1.0, device="meta"))
    q = nvfp4.quantize(x)
    q.block_scale = q.block_scale.to("meta")
    with pytest.raises(ValueError, match="one device"):
        nvfp4.dequantize(q)
    with pytest.raises(ValueError, match="scalar"):
        nvfp4.quantize(x, torch.ones(2))
    assert math.isfinite(nvfp4.quantize(x).global_scale.item())


# ------------------------------------------------------------------ per-matrix global scales (experts)
def test_per_matrix_global_scale_equals_quantizing_each_matrix_alone(kernel_device):
    torch.manual_seed(3)
    w = torch.randn(5, 8, 32) * torch.tensor([0.01, 1.0, 30.0, 0.5, 2.0]).view(5, 1, 1)
    gs = nvfp4.compute_global_scale(w, per_matrix=True)
    assert gs.shape == (5,)
    stacked = nvfp4.quantize_reference(w, gs)
    for e in range(5):
        alone = nvfp4.quantize_reference(w[e])
        assert torch.equal(stacked.data[e], alone.data)
        assert torch.equal(_bits(stacked.block_scale[e]), _bits(alone.block_scale))
        assert stacked.global_scale[e] == alone.global_scale
    fast = nvfp4.quantize_triton(w.to(kernel_device), gs.to(kernel_device))
    _assert_same_quantization(stacked, fast)
    deq = nvfp4.dequantize_reference(stacked, torch.float32)
    assert _same_bits(nvfp4.dequantize_triton(fast, torch.float32), deq)
    assert _same_bits(nvfp4.fake_quantize_triton(w.to(kernel_device), gs.to(kernel_device)), deq)


def test_global_scale_of_the_wrong_shape_is_rejected():
    w = torch.randn(4, 8, 32)
    with pytest.raises(ValueError, match="one per matrix"):
        nvfp4.quantize(w, torch.ones(8))
    with pytest.raises(ValueError, match="stack of matrices"):
        nvfp4.compute_global_scale(torch.randn(8, 32), per_matrix=True)


def test_weight_rule_is_shared_by_fake_and_real_quantization():
    for w in (torch.randn(24, 64, dtype=torch.bfloat16), torch.randn(3, 16, 32, dtype=torch.bfloat16)):
        q = nvfp4.quantize_weight(w)
        assert q.global_scale.shape == w.shape[:-2]
        assert _same_bits(nvfp4.fake_quantize_weight(w), nvfp4.dequantize(q, w.dtype))

