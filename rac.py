"""The rollout side: W4A4 NVFP4 GEMMs, residual activation compensation (RAC), the FP8 baseline, and
the conversion of a moe.py model into its rollout twin.

A rollout layer computes y = x @ W.T (W is (N, K), both operands blocked by 16 along K, G = K/16):

    W_q = quantize_weight(W)              nvfp4.py's one weight rule: the same codes qat.py trains with
    x_q = Q(x)                            NVFP4, one dynamic global scale per call (below)
    r   = x - DQ(x_q)                     the activation's quantization residual
    r_q = Q(S * r)                        S keeps whole 16-channel blocks: the round(rac_ratio * G)
                                          blocks with the largest mean |r| (calibrated), zero elsewhere
    y   = DQ(x_q) @ DQ(W_q).T + DQ(r_q) @ DQ(W_q).T  =  (DQ(x_q) + DQ(r_q)) @ DQ(W_q).T

Compensating whole blocks keeps the weight's codes and block scales valid for the residual term, so
the kernel applies both activation terms to the weight tile it already holds: RAC never re-reads
the weights. rac_ratio = 0 is naive NVFP4; 1 compensates every block (QUADS uses about 0.5).

Activation global scale: dynamic, per tensor, amax(|x|) / (6 * 448) of each call's input. A static
scale calibrated per layer (ModelOpt's / vLLM's `input_scale`) saves the amax pass, but in RL the
weights change every step, so a calibrated scale goes stale between syncs, and any activation above
it saturates at +-6 * 448 * scale: exactly the outlier channels that hurt NVFP4 most. The amax costs
nothing extra at decode (the fused quantizer reduces small inputs itself, in the same launch) and one
small extra launch on larger ones. The price is that a token's rounding depends on the largest value
in its batch; `quantize_activation(x, global_scale=...)` accepts a static scale for callers that
prefer batch invariance.

The residual is quantized with the same global scale as x: a residual block is about 6-16x smaller
than its x block, so its block scale still sits well inside E4M3's range, and the two terms share one
epilogue scale and can be summed before a single dot.

Portable kernel (Hopper, and the CPU under TRITON_INTERPRET=1). Hopper has no FP4 tensor cores and
`tl.dot_scaled` does not compile for sm_90, so the weight is decoded in registers. An E2M1 code c
placed in an E4M3 byte, (c & 7) << 2 | (c & 8) << 4, *is* c's value times 2^-6 (the 2 exponent bits
and the mantissa bit land in E4M3's low exponent bits and top mantissa bit; code 1 becomes E4M3's
subnormal 2^-7). The hardware fp8 -> fp16 conversion and one fp16 multiply by the block scale then
give value * block_scale * 2^-6 *exactly* (<= 6 significant bits, magnitude in [2^-16, 42]), and a
fp16 tl.dot accumulates in fp32; the two global scales and 2^12 are applied in the epilogue. fp16,
not bf16, because it keeps the sum DQ(x_q) + DQ(r_q) to 11 bits (bf16's 8 would round away a good
part of what the residual adds back).
  - K is consumed in an even/odd order: a weight byte holds elements 2i (low nibble) and 2i+1 (high
    nibble), so each K step is two dots, W_even @ X_even.T + W_odd @ X_odd.T: no interleaving shuffles.
    On the GPU the nibble-to-E4M3 arithmetic runs as inline PTX on 32-bit words (4 bytes at once)
    and cvt.rn.f16x2.e4m3x2 converts two codes per instruction.
  - The activation's fp16 operand (the exact values DQ(x_q) + DQ(r_q), without the global scale,
    times 2^-6, stored as an even and an odd plane (2, M, K/2)) is written once per layer by the fused
    quantizer, which holds the codes in registers anyway. Every GEMM program then loads it straight
    into shared memory as the MMA's B operand instead of decoding the activation again per N tile; at
    decode it is a few KB, and RAC costs the GEMM nothing (its residual is already summed in).
  - The GEMM is computed as y.T = W @ X.T ("swap AB"): the decoded weight tile is the MMA's A operand,
    fed from registers, and the weight rows fill the MMA's wide M side, so a decode step with one
    token does not waste a 64-row tile. Autotuned over a few configurations per M bucket (decode:
    small BLOCK_M, wide BLOCK_K; prefill: 128-wide tiles). Split-K is implemented (a decode tile has
    little work per K step, so several short programs per SM would hide each one's load -> decode ->
    MMA latency; the last split to finish a tile adds the partials in a fixed order, deterministic) but
    left out of the GPU configurations until it has passed the CUDA tests on a GPU (see _DENSE_CONFIGS).
  - Prefill (M >= 1024 rows): decoding in registers would repeat M / BLOCK_M times per weight element,
    so instead one pass turns the weight into fp16 planes (exactly the same values) and the same kernel
    streams both operands into shared memory. Same numerics, one decode per call.
  - Experts: one grouped launch over all (expert, row tile, N tile) triples. Rows are sorted by
    expert once (moe.route_tokens); each program finds its expert from the per-expert counts on the
    device (a prefix sum over E, no host sync), so experts with no tokens cost nothing. The gate/up
    GEMM gathers token rows itself and computes the gate and the up rows of its tile in one K loop,
    applying SwiGLU in its epilogue; the down GEMM multiplies each row by its router weight there.
Blackwell (sm_100+): `tl.dot_scaled(..., "e2m1", ...)` with E4M3 block scales reads the packed codes
directly. It is chosen in one place (`_gemm_backend`), checked against the portable kernel on its
first use and dropped with a one-line warning if they disagree. UNTESTED: it can neither run on the
H200 nor be checked under the interpreter (which reads E4M3 scales as E8M0).

FP8 baseline (W8A8): per-output-channel weight scales amax/448, per-token activation scales, through
torch._scaled_mm (and torch._scaled_grouped_mm for experts) on GPUs that have them; elsewhere the
same numerics as dequantize-then-matmul in fp32.

Conversion: `convert_for_rollout(model, mode)` swaps every moe.Attention projection and every
moe.Experts for a rollout module (isinstance dispatch); the router, embeddings, norms and LM head
stay in full precision unless asked (`quantize_router`, `quantize_lm_head`). `sync_weights` reloads
them from the trainer's master weights (a qat.py model keeps the same parameter names), and
`calibrate_rac` picks the compensated blocks from the activations each layer actually sees.
Every rollout layer has a plain PyTorch twin (dequantize, matmul), used on the CPU and in tests.

Shape letters: M rows (tokens or token-expert assignments), K reduction dim, N output features,
G = K / 16 blocks, T tokens, A active experts per token, R = T * A assignments, E experts,
D model dim, I expert hidden dim.

Deliberately left out: fused q/k/v or gate/up GEMMs with separate global scales (each projection
keeps the scale qat.py uses), per-expert RAC block selection (one selection per layer input, shared
by all experts), split-K, CUDA graphs, FP4 KV caches, and a Blackwell path for the grouped kernel.
"""
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe
import nvfp4
from nvfp4 import BLOCK_SIZE, NVFP4Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch on Linux; without it the torch twins run
    triton = None

MODES = ("bf16", "fp8", "nvfp4")
FP8_MAX = 448.0
OPERAND_SHIFT = 2.0 ** -6          # the portable kernel's fp16 operands hold value * block_scale * 2^-6
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ============================================================================ checks
def _check_ratio(rac_ratio):
    if not isinstance(rac_ratio, (int, float)) or not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio must be a number in [0, 1], got {rac_ratio!r}")


def _check_matrix(x, name):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (M, K), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected bfloat16/float16/float32 activations, got dtype {x.dtype}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: K={x.shape[-1]} is not a multiple of the NVFP4 block size {BLOCK_SIZE}")


def _check_rac_mask(rac_mask, x):
    if rac_mask is None:
        return
    n_blocks = x.shape[-1] // BLOCK_SIZE
    if rac_mask.dtype != torch.bool or tuple(rac_mask.shape) != (n_blocks,):
        raise ValueError(f"rac_mask must be a bool tensor of shape (G,) = ({n_blocks},), "
                         f"got {rac_mask.dtype} {tuple(rac_mask.shape)}")
    if rac_mask.device != x.device:
        raise ValueError(f"rac_mask is on {rac_mask.device} but the activation is on {x.device}")


def _check_operands(x_q, w_q, residual, name, stacked=False):
    for label, q in (("x_q", x_q), ("w_q", w_q), ("residual", residual)):
        if q is not None and not isinstance(q, NVFP4Tensor):
            raise ValueError(f"{name}: {label} must be an NVFP4Tensor, got {type(q).__name__}")
    if len(x_q.shape) != 2 or len(w_q.shape) != (3 if stacked else 2):
        raise ValueError(f"{name}: expected x_q (M, K) and w_q {'(E, N, K)' if stacked else '(N, K)'}, "
                         f"got {x_q.shape} and {w_q.shape}")
    if x_q.shape[-1] != w_q.shape[-1]:
        raise ValueError(f"{name}: K differs: x_q {x_q.shape} vs w_q {w_q.shape}")
    if x_q.device != w_q.device:
        raise ValueError(f"{name}: x_q is on {x_q.device} but w_q is on {w_q.device}")
    if x_q.global_scale.numel() != 1:
        raise ValueError(f"{name}: the activation needs one (per-tensor) global scale")
    if residual is not None:
        if residual.shape != x_q.shape or residual.device != x_q.device:
            raise ValueError(f"{name}: residual {residual.shape} on {residual.device} does not match x_q "
                             f"{x_q.shape} on {x_q.device}")
        if not torch.equal(residual.global_scale.reshape(()), x_q.global_scale.reshape(())):
            raise ValueError(f"{name}: the residual must share x_q's global scale")


def _out_dtype_ok(out_dtype):
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16/float16/float32, got {out_dtype}")


# ============================================================================ slow twins (plain PyTorch)
def quantize_activation_reference(x, rac_mask=None, global_scale=None):
    """x (M, K) -> (x_q, residual): NVFP4 codes of x, and of the residual x - DQ(x_q) on the blocks
    where rac_mask (G,) is True (zero blocks elsewhere), both with x's global scale; residual is None
    without a mask."""
    _check_matrix(x, "quantize_activation")
    _check_rac_mask(rac_mask, x)
    if global_scale is None:
        global_scale = nvfp4.compute_global_scale(x)
    x_q = nvfp4.quantize_reference(x, global_scale)
    if rac_mask is None:
        return x_q, None
    M, K = x.shape
    residual = x.float() - nvfp4.dequantize_reference(x_q, torch.float32)              # (M, K), exact
    residual = torch.where(rac_mask[None, :, None], residual.view(M, -1, BLOCK_SIZE), 0.0).view(M, K)
    return x_q, nvfp4.quantize_reference(residual, x_q.global_scale)


def _values_without_global_scale(q):
    """code_value * block_scale in fp32 (exact), (..., K)."""
    values = nvfp4.decode_e2m1(nvfp4.unpack_codes(q.data))                             # (..., K)
    values = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE) * q.block_scale.float().unsqueeze(-1)
    return values.reshape(q.shape)


def _empty_planes(rows, half_k, device):
    """An fp16 operand buffer (2, rows, K/2): the even plane, then the odd plane. The planes sit a
    multiple of 64 elements apart, so the kernels' odd-plane loads are provably 16-byte aligned (wide,
    pipelined) whatever the row count."""
    plane = triton.cdiv(rows * half_k, 64) * 64 if triton is not None else rows * half_k
    return torch.empty((2, plane), dtype=torch.float16, device=device)[:, :rows * half_k].view(2, rows, half_k)


def _planes(values):
    """(M, K) -> (2, M, K/2): even columns, then odd columns (the order a packed byte holds them)."""
    planes = _empty_planes(values.shape[0], values.shape[1] // 2, values.device)
    planes[0], planes[1] = values[:, 0::2], values[:, 1::2]
    return planes


def activation_operand(x_q, residual=None):
    """The portable GEMM's activation operand: (DQ(x_q) + DQ(residual)) / global_scale * 2^-6 in fp16,
    as two planes (2, M, K/2): the even elements (columns 0, 2, 4, ...) and the odd ones.

    Each term is exact in fp32 and so is their sum; the fp16 rounding of the sum (11 bits, only with
    a residual) is the one step the kernel adds to the mathematical definition below.
    """
    values = _values_without_global_scale(x_q)
    if residual is not None:
        values = values + _values_without_global_scale(residual)
    return _planes((values * OPERAND_SHIFT).to(torch.float16))


def weight_operand_reference(w_q):
    """Twin of the prefill path's weight pass: DQ(w_q) / global_scale * 2^-6 as fp16 planes (2, N, K/2), exact."""
    return _planes((_values_without_global_scale(w_q) * OPERAND_SHIFT).to(torch.float16))


def w4a4_matmul_reference(x_q, w_q, residual=None, out_dtype=torch.bfloat16):
    """Slow twin of w4a4_matmul: (DQ(x_q) + DQ(residual)) @ DQ(w_q).T in fp32, cast to out_dtype."""
    _check_operands(x_q, w_q, residual, "w4a4_matmul")
    x = nvfp4.dequantize_reference(x_q, torch.float32)
    if residual is not None:
        x = x + nvfp4.dequantize_reference(residual, torch.float32)
    return (x @ nvfp4.dequantize_reference(w_q, torch.float32).T).to(out_dtype)


def _check_counts(counts, n_rows, n_experts, device):
    if counts.dim() != 1 or counts.numel() != n_experts or counts.device != device:
        raise ValueError(f"counts must be (E,) = ({n_experts},) on {device}, "
                         f"got {tuple(counts.shape)} on {counts.device}")
    if int(counts.sum()) != n_rows:  # one host sync; grouped calls from the layers skip this check
        raise ValueError(f"counts sum to {int(counts.sum())} but there are {n_rows} rows")


def w4a4_grouped_matmul_reference(x_q, w_q, counts, residual=None, row_ids=None, row_weights=None,
                                  swiglu=False, out_dtype=torch.bfloat16):
    """Slow twin of w4a4_grouped_matmul: a loop over experts of dequantize-then-matmul in fp32."""
    _check_operands(x_q, w_q, residual, "w4a4_grouped_matmul", stacked=True)
    x = nvfp4.dequantize_reference(x_q, torch.float32)
    if residual is not None:
        x = x + nvfp4.dequantize_reference(residual, torch.float32)
    if row_ids is not None:
        x = x[row_ids]                                                                 # (R, K)
    _check_counts(counts, x.shape[0], w_q.shape[0], x.device)
    w = nvfp4.dequantize_reference(w_q, torch.float32)                                 # (E, N, K)
    outputs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        y = x[start:start + n] @ w[e].T                                                # (n, N)
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up                                                      # (n, N/2)
        outputs.append(y)
        start += n
    y = torch.cat(outputs)
    if row_weights is not None:
        y = y * row_weights.float()[:, None]
    return y.to(out_dtype)


# ============================================================================ Triton kernels
# One quantizer kernel and three GEMM kernels:
#   _quantize_activation_kernel   BF16 x -> NVFP4 codes (+ RAC residual codes) and/or the fp16 operand
#   _w4a4_kernel                  dense y = x @ W.T, portable (fp16 tl.dot on decoded weights)
#   _w4a4_grouped_kernel          the experts' grouped version (gather, SwiGLU, router weights)
#   _w4a4_native_kernel           dense, Blackwell tl.dot_scaled (untested, guarded)
if triton is not None:
    from nvfp4 import _e2m1_value, _load_pairs, _quantize_pairs, _to_bf16_bits

    # ------------------------------------------------------------------ quantizer
    # A program quantizes BLOCKS consecutive 16-element blocks of the flattened (M*G, 16) input, held
    # as two (BLOCKS, 8) tiles of even and odd elements (nvfp4.py's pair layout: a BF16 pair is one
    # 32-bit load, and a packed byte is code(even) | code(odd) << 4). The arithmetic is nvfp4.py's own
    # (_quantize_pairs), so codes, block scales and the residual match the torch twin bit for bit.
    @triton.jit
    def _store_codes(data_ptr, scale_ptr, rows, pairs, code_even, code_odd, scale_byte, mask, in_range):
        tl.store(data_ptr + rows[:, None] * 8 + pairs[None, :], (code_even | (code_odd << 4)).to(tl.uint8), mask=mask)
        tl.store(scale_ptr + rows, scale_byte.to(tl.uint8), mask=in_range)

    @triton.jit
    def _quantize_activation_kernel(
        # pointers
        x_ptr, rac_mask_ptr, scale_in_ptr, global_scale_ptr,
        data_ptr, block_scale_ptr, res_data_ptr, res_block_scale_ptr, operand_ptr,
        # sizes (plane_size = M * K / 2: the operand's even plane, then its odd plane)
        n_blocks, blocks_per_row, n_partials, plane_size,
        # meta-parameters
        SCALE_FROM: tl.constexpr,      # 0: given global scale, 1: partial amaxes to reduce, 2: amax of x here
        AMAX_BLOCKS: tl.constexpr,     # SCALE_FROM 2: power of two >= n_blocks; SCALE_FROM 1: >= n_partials
        X_BF16: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_CODES: tl.constexpr,
        WRITE_OPERAND: tl.constexpr, BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pairs = tl.arange(0, 8)
        if SCALE_FROM == 0:
            global_scale = tl.load(scale_in_ptr)
        else:
            if SCALE_FROM == 1:
                idx = tl.arange(0, AMAX_BLOCKS)
                amax = tl.max(tl.load(scale_in_ptr + idx, mask=idx < n_partials, other=0.0), axis=0)
            else:  # a small input: every program reads all of it (L2-resident) and reduces it itself
                all_blocks = tl.arange(0, AMAX_BLOCKS)
                even, odd = _load_pairs(x_ptr, all_blocks, pairs, (all_blocks < n_blocks)[:, None], X_BF16)
                even, odd = tl.abs(even), tl.abs(odd)
                even = tl.where(even == even, even, float("inf"))                       # NaN counts as Inf
                odd = tl.where(odd == odd, odd, float("inf"))
                amax = tl.maximum(tl.max(tl.max(even, axis=1), axis=0), tl.max(tl.max(odd, axis=1), axis=0))
            # nvfp4.compute_global_scale: amax / 2688, 1.0 for an all-zero input, NaN if not finite
            global_scale = tl.math.div_rn(amax, 2688.0)
            global_scale = tl.where(amax == 0, 1.0, global_scale)
            global_scale = tl.where(amax < float("inf"), global_scale, float("nan"))
            tl.store(global_scale_ptr, global_scale, mask=pid == 0)

        rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)                        # block indices
        in_range = rows < n_blocks
        mask = in_range[:, None]
        even, odd = _load_pairs(x_ptr, rows, pairs, mask, X_BF16)                       # (BLOCKS, 8) each
        code_even, code_odd, block_scale, scale_byte = _quantize_pairs(even, odd, global_scale)
        value_even = _e2m1_value(code_even) * block_scale[:, None]                      # DQ / global scale
        value_odd = _e2m1_value(code_odd) * block_scale[:, None]
        if WRITE_CODES:
            _store_codes(data_ptr, block_scale_ptr, rows, pairs, code_even, code_odd, scale_byte, mask, in_range)
        if HAS_RESIDUAL:
            selected = tl.load(rac_mask_ptr + rows % blocks_per_row, mask=in_range, other=0) != 0
            keep = selected[:, None]
            res_even = tl.where(keep, even - value_even * global_scale, 0.0)            # x - DQ(x_q), exact
            res_odd = tl.where(keep, odd - value_odd * global_scale, 0.0)
            r_even, r_odd, r_scale, r_byte = _quantize_pairs(res_even, res_odd, global_scale)
            value_even += _e2m1_value(r_even) * r_scale[:, None]                        # exact in fp32
            value_odd += _e2m1_value(r_odd) * r_scale[:, None]
            if WRITE_CODES:
                _store_codes(res_data_ptr, res_block_scale_ptr, rows, pairs, r_even, r_odd, r_byte, mask, in_range)
        if WRITE_OPERAND:  # fp16 planes: 16 contiguous bytes per block in each
            offs = rows[:, None] * 8 + pairs[None, :]
            tl.store(operand_ptr + offs, (value_even * 0.015625).to(tl.float16), mask=mask)
            tl.store(operand_ptr + plane_size + offs, (value_odd * 0.015625).to(tl.float16), mask=mask)

    @triton.jit
    def _partial_amax_kernel(x_ptr, partial_ptr, numel, BLOCK: tl.constexpr):
        """One max(|x|) per program (no atomics, nothing to zero first); NaN counts as +Inf."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.abs(tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32))
        x = tl.where(x == x, x, float("inf"))
        tl.store(partial_ptr + tl.program_id(0), tl.max(x, axis=0))

    # ------------------------------------------------------------------ GEMM building blocks
    @triton.jit
    def _e4m3_to_fp16(byte, GPU: tl.constexpr):
        """E4M3 bytes (uint8) -> fp16, exact. The GPU decodes 0x7F as NaN; the interpreter as 480."""
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        if not GPU:
            value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)
        return value

    @triton.jit
    def _e2m1_pairs_to_fp16(packed, GPU: tl.constexpr):
        """Packed bytes -> (even, odd) fp16 tensors of the same shape: the low and the high nibble's
        E2M1 value times 2^-6, via the code's E4M3 byte ((c & 7) << 2 | (c & 8) << 4).

        On the GPU the byte arithmetic runs on 32-bit words of 4 bytes at once (inline PTX, 4 codes
        per instruction) and cvt.rn.f16x2.e4m3x2 converts two bytes per instruction: about 2
        instructions per weight element instead of ~9 for the same arithmetic on single bytes.
        The function is elementwise (output j depends on byte j only), so however Triton groups the
        4 bytes of a call, the result is the same; the interpreter runs the plain Triton version.
        """
        if GPU:
            even, odd = tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 lo, hi, t;
                .reg .b16 l0, l1, h0, h1;
                and.b32 t, $4, 0x08080808;
                shl.b32 t, t, 4;
                and.b32 lo, $4, 0x07070707;
                shl.b32 lo, lo, 2;
                or.b32 lo, lo, t;
                shr.b32 hi, $4, 2;
                and.b32 hi, hi, 0x1C1C1C1C;
                and.b32 t, $4, 0x80808080;
                or.b32 hi, hi, t;
                mov.b32 {l0, l1}, lo;
                mov.b32 {h0, h1}, hi;
                cvt.rn.f16x2.e4m3x2 $0, l0;
                cvt.rn.f16x2.e4m3x2 $1, l1;
                cvt.rn.f16x2.e4m3x2 $2, h0;
                cvt.rn.f16x2.e4m3x2 $3, h1;
                }
                """,
                constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            even = (((packed & 7) << 2) | ((packed & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            odd = (((packed >> 2) & 0x1C) | (packed & 0x80)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return even, odd

    @triton.jit
    def _weight_pairs(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data, stride_scale,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GPU: tl.constexpr):
        """Columns k0..k0+BLOCK_K of an NVFP4 matrix as two (ROWS, BLOCK_K/2) fp16 tiles, the even and
        the odd elements, each holding value * block_scale * 2^-6 exactly (see the module docstring)."""
        GB: tl.constexpr = BLOCK_K // 16
        blocks = k0 // 16 + tl.arange(0, GB)                                           # (GB,)
        byte_cols = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]                     # (GB, 8)
        data_ptrs = data_ptr + rows[:, None, None] * stride_data + byte_cols[None, :, :]
        scale_ptrs = scale_ptr + rows[:, None] * stride_scale + blocks[None, :]
        if EVEN_K:  # masks constant along K: wide loads, and the pipeliner can prefetch them
            packed = tl.load(data_ptrs, mask=row_mask[:, None, None], other=0)          # (ROWS, GB, 8)
            scale_byte = tl.load(scale_ptrs, mask=row_mask[:, None], other=0)          # (ROWS, GB)
        else:
            block_ok = blocks < K // 16
            packed = tl.load(data_ptrs, mask=row_mask[:, None, None] & block_ok[None, :, None], other=0)
            scale_byte = tl.load(scale_ptrs, mask=row_mask[:, None] & block_ok[None, :], other=0)
        block_scale = _e4m3_to_fp16(scale_byte, GPU)[:, :, None]
        even, odd = _e2m1_pairs_to_fp16(packed, GPU)
        even, odd = even * block_scale, odd * block_scale                              # exact in fp16
        return tl.reshape(even, (ROWS, BLOCK_K // 2)), tl.reshape(odd, (ROWS, BLOCK_K // 2))

    @triton.jit
    def _operand_pairs(x_ptr, rows, row_mask, k0, K, stride_row, plane_size, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr):
        """Columns k0..k0+BLOCK_K of an fp16 operand stored as planes (2, rows, K/2) as two
        (rows, BLOCK_K/2) tiles, the even and the odd elements: plain fp16 loads, straight to the MMA."""
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K // 2)[None, :]
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
        return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + plane_size, mask=mask, other=0.0)

    @triton.jit
    def _w4a4_mainloop(x_ptr, rows, row_mask, stride_x, x_plane, w_ptr, w_scale_ptr, cols, col_mask, stride_w,
                       stride_ws, w_plane, K, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GPU: tl.constexpr, W_FP16: tl.constexpr):
        """acc (BLOCK_N, BLOCK_M) = W[cols] @ X[rows].T over columns k_begin..k_end, in fp32, without the
        global scales and 2^12. W_FP16: the weight is already an fp16 operand in planes (the prefill
        path), not NVFP4 codes."""
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if W_FP16:
                w_even, w_odd = _operand_pairs(w_ptr, cols, col_mask, k0, K, stride_w, w_plane, BLOCK_K, EVEN_K)
            else:
                w_even, w_odd = _weight_pairs(w_ptr, w_scale_ptr, cols, col_mask, k0, K, stride_w, stride_ws,
                                              BLOCK_N, BLOCK_K, EVEN_K, GPU)
            x_even, x_odd = _operand_pairs(x_ptr, rows, row_mask, k0, K, stride_x, x_plane, BLOCK_K, EVEN_K)
            acc = tl.dot(w_even, tl.trans(x_even), acc)
            acc = tl.dot(w_odd, tl.trans(x_odd), acc)
        return acc

    @triton.jit
    def _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, value, OUT_BF16: tl.constexpr):
        """Store a (cols, rows) tile of fp32 values into y (M, N). BF16 rounds to nearest-even by
        integer arithmetic through an int16 view of y (the interpreter's own cast truncates)."""
        offs = rows[None, :].to(tl.int64) * stride_y + cols[:, None]
        mask = row_mask[None, :] & col_mask[:, None]
        if OUT_BF16:
            tl.store(y_ptr + offs, _to_bf16_bits(value).to(tl.int16), mask=mask)
        else:
            tl.store(y_ptr + offs, value.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weight_operand_kernel(data_ptr, scale_ptr, out_ptr, N, K, stride_data, stride_scale, plane_size,
                               GPU: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """The prefill path's one pass over the weight: NVFP4 (N, K) -> fp16 operand planes (2, N, K/2)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        k0 = tl.program_id(1) * BLOCK_K
        row_mask = rows < N
        even, odd = _weight_pairs(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data, stride_scale,
                                  ROWS, BLOCK_K, False, GPU)
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs = rows[:, None].to(tl.int64) * (K // 2) + cols[None, :]
        mask = row_mask[:, None] & (cols < K // 2)[None, :]
        tl.store(out_ptr + offs, even, mask=mask)
        tl.store(out_ptr + plane_size + offs, odd, mask=mask)

    # ------------------------------------------------------------------ autotuning
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per M bucket. Decode buckets stream the weight: a
    # small BLOCK_M, a wide BLOCK_K (long contiguous byte runs per row), and BLOCK_N small enough for
    # N / BLOCK_N programs to cover the 132 SMs. Under the interpreter a single small config.
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K); the grouped kernel does not split K.
    # Split-K (SPLIT_K > 1) is written and tested under the interpreter, which runs programs one at a
    # time and so cannot exercise its cross-program counter; it has not yet run on a GPU. Until a GPU
    # run of `pytest -m cuda tests/test_rac.py` passes with them, the GPU lists hold SPLIT_K = 1 only;
    # the candidates to add back are (16, 32, 256, 4, 3, 4), (16, 64, 256, 4, 3, 4), (16, 32, 128, 4, 3, 8)
    # for M <= 16 and (32, 64, 256, 4, 3, 4), (32, 32, 128, 4, 3, 8) for M <= 64.
    # NVFP4RL_SPLIT_K=1 adds them, to run those tests and bench.py gemm with them.
    _SPLIT_K_ON_GPU = os.environ.get("NVFP4RL_SPLIT_K", "0") == "1"
    _DENSE_CONFIGS = {
        16: [(16, 32, 256, 4, 4, 1), (16, 64, 256, 4, 3, 1), (16, 32, 128, 4, 3, 1)]
        + ([(16, 32, 256, 4, 3, 4), (16, 64, 256, 4, 3, 4), (16, 32, 128, 4, 3, 8)] if _SPLIT_K_ON_GPU else []),
        64: [(32, 64, 256, 4, 3, 1), (32, 32, 128, 4, 3, 1)]
        + ([(32, 64, 256, 4, 3, 4), (32, 32, 128, 4, 3, 8)] if _SPLIT_K_ON_GPU else []),
        256: [(64, 128, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1)],
        4096: [(128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1)],
    }
    # Not (128, 128, 64, 8 warps, 3 stages): under Triton 3.6 on the H200 the grouped kernel compiled
    # with it gives non-deterministic results with occasional NaN rows in the down projection (no
    # SwiGLU, K = 256), 60 of 60 repeats differing at 26k tokens; the dense kernel with the same config
    # is exact. tests/test_rac.py runs every configuration of both kernels repeatedly on the GPU.
    _GROUPED_CONFIGS = {
        16: [(16, 64, 256, 4, 3, 1), (16, 32, 256, 4, 3, 1), (16, 64, 128, 4, 4, 1)],
        64: [(32, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
        256: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
        4096: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
    }

    def _m_bucket(m):
        return next(b for b in (16, 64, 256, 4096) if m <= b or b == 4096)

    # Under the interpreter one small config per bucket; the decode bucket splits K in two, so the
    # tests exercise both the split and the direct epilogue.
    _INTERPRETER_CONFIGS = {b: [(16, 32, 64, 4, 1, 2 if b == 16 else 1)] for b in (16, 64, 256, 4096)}

    def _configs(table):
        dense = table is _DENSE_CONFIGS
        if _INTERPRET:
            table = _INTERPRETER_CONFIGS
        configs = []
        for bucket, entries in table.items():
            for bm, bn, bk, warps, stages, split_k in entries:
                meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BUCKET": bucket}
                if dense:
                    meta["SPLIT_K"] = split_k
                configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
        return configs

    def _even_k(args):
        return args["K"] % args["BLOCK_K"] == 0

    def _prune(configs, named_args, **kwargs):
        """Keep the configs of the call's M bucket: autotuning times 2-3 candidates, not all of them."""
        return [c for c in configs if c.kwargs["BUCKET"] == named_args["M_BUCKET"]]

    # ------------------------------------------------------------------ dense GEMM (portable)
    @triton.autotune(configs=_configs(_DENSE_CONFIGS), key=["M_BUCKET", "N", "K", "W_FP16"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.heuristics({"EVEN_K": _even_k})
    @triton.jit(do_not_specialize=["M"])
    def _w4a4_kernel(
        # pointers (workspace and counters: split-K partial sums and per-tile arrival counts)
        x_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr, workspace_ptr, counter_ptr,
        # sizes (M_BUCKET is only the autotuning key; *_plane: elements in one operand plane)
        M, N, K, M_BUCKET, x_plane, w_plane,
        # strides (operand planes and y in elements, w in bytes, scales in blocks)
        stride_x, stride_w, stride_ws, stride_y,
        # meta-parameters
        OUT_BF16: tl.constexpr, GPU: tl.constexpr, W_FP16: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BUCKET: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        # N tiles vary fastest: the programs running together share the activation rows and stream
        # disjoint weight rows, which is what a weight-bound decode wants. Decode also splits K
        # (grid axis 1): a decode tile has little work per K step, and a few programs per SM hide the
        # latency of each one's decode -> MMA chain far better than one long program.
        pid, pid_k = tl.program_id(0), tl.program_id(1)
        n_tiles = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = pid // n_tiles, pid % n_tiles
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_mask, col_mask = rows < M, cols < N
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_begin = pid_k * k_per_split
        k_end = tl.minimum(K, k_begin + k_per_split)
        acc = _w4a4_mainloop(x_ptr, rows, row_mask, stride_x, x_plane, w_ptr, w_scale_ptr, cols, col_mask,
                             stride_w, stride_ws, w_plane, K, k_begin, k_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                             GPU, W_FP16)
        scale = 4096.0 * tl.load(x_global_ptr) * tl.load(w_global_ptr)                 # 2^12 undoes 2^-6 * 2^-6
        if SPLIT_K == 1:
            _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, acc * scale, OUT_BF16)
        else:
            # Each split stores its partial tile; the last to arrive (an acq_rel counter per tile) adds
            # the SPLIT_K partials in a fixed order (deterministic), resets the counter, and stores y.
            tile_elems: tl.constexpr = BLOCK_N * BLOCK_M
            offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            part_ptr = workspace_ptr + pid.to(tl.int64) * (SPLIT_K * tile_elems) + offs
            tl.store(part_ptr + pid_k * tile_elems, acc)
            tl.debug_barrier()                                                          # all partial stores issued
            arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
            tl.debug_barrier()
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for split in range(SPLIT_K):
                    total += tl.load(part_ptr + split * tile_elems, cache_modifier=".cg")
                tl.atomic_xchg(counter_ptr + pid, 0)                                    # ready for the next call
                _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, total * scale, OUT_BF16)

    # ------------------------------------------------------------------ grouped GEMM (experts)
    @triton.autotune(configs=_configs(_GROUPED_CONFIGS), key=["M_BUCKET", "N", "K"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.heuristics({"EVEN_K": _even_k})
    @triton.jit(do_not_specialize=["n_rows"])
    def _w4a4_grouped_kernel(
        # pointers
        x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, w_ptr, w_scale_ptr, w_global_ptr,
        counts_ptr, y_ptr,
        # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
        n_rows, N, K, E, M_BUCKET, x_plane,
        # strides
        stride_x, stride_we, stride_w, stride_wse, stride_ws, stride_y,
        # meta-parameters
        GATHER: tl.constexpr, ROW_WEIGHTS: tl.constexpr, SWIGLU: tl.constexpr, OUT_BF16: tl.constexpr,
        GPU: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BUCKET: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        # Which (expert, row tile) is this program's? Expert e owns cdiv(counts[e], BLOCK_M) tiles,
        # laid end to end; a prefix sum over the E counts answers it on the device. The grid is an
        # upper bound on the tile count, so surplus programs (and empty experts) exit at once.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        experts = tl.arange(0, E_POW2)
        counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int32)   # (E_POW2,)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, axis=0)
        if pid_m >= tl.sum(tiles, axis=0):
            return
        expert = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
        mine = experts == expert
        first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)
        first_row = tl.sum(tl.where(mine, tl.cumsum(counts, axis=0) - counts, 0), axis=0)
        end_row = first_row + tl.sum(tl.where(mine, counts, 0), axis=0)
        sorted_rows = first_row + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = sorted_rows < end_row
        if GATHER:  # the gate/up GEMM reads token rows straight from the (T, D) activation
            x_rows = tl.load(row_ids_ptr + sorted_rows, mask=row_mask, other=0)
        else:
            x_rows = sorted_rows
        n_out = N // 2 if SWIGLU else N
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_mask = cols < n_out
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        scale = 4096.0 * tl.load(x_global_ptr) * tl.load(w_global_ptr + expert)
        if SWIGLU:  # one stacked tile: the gate rows cols (of [0, I)), then the up rows I + cols
            stacked = tl.arange(0, 2 * BLOCK_N)
            w_rows = pid_n * BLOCK_N + stacked % BLOCK_N + (stacked // BLOCK_N) * n_out
            w_mask = pid_n * BLOCK_N + stacked % BLOCK_N < n_out
            acc = _w4a4_mainloop(x_ptr, x_rows, row_mask, stride_x, x_plane, w_base, ws_base, w_rows.to(tl.int64),
                                 w_mask, stride_w, stride_ws, 0, K, 0, K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, EVEN_K,
                                 GPU, False) * scale                                    # (2 BLOCK_N, BLOCK_M)
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
            out = gate / (1.0 + tl.exp(-gate)) * up                                     # silu(gate) * up
        else:
            out = _w4a4_mainloop(x_ptr, x_rows, row_mask, stride_x, x_plane, w_base, ws_base, cols, col_mask,
                                 stride_w, stride_ws, 0, K, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, GPU,
                                 False) * scale
        if ROW_WEIGHTS:
            out = out * tl.load(row_weights_ptr + sorted_rows, mask=row_mask, other=0.0)[None, :]
        _store_tile(y_ptr, sorted_rows, row_mask, cols, col_mask, stride_y, out, OUT_BF16)

    # ------------------------------------------------------------------ dense GEMM (Blackwell, untested)
    @triton.jit
    def _w4a4_native_kernel(
        x_ptr, x_scale_ptr, r_ptr, r_scale_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr,
        M, N, K, stride_x, stride_xs, stride_w, stride_ws, stride_y,
        HAS_RESIDUAL: tl.constexpr, OUT_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y = (x + r) @ W.T on FP4 tensor cores: packed codes and E4M3 scales go to tl.dot_scaled as they are."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            byte_idx = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            block_idx = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            byte_ok, block_ok = byte_idx < K // 2, block_idx < K // 16
            x_offs = rows[:, None] * stride_x + byte_idx[None, :]
            xs_offs = rows[:, None] * stride_xs + block_idx[None, :]
            x_mask, xs_mask = row_mask[:, None] & byte_ok[None, :], row_mask[:, None] & block_ok[None, :]
            w = tl.load(w_ptr + cols[:, None] * stride_w + byte_idx[None, :],
                        mask=col_mask[:, None] & byte_ok[None, :], other=0)
            ws = tl.load(w_scale_ptr + cols[:, None] * stride_ws + block_idx[None, :],
                         mask=col_mask[:, None] & block_ok[None, :], other=0.0)
            x = tl.load(x_ptr + x_offs, mask=x_mask, other=0)
            xs = tl.load(x_scale_ptr + xs_offs, mask=xs_mask, other=0.0)
            acc = tl.dot_scaled(x, xs, "e2m1", tl.trans(w), ws, "e2m1", acc)
            if HAS_RESIDUAL:  # the same weight tile, a second MMA: no re-read
                r = tl.load(r_ptr + x_offs, mask=x_mask, other=0)
                rs = tl.load(r_scale_ptr + xs_offs, mask=xs_mask, other=0.0)
                acc = tl.dot_scaled(r, rs, "e2m1", tl.trans(w), ws, "e2m1", acc)
        scale = tl.load(x_global_ptr) * tl.load(w_global_ptr)
        _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, tl.trans(acc * scale), OUT_BF16)


# ============================================================================ wrappers
def _require_triton():
    if triton is None:
        raise RuntimeError("the Triton kernels need the `triton` package; use the *_reference twins instead")


def _as_int16(y):
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y


_FUSED_AMAX_LIMIT = 8192      # inputs up to this many elements get their amax inside the quantizer
_QUANT_BLOCKS = 128           # 16-element blocks per quantizer program (2048 elements)


class Activation(NamedTuple):
    """An activation quantized for the W4A4 GEMMs (the fields a path does not need are None)."""
    x_q: NVFP4Tensor | None          # codes and block scales of x, with the global scale
    residual: NVFP4Tensor | None     # RAC residual codes (zero blocks where not compensated), same global scale
    operand: torch.Tensor | None     # (2, M, K/2) fp16 planes of (DQ(x_q) + DQ(residual)) / global_scale * 2^-6
    global_scale: torch.Tensor       # () fp32


def quantize_activation_triton(x, rac_mask=None, global_scale=None, codes=True, operand=False):
    """The fused quantizer: x (M, K) read once -> Activation with NVFP4 codes (codes=True), RAC residual
    codes (with a rac_mask), and/or the portable GEMM's fp16 operand (operand=True).

    global_scale None: dynamic, amax(|x|) / 2688, reduced inside this launch for small inputs and by one
    partial-max launch before it otherwise. A given global scale (static) is used as is.
    """
    _require_triton()
    _check_matrix(x, "quantize_activation")
    _check_rac_mask(rac_mask, x)
    x = nvfp4._contiguous_pairs(x)
    M, K = x.shape
    n_blocks, device = M * K // BLOCK_SIZE, x.device
    has_residual = rac_mask is not None
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    data = block_scale = res_data = res_block_scale = out_operand = None
    if codes:
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
        block_scale = torch.empty((M, K // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device)
        if has_residual:
            res_data, res_block_scale = torch.empty_like(data), torch.empty_like(block_scale)
    if operand:
        out_operand = _empty_planes(M, K // 2, device)
    n_partials, amax_blocks = 1, 1
    if global_scale is not None:
        global_scale = nvfp4._resolve_global_scale(x, global_scale).reshape(()).contiguous()
        scale_from, scale_in = 0, global_scale
    elif x.numel() <= _FUSED_AMAX_LIMIT:
        scale_from, scale_in = 2, dummy
        amax_blocks = triton.next_power_of_2(n_blocks)
        global_scale = torch.empty((), dtype=torch.float32, device=device)
    else:
        partial_block = max(8192, triton.next_power_of_2(triton.cdiv(x.numel(), 1024)))
        n_partials = triton.cdiv(x.numel(), partial_block)
        scale_in = torch.empty(n_partials, dtype=torch.float32, device=device)
        _partial_amax_kernel[(n_partials,)](x, scale_in, x.numel(), BLOCK=partial_block)
        scale_from, amax_blocks = 1, triton.next_power_of_2(n_partials)
        global_scale = torch.empty((), dtype=torch.float32, device=device)

    def ptr(t, view=None):
        return dummy if t is None else (t.view(view) if view is not None else t)

    grid = (triton.cdiv(n_blocks, _QUANT_BLOCKS),)
    _quantize_activation_kernel[grid](
        nvfp4._pair_view(x), ptr(rac_mask, torch.uint8), scale_in, global_scale,
        ptr(data), ptr(block_scale, torch.uint8), ptr(res_data), ptr(res_block_scale, torch.uint8),
        ptr(out_operand),
        n_blocks, K // BLOCK_SIZE, n_partials, out_operand.stride(0) if operand else 0,
        SCALE_FROM=scale_from, AMAX_BLOCKS=amax_blocks, X_BF16=x.dtype == torch.bfloat16,
        HAS_RESIDUAL=has_residual, WRITE_CODES=codes, WRITE_OPERAND=operand, BLOCKS=_QUANT_BLOCKS)
    x_q = NVFP4Tensor(data, block_scale, global_scale) if codes else None
    residual = NVFP4Tensor(res_data, res_block_scale, global_scale) if codes and has_residual else None
    return Activation(x_q, residual, out_operand, global_scale)


# From this many rows on, the weight is decoded once per call (one pass to fp16 planes, then both GEMM
# operands stream straight into shared memory) instead of once per BLOCK_M rows inside the GEMM: at
# M = 4096 the in-register decode would repeat 32 times; the extra fp16 pass costs ~2 bytes per weight.
_PREFILL_M = 1024


def _dummy(device, dtype=torch.float32):
    return torch.empty(1, dtype=dtype, device=device)


_SPLIT_COUNTERS = {}


def _split_k_buffers(M, N, device):
    """Workspace for split-K partial tiles (written before read: no init) and the per-tile arrival
    counters (zero, and reset to zero by the kernel itself: kept per device). Counters are shared by
    all calls, so split-K launches must not run concurrently on two streams."""
    configs = (_INTERPRETER_CONFIGS if _INTERPRET else _DENSE_CONFIGS)[_m_bucket(M)]
    splits = [(bm, bn, split) for bm, bn, _, _, _, split in configs if split > 1]
    if not splits:
        return _dummy(device), _dummy(device, torch.int32)
    size = max(split * triton.cdiv(M, bm) * bm * triton.cdiv(N, bn) * bn for bm, bn, split in splits)
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for bm, bn, _ in splits)
    counters = _SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _SPLIT_COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return torch.empty(size, dtype=torch.float32, device=device), counters


def _gemm_portable(act_operand, x_global_scale, w_q, out_dtype):
    """The portable dense kernel on an fp16 activation operand (2, M, K/2) and NVFP4 weights (N, K)."""
    _, M, half_k = act_operand.shape
    K, N = 2 * half_k, w_q.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=act_operand.device)
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous().view(torch.uint8)
    w_fp16 = M >= _PREFILL_M
    if w_fp16:
        w_operand = _empty_planes(N, half_k, y.device)
        rows, block_k = 64, 256
        _weight_operand_kernel[(triton.cdiv(N, rows), triton.cdiv(K, block_k))](
            w_data, w_scale, w_operand, N, K, w_data.stride(0), w_scale.stride(0), w_operand.stride(0),
            GPU=not _INTERPRET, ROWS=rows, BLOCK_K=block_k)
        w_ptr, stride_w, w_plane = w_operand, half_k, w_operand.stride(0)
    else:
        w_ptr, stride_w, w_plane = w_data, w_data.stride(0), 0

    workspace, counters = _split_k_buffers(M, N, y.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    _w4a4_kernel[grid](act_operand, x_global_scale, w_ptr, w_scale, w_q.global_scale.contiguous(), _as_int16(y),
                       workspace, counters, M, N, K, _m_bucket(M), act_operand.stride(0), w_plane,
                       act_operand.stride(1), stride_w, w_scale.stride(0), y.stride(0),
                       OUT_BF16=out_dtype == torch.bfloat16, GPU=not _INTERPRET, W_FP16=w_fp16)
    return y


def _gemm_native(x_q, residual, w_q, out_dtype):
    M, K = x_q.shape
    N = w_q.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    x_data, x_scale = x_q.data.contiguous(), x_q.block_scale.contiguous()
    r_data = residual.data.contiguous() if residual is not None else x_data
    r_scale = residual.block_scale.contiguous() if residual is not None else x_scale
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous()
    block_m, block_n, block_k = 128, 128, 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a4_native_kernel[grid](x_data, x_scale, r_data, r_scale, x_q.global_scale.contiguous(),
                              w_data, w_scale, w_q.global_scale.contiguous(), _as_int16(y),
                              M, N, K, x_data.stride(0), x_scale.stride(0), w_data.stride(0),
                              w_scale.stride(0), y.stride(0),
                              HAS_RESIDUAL=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y


# ---------------------------------------------------------------------------- the one place a path is chosen
_BACKENDS = {}


def _native_agrees(device, native=None):
    """Run the native kernel once on a check problem and compare it with the portable kernel.
    Any disagreement or error: warn once, in one line, and return False (use the portable kernel)."""
    native = native or _gemm_native
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(48, 256, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(80, 256, generator=generator).to(device, torch.bfloat16)
    act = quantize_activation_triton(x, torch.arange(16, device=device) % 2 == 0, operand=True)
    w_q = nvfp4.quantize_weight(w)
    reference = _gemm_portable(act.operand, act.global_scale, w_q, torch.float32)
    try:
        result = native(act.x_q, act.residual, w_q, torch.float32)
    except Exception as error:  # a compiler or launch failure: report it and keep going on the portable path
        warnings.warn(f"rac.py: the native FP4 GEMM failed on {device} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); using the portable kernel")
        return False
    error = ((result - reference).norm() / reference.norm()).item()
    if not error < 1e-3:
        warnings.warn(f"rac.py: the native FP4 GEMM disagrees with the portable kernel on {device} "
                      f"(relative error {error:.2e}); using the portable kernel")
        return False
    return True


def _gemm_backend(device):
    """'native' (tl.dot_scaled on sm_100+, if it passed its first-use check) or 'portable'."""
    if triton is None or device.type != "cuda":
        return "portable"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BACKENDS:
        blackwell = torch.cuda.get_device_capability(index)[0] >= 10
        _BACKENDS[index] = "native" if blackwell and _native_agrees(torch.device("cuda", index)) else "portable"
    return _BACKENDS[index]


def _use_triton(x):
    # Triton on CUDA tensors; the plain PyTorch twins elsewhere (the CPU, no triton).
    return triton is not None and x.is_cuda


# ---------------------------------------------------------------------------- public functions
def quantize_activation(x, rac_mask=None, global_scale=None):
    """x (M, K) -> (x_q, residual): NVFP4 codes of x and, on the blocks where rac_mask (G,) bool is
    True, of its residual x - DQ(x_q) (same global scale; residual is None without a mask).
    Triton (one read of x) on CUDA, the torch twin elsewhere; bit-identical."""
    if isinstance(x, torch.Tensor) and _use_triton(x):
        act = quantize_activation_triton(x, rac_mask, global_scale)
        return act.x_q, act.residual
    return quantize_activation_reference(x, rac_mask, global_scale)


def w4a4_matmul_triton(x_q, w_q, residual=None, out_dtype=torch.bfloat16):
    """The Triton path of w4a4_matmul (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    _require_triton()
    _check_operands(x_q, w_q, residual, "w4a4_matmul")
    _out_dtype_ok(out_dtype)
    if _gemm_backend(x_q.device) == "native":
        return _gemm_native(x_q, residual, w_q, out_dtype)
    operand = activation_operand(x_q, residual)  # a layer gets this from the fused quantizer instead
    return _gemm_portable(operand, x_q.global_scale.reshape(()).float().contiguous(), w_q, out_dtype)


def w4a4_matmul(x_q, w_q, residual=None, out_dtype=torch.bfloat16):
    """y = (DQ(x_q) + DQ(residual)) @ DQ(w_q).T: NVFP4 x (M, K), NVFP4 w (N, K), any M, K % 16 == 0.

    fp32 accumulation, both global scales applied in the epilogue, `out_dtype` out (BF16 by default).
    Triton on CUDA (native FP4 MMAs on Blackwell when they pass their check), the twin elsewhere.
    """
    _check_operands(x_q, w_q, residual, "w4a4_matmul")
    if _use_triton(x_q.data):
        return w4a4_matmul_triton(x_q, w_q, residual, out_dtype)
    return w4a4_matmul_reference(x_q, w_q, residual, out_dtype)


def _grouped_portable(act_operand, x_global_scale, w_q, counts, row_ids=None, row_weights=None,
                      swiglu=False, out_dtype=torch.bfloat16):
    """The grouped kernel: rows (row_ids[r] of the operand, or r) grouped by expert per counts (E,)."""
    E, N, K = w_q.shape
    n_rows = row_ids.numel() if row_ids is not None else act_operand.shape[1]
    n_out = N // 2 if swiglu else N
    y = torch.empty((n_rows, n_out), dtype=out_dtype, device=act_operand.device)
    if n_rows == 0:
        return y
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous().view(torch.uint8)
    dummy = counts

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_M): no host sync
        return (triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows), triton.cdiv(n_out, meta["BLOCK_N"]))

    _w4a4_grouped_kernel[grid](
        act_operand, x_global_scale, row_ids if row_ids is not None else dummy,
        row_weights if row_weights is not None else dummy, w_data, w_scale, w_q.global_scale.contiguous(),
        counts, _as_int16(y),
        n_rows, N, K, E, _m_bucket(triton.cdiv(n_rows, E)), act_operand.stride(0),
        act_operand.stride(1), w_data.stride(0), w_data.stride(1), w_scale.stride(0), w_scale.stride(1),
        y.stride(0),
        GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None, SWIGLU=swiglu,
        OUT_BF16=out_dtype == torch.bfloat16, GPU=not _INTERPRET, E_POW2=max(2, triton.next_power_of_2(E)))
    return y


def w4a4_grouped_matmul(x_q, w_q, counts, residual=None, row_ids=None, row_weights=None, swiglu=False,
                        out_dtype=torch.bfloat16):
    """Grouped W4A4 GEMM for experts: w_q (E, N, K) stacked, one global scale per expert.

    The rows (x_q's rows, or x_q[row_ids] when given: a gather of tokens) are grouped by expert, counts
    (E,) rows each in order; expert e's rows are multiplied by DQ(w_q[e]).T. swiglu: the N weight rows
    are [gate; up] and the output is silu(gate) * up (N/2 columns). row_weights (R,): each output row
    is scaled by it (the router weights). Experts with no rows cost nothing. -> (R, N or N/2).
    """
    _check_operands(x_q, w_q, residual, "w4a4_grouped_matmul", stacked=True)
    if not _use_triton(x_q.data):
        return w4a4_grouped_matmul_reference(x_q, w_q, counts, residual, row_ids, row_weights, swiglu, out_dtype)
    return w4a4_grouped_matmul_triton(x_q, w_q, counts, residual, row_ids, row_weights, swiglu, out_dtype)


def w4a4_grouped_matmul_triton(x_q, w_q, counts, residual=None, row_ids=None, row_weights=None,
                               swiglu=False, out_dtype=torch.bfloat16):
    """The Triton path of w4a4_grouped_matmul (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    _require_triton()
    _check_operands(x_q, w_q, residual, "w4a4_grouped_matmul", stacked=True)
    _out_dtype_ok(out_dtype)
    _check_counts(counts, row_ids.numel() if row_ids is not None else x_q.shape[0], w_q.shape[0], x_q.device)
    operand = activation_operand(x_q, residual)
    return _grouped_portable(operand, x_q.global_scale.reshape(()).float().contiguous(), w_q, counts,
                             row_ids, row_weights, swiglu, out_dtype)


# ============================================================================ RAC block selection
def block_residual_error(x):
    """Mean |x - DQ(Q(x))| per 16-channel block of x (M, K), with x's dynamic global scale -> (G,) fp32."""
    residual = x.float() - nvfp4.dequantize(nvfp4.quantize(x), torch.float32)         # (M, K)
    return residual.abs().reshape(-1, x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE).mean(dim=(0, 2))


class RACSelector(nn.Module):
    """Which 16-channel blocks of one layer input get residual compensation: the round(rac_ratio * G)
    (half up) blocks with the largest mean |x - DQ(Q(x))| over the calibration inputs.

    `calibrate_rac` opens a calibration window (start / finish); a selector that was never calibrated
    calibrates from the first input it sees. rac_ratio 0 selects nothing (naive NVFP4), 1 everything.
    """

    def __init__(self, n_blocks, rac_ratio=0.0, device=None):
        super().__init__()
        _check_ratio(rac_ratio)
        self.n_blocks = n_blocks
        self.register_buffer("mask", torch.zeros(n_blocks, dtype=torch.bool, device=device))
        self.register_buffer("error_sum", torch.zeros(n_blocks, dtype=torch.float64, device=device),
                             persistent=False)
        self.set_ratio(rac_ratio)

    def set_ratio(self, rac_ratio):
        _check_ratio(rac_ratio)
        self.rac_ratio = float(rac_ratio)
        self.n_selected = int(self.rac_ratio * self.n_blocks + 0.5)
        self.mask.fill_(self.n_selected == self.n_blocks)
        self.calibrated = self.n_selected in (0, self.n_blocks)   # nothing to choose
        self.calibrating = False
        self.rows_seen = 0

    def start_calibration(self):
        self.error_sum.zero_()
        self.rows_seen, self.calibrating = 0, True

    def finish_calibration(self):
        self.calibrating = False
        self.calibrated = True

    @torch.no_grad()
    def forward(self, x):
        """x (M, K) -> the mask (G,) bool to use now, or None for naive NVFP4."""
        if self.n_selected == 0:
            return None
        if self.calibrating or not self.calibrated:
            rows = x.shape[0]
            self.error_sum += block_residual_error(x).double() * rows
            self.rows_seen += rows
            chosen = torch.topk(self.error_sum, self.n_selected).indices
            self.mask.zero_()
            self.mask[chosen] = True
            if not self.calibrating:
                self.calibrated = True
        return self.mask

    def extra_repr(self):
        return f"n_blocks={self.n_blocks}, rac_ratio={self.rac_ratio}, n_selected={self.n_selected}"


# ============================================================================ FP8 baseline (W8A8)
def quantize_fp8_rowwise(x):
    """Per-row FP8 E4M3: x (..., K) -> (codes (..., K) e4m3, scale (..., 1) fp32), x ~ codes * scale,
    scale = amax(|row|) / 448 (1.0 for an all-zero row)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _use_scaled_mm(x, *dims):
    # torch._scaled_mm with row-wise scales needs CUDA sm_89+ and 16-aligned K and N.
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and all(d % 16 == 0 for d in dims))


def fp8_linear(x, weight_fp8, weight_scale):
    """x (M, K) @ (weight_fp8 * weight_scale[:, None]).T with x quantized per token -> (M, N) BF16."""
    x_fp8, x_scale = quantize_fp8_rowwise(x)
    if _use_scaled_mm(x, *weight_fp8.shape):
        return torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                out_dtype=torch.bfloat16)
    return fp8_linear_reference(x_fp8, x_scale, weight_fp8, weight_scale)


def fp8_linear_reference(x_fp8, x_scale, weight_fp8, weight_scale):
    """Twin: dequantize both operands, matmul in fp32, round to BF16 (as _scaled_mm's output)."""
    x = x_fp8.float() * x_scale
    w = weight_fp8.float() * weight_scale.float()[:, None]
    return (x @ w.T).to(torch.bfloat16)


def _grouped_fp8(x_sorted, routing, weight_fp8, weight_scale):
    """x_sorted (R, K) grouped by expert @ weight (E, N, K) per expert -> (R, N) BF16."""
    x_fp8, x_scale = quantize_fp8_rowwise(x_sorted)
    E, N, K = weight_fp8.shape
    if _use_scaled_mm(x_sorted, N, K) and hasattr(torch, "_scaled_grouped_mm") and x_sorted.shape[0] > 0:
        return torch._scaled_grouped_mm(x_fp8, weight_fp8.transpose(-2, -1), x_scale.view(-1), weight_scale,
                                        offs=routing.offsets, out_dtype=torch.bfloat16)
    outputs, start = [], 0
    for e, n in enumerate(routing.counts.tolist()):  # the twin: one host sync, a loop over experts
        outputs.append(fp8_linear_reference(x_fp8[start:start + n], x_scale[start:start + n],
                                            weight_fp8[e], weight_scale[e]))
        start += n
    return torch.cat(outputs) if outputs else x_sorted.new_zeros((0, N), dtype=torch.bfloat16)


def quantize_fp8_weight(w):
    """The FP8 weight rule: per output channel, w (..., N, K) -> (codes (..., N, K), scale (..., N) fp32)."""
    codes, scale = quantize_fp8_rowwise(w.detach())
    return codes, scale.squeeze(-1)


# ============================================================================ rollout modules
def _check_layer_input(x, in_features, device, name):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected a bfloat16/float16/float32 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-1] != in_features:
        raise ValueError(f"{name}: expected last dim {in_features}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: input on {x.device} but weights on {device}")


def _check_features(in_features, name):
    if in_features % BLOCK_SIZE:
        raise ValueError(f"{name}: in_features={in_features} is not a multiple of the NVFP4 block size {BLOCK_SIZE}")


def nvfp4_linear_reference(x, w_q, rac_mask=None):
    """The layer's twin: quantize x (dynamic scale, RAC residual on rac_mask), dequantize, fp32 matmul."""
    x_q, residual = quantize_activation_reference(x, rac_mask)
    return w4a4_matmul_reference(x_q, w_q, residual, out_dtype=torch.float32)


def nvfp4_linear_triton(x, w_q, rac_mask=None, out_dtype=torch.bfloat16):
    """The layer's fast path: one fused quantizer launch, one GEMM launch (portable or native)."""
    if _gemm_backend(x.device) == "native":
        act = quantize_activation_triton(x, rac_mask, codes=True, operand=False)
        return _gemm_native(act.x_q, act.residual, w_q, out_dtype)
    act = quantize_activation_triton(x, rac_mask, codes=False, operand=True)
    return _gemm_portable(act.operand, act.global_scale, w_q, out_dtype)


class NVFP4Linear(nn.Module):
    """W4A4 replacement for nn.Linear: NVFP4 weights (nvfp4.quantize_weight), activations quantized
    per call, RAC on the blocks its RACSelector picks. `weight_q` is the packed NVFP4Tensor."""

    def __init__(self, in_features, out_features, bias=False, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(in_features, "NVFP4Linear")
        self.in_features, self.out_features = in_features, out_features
        n_blocks = in_features // BLOCK_SIZE
        self.register_buffer("weight_data",
                             torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_block_scale",
                             torch.zeros(out_features, n_blocks, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self.rac = RACSelector(n_blocks, rac_ratio, device=device)

    @property
    def weight_q(self):
        return NVFP4Tensor(self.weight_data, self.weight_block_scale, self.weight_global_scale)

    @classmethod
    def from_float(cls, linear, rac_ratio=0.0):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, rac_ratio=rac_ratio,
                    device=linear.weight.device)
        layer.load_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        """Quantize a master weight (N, K) with nvfp4.quantize_weight, in place (the trainer's rule)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"NVFP4Linear: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        q = nvfp4.quantize_weight(weight.detach())
        self.weight_data.copy_(q.data)
        self.weight_block_scale.copy_(q.block_scale)
        self.weight_global_scale.copy_(q.global_scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        _check_layer_input(x, self.in_features, self.weight_data.device, "NVFP4Linear")
        x2 = x.reshape(-1, self.in_features)                                            # (M, K)
        rac_mask = self.rac(x2)
        if _use_triton(x2):
            y = nvfp4_linear_triton(x2, self.weight_q, rac_mask, out_dtype=x.dtype)
        else:
            y = nvfp4_linear_reference(x2, self.weight_q, rac_mask).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, rac_ratio={self.rac.rac_ratio}"


class FP8Linear(nn.Module):
    """W8A8 replacement for nn.Linear: per-output-channel FP8 weights, per-token FP8 activations."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__()
        _check_features(in_features, "FP8Linear")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8",
                             torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=linear.weight.device)
        layer.load_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"FP8Linear: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        codes, scale = quantize_fp8_weight(weight)
        self.weight_fp8.copy_(codes)
        self.weight_scale.copy_(scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        _check_layer_input(x, self.in_features, self.weight_fp8.device, "FP8Linear")
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight_fp8, self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def _combine(y_sorted, routing, T, A, dtype):
    """Rows already scaled by their router weights, in expert order -> (T, D): sum of each token's A rows."""
    return y_sorted[routing.inverse_order].view(T, A, -1).sum(dim=1).to(dtype)


class NVFP4Experts(nn.Module):
    """W4A4 replacement for moe.Experts: stacked NVFP4 weights (one global scale per expert, the
    trainer's rule), two grouped GEMMs, RAC on each GEMM's input (one block selection per input)."""

    def __init__(self, n_experts, dim, expert_dim, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(dim, "NVFP4Experts (model dim)")
        _check_features(expert_dim, "NVFP4Experts (expert dim)")
        self.n_experts, self.dim, self.expert_dim = n_experts, dim, expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):
            self.register_buffer(f"{name}_data", torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_block_scale",
                                 torch.zeros(E, N, K // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_global_scale", torch.ones(E, dtype=torch.float32, device=device))
        self.rac_gate_up = RACSelector(D // BLOCK_SIZE, rac_ratio, device=device)
        self.rac_down = RACSelector(I // BLOCK_SIZE, rac_ratio, device=device)

    @property
    def gate_up_q(self):
        return NVFP4Tensor(self.gate_up_data, self.gate_up_block_scale, self.gate_up_global_scale)

    @property
    def down_q(self):
        return NVFP4Tensor(self.down_data, self.down_block_scale, self.down_global_scale)

    @classmethod
    def from_float(cls, experts, rac_ratio=0.0):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, rac_ratio, device=experts.gate_up_proj.device)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        """Quantize the master stacks with nvfp4.quantize_weight (per-expert global scales), in place."""
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            target = getattr(self, f"{name}_data")
            if tuple(w.shape) != (*target.shape[:-1], target.shape[-1] * 2):
                raise ValueError(f"NVFP4Experts: {name} weight shape {tuple(w.shape)} does not match "
                                 f"{(*target.shape[:-1], target.shape[-1] * 2)}")
            q = nvfp4.quantize_weight(w.detach())
            target.copy_(q.data)
            getattr(self, f"{name}_block_scale").copy_(q.block_scale)
            getattr(self, f"{name}_global_scale").copy_(q.global_scale)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) -> (T, D) in x.dtype, as moe.Experts."""
        _check_layer_input(x, self.dim, self.gate_up_data.device, "NVFP4Experts")
        T, A = expert_ids.shape
        routing = moe.route_tokens(expert_ids, self.n_experts)
        row_weights = expert_weights.reshape(-1)[routing.order].float()                 # (R,)
        if _use_triton(x):
            y_sorted = self._forward_triton(x, routing, row_weights)
        else:
            y_sorted = self._forward_reference(x, routing, row_weights)
        return _combine(y_sorted, routing, T, A, x.dtype)

    def _forward_triton(self, x, routing, row_weights):
        act = quantize_activation_triton(x, self.rac_gate_up(x), codes=False, operand=True)   # (T, D) once
        hidden = _grouped_portable(act.operand, act.global_scale, self.gate_up_q, routing.counts,
                                   row_ids=routing.token_ids, swiglu=True, out_dtype=x.dtype)  # (R, I)
        act = quantize_activation_triton(hidden, self.rac_down(hidden), codes=False, operand=True)
        return _grouped_portable(act.operand, act.global_scale, self.down_q, routing.counts,
                                 row_weights=row_weights, out_dtype=x.dtype)                  # (R, D)

    def _forward_reference(self, x, routing, row_weights):
        """The twin: the same quantization steps, dequantized, a loop of fp32 matmuls over experts."""
        x_q, residual = quantize_activation_reference(x, self.rac_gate_up(x))
        hidden = w4a4_grouped_matmul_reference(x_q, self.gate_up_q, routing.counts, residual,
                                               row_ids=routing.token_ids, swiglu=True, out_dtype=x.dtype)
        h_q, residual = quantize_activation_reference(hidden, self.rac_down(hidden))
        return w4a4_grouped_matmul_reference(h_q, self.down_q, routing.counts, residual,
                                             row_weights=row_weights, out_dtype=torch.float32)

    def extra_repr(self):
        return (f"n_experts={self.n_experts}, dim={self.dim}, expert_dim={self.expert_dim}, "
                f"rac_ratio={self.rac_gate_up.rac_ratio}")


class FP8Experts(nn.Module):
    """W8A8 replacement for moe.Experts: per-channel FP8 weights, per-token FP8 activations,
    torch._scaled_grouped_mm on GPUs that have it."""

    def __init__(self, n_experts, dim, expert_dim, device=None):
        super().__init__()
        self.n_experts, self.dim, self.expert_dim = n_experts, dim, expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):
            self.register_buffer(f"{name}_fp8", torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_scale", torch.ones(E, N, dtype=torch.float32, device=device))

    @classmethod
    def from_float(cls, experts):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, device=experts.gate_up_proj.device)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            target = getattr(self, f"{name}_fp8")
            if tuple(w.shape) != tuple(target.shape):
                raise ValueError(f"FP8Experts: {name} weight shape {tuple(w.shape)} != {tuple(target.shape)}")
            codes, scale = quantize_fp8_weight(w)
            target.copy_(codes)
            getattr(self, f"{name}_scale").copy_(scale)

    def forward(self, x, expert_ids, expert_weights):
        _check_layer_input(x, self.dim, self.gate_up_fp8.device, "FP8Experts")
        routing = moe.route_tokens(expert_ids, self.n_experts)
        x_sorted = x[routing.token_ids]                                                 # (R, D)
        gate, up = _grouped_fp8(x_sorted, routing, self.gate_up_fp8, self.gate_up_scale).to(x.dtype).chunk(2, dim=-1)
        y_sorted = _grouped_fp8(F.silu(gate) * up, routing, self.down_fp8, self.down_scale).to(x.dtype)
        return moe.combine_expert_outputs(y_sorted, routing, expert_weights)


# ============================================================================ conversion, sync, calibration
def _check_mode(mode, rac_ratio):
    if mode not in MODES:
        raise ValueError(f"unknown rollout mode {mode!r}; choose one of {list(MODES)}")
    _check_ratio(rac_ratio)
    if rac_ratio > 0 and mode != "nvfp4":
        raise ValueError(f"rac_ratio={rac_ratio} compensates NVFP4 activations; mode {mode!r} has none")


def convert_for_rollout(model, mode, rac_ratio=0.0, quantize_router=False, quantize_lm_head=False):
    """Swap a moe.py model's layers for rollout layers in place; returns the model.

    mode "bf16": unchanged. "fp8": W8A8 (FP8Linear, FP8Experts). "nvfp4": W4A4 (NVFP4Linear,
    NVFP4Experts) with residual compensation on round(rac_ratio * G) blocks of each layer input.
    Converted: every moe.Attention's nn.Linear projections and every moe.Experts (a qat.py model's
    QATLinear / QATExperts are subclasses of those, so it converts too); with the flags also the
    routers (moe.MoEBlock's nn.Linear) and the LM head (moe.MoETransformer's nn.Linear). Embeddings
    and norms always stay in full precision. The weights are quantized from the model's own.
    """
    _check_mode(mode, rac_ratio)
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        if isinstance(child, moe.Experts):
            new = NVFP4Experts.from_float(child, rac_ratio) if mode == "nvfp4" else FP8Experts.from_float(child)
        else:
            new = NVFP4Linear.from_float(child, rac_ratio) if mode == "nvfp4" else FP8Linear.from_float(child)
        setattr(parent, name, new)
    return model


@torch.no_grad()
def sync_weights(rollout_model, trainer_model):
    """Reload every rollout weight in place from the trainer's master weights.

    Quantized layers re-quantize the trainer's `weight` / `gate_up_proj` / `down_proj` (NVFP4 through
    nvfp4.quantize_weight, the function qat.py's fake quantization uses, so the rollout's codes are
    the trainer's QAT weights bit for bit; FP8 through its per-channel rule). Everything else in full
    precision (embeddings, norms, routers, LM head, bf16-mode layers) is copied by parameter name.
    The RAC block selection is left alone: call calibrate_rac when it should be refreshed.
    """
    params = dict(trainer_model.named_parameters(remove_duplicate=False))

    def master(path, name):
        key = f"{path}.{name}" if path else name
        if key not in params:
            raise ValueError(f"sync_weights: the trainer model has no parameter {key!r} for rollout layer {path!r}")
        return params[key]

    for path, module in rollout_model.named_modules():
        if isinstance(module, (NVFP4Linear, FP8Linear)):
            module.load_weight(master(path, "weight"), master(path, "bias") if module.bias is not None else None)
        elif isinstance(module, (NVFP4Experts, FP8Experts)):
            module.load_weights(master(path, "gate_up_proj"), master(path, "down_proj"))
    quantized = {path for path, m in rollout_model.named_modules()
                 if isinstance(m, (NVFP4Linear, FP8Linear, NVFP4Experts, FP8Experts))}
    for name, param in rollout_model.named_parameters(remove_duplicate=False):
        if name.rpartition(".")[0] in quantized:
            continue  # a quantized layer's bias was loaded above
        param.copy_(master(*name.rpartition(".")[::2]))


@torch.no_grad()
def calibrate_rac(rollout_model, tokens, rac_ratio=None, **forward_kwargs):
    """Choose each NVFP4 layer input's compensated blocks from one forward pass on `tokens` (B, T).

    Each selector sees the activations its layer actually receives (upstream layers already run
    with their fresh selection) and keeps the blocks with the largest mean |x - DQ(Q(x))|. Call it
    after sync_weights, or every N steps: the caller decides. rac_ratio, if given, is set first.
    Returns the model.
    """
    selectors = [m for m in rollout_model.modules() if isinstance(m, RACSelector)]
    for selector in selectors:
        if rac_ratio is not None:
            selector.set_ratio(rac_ratio)
        selector.start_calibration()
    try:
        rollout_model(tokens, **forward_kwargs)
    finally:
        for selector in selectors:
            selector.finish_calibration()
    return rollout_model
