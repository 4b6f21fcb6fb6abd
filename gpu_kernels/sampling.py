"""The sampler's random numbers and its fused sampler as Triton kernels.

Twins (in rollout.py): sampling_noise = rollout.sampling_noise_reference, the hash bit for bit; and
sample_tokens = rollout.sample_tokens(logits, temperature, noise=sampling_noise(...)) without top-k
or top-p, to fp32 rounding.

The noise. E (N, V) ~ Exp(1) is a counter-based hash of (seed key, row id, position, token id): two
rounds of a 32-bit xor-shift / multiply mixer, u = (top 23 bits + 1/2) * 2^-23, E = -log(u). The
twin computes it in masked int64 arithmetic; here every product is uint32, which wraps mod 2^32
exactly as the twin's masks do. One program per (row, block of tokens), one pass.

The fused sampler. The exponential race argmax_v p_v / E_v equals, in log space, argmax_v
z_v / tau - log E_v (the normalizer is common to every v), so no (B, V) tensor is written: one pass
over the logits per (row, vocabulary slice) keeps the slice's max, sum of exp and race winner
(SAMPLE_FIELDS numbers); a second launch merges the slices per row in a fixed order (deterministic).
The token equals the twin's except where two candidates' scores agree to fp32 rounding (exp, log,
1 / tau in another order); the log-prob, z_token / tau - logsumexp(z / tau), agrees to a few fp32
units. temperature 0 is greedy: the argmax of z and log-probs of the untempered z.

Shape letters: B (or N) rows, V vocab.
"""

import torch
import triton
import triton.language as tl

# the hash's constants (rollout.py's ROW_STRIDE, POSITION_STRIDE, TOKEN_STRIDE: odd "Weyl"
# increments)
_ROW_STRIDE = tl.constexpr(0x27D4EB2F)
_POSITION_STRIDE = tl.constexpr(0x165667B1)
_TOKEN_STRIDE = tl.constexpr(0x61C88647)
SAMPLE_FIELDS = 5  # per vocabulary slice: max z, sum exp(z - max), best score, its token, its z
_FIELDS = tl.constexpr(SAMPLE_FIELDS)
_SAMPLE_SLICE = 4096  # vocabulary entries per program of the first pass
_NOISE_BLOCK = 1024  # tokens per program of the noise kernel


# ----------------------------------------------------------------------------- the noise
@triton.jit
def _mix32_kernel(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x1B873593
    return x ^ (x >> 16)


@triton.jit
def _uniform_kernel(seed_key_ptr, rows_ptr, position_ptr, row, tokens):
    """The twin's uniforms for one row's tokens: its arithmetic in uint32, whose products wrap mod
    2^32 exactly as the twin's masked int64 ones."""
    key = (
        tl.load(seed_key_ptr).to(tl.uint32)
        + tl.load(rows_ptr + row).to(tl.uint32) * _ROW_STRIDE
        + tl.load(position_ptr).to(tl.uint32) * _POSITION_STRIDE
    )
    x = _mix32_kernel(_mix32_kernel(key) + tokens.to(tl.uint32) * _TOKEN_STRIDE)
    return ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


@triton.jit
def _noise_kernel(seed_key_ptr, rows_ptr, position_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """One (row, token block) per program, one pass."""
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = _uniform_kernel(seed_key_ptr, rows_ptr, position_ptr, row, tokens)
    tl.store(out_ptr + row.to(tl.int64) * V + tokens, -tl.log(uniform), mask=tokens < V)


def sampling_noise(seed_key, rows, position, vocab):
    """E (N, V) fp32 for seed_key and position (1,) int64 tensors and row ids rows (N,) int64."""
    out = torch.empty(rows.shape[0], vocab, dtype=torch.float32, device=rows.device)
    block = _NOISE_BLOCK
    _noise_kernel[(rows.shape[0], triton.cdiv(vocab, block))](
        seed_key, rows, position, out, vocab, BLOCK=block
    )
    return out


# ----------------------------------------------------------------------------- the fused sampler
@triton.jit
def _sample_slice_kernel(
    logits_ptr,
    stride_row,
    seed_key_ptr,
    rows_ptr,
    position_ptr,
    part_ptr,
    V,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, part = tl.program_id(0), tl.program_id(1)
    tokens = part * BLOCK + tl.arange(0, BLOCK)
    mask = tokens < V
    z = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=mask, other=float("-inf")
    ).to(tl.float32)
    if GREEDY:
        score = z  # argmax z; log-probs of the untempered z
    else:
        z = z * inv_temperature  # z / tau to one fp32 rounding
        # as _noise_kernel
        uniform = _uniform_kernel(seed_key_ptr, rows_ptr, position_ptr, row, tokens)
        score = tl.where(mask, z - tl.log(-tl.log(uniform)), float("-inf"))  # z - log E
    z_max = tl.max(z, axis=0)
    best_score, best = tl.max(
        score, axis=0, return_indices=True, return_indices_tie_break_left=True
    )
    at_best = tl.arange(0, BLOCK) == best
    out = part_ptr + (row * tl.num_programs(1) + part).to(tl.int64) * _FIELDS
    tl.store(out, z_max)
    tl.store(out + 1, tl.sum(tl.exp(z - z_max), axis=0))
    tl.store(out + 2, best_score)
    tl.store(out + 3, (part * BLOCK + best).to(tl.float32))  # exact below 2^24
    tl.store(out + 4, tl.sum(tl.where(at_best, z, 0.0), axis=0))


@triton.jit
def _sample_merge_kernel(part_ptr, tokens_ptr, logprobs_ptr, n_parts, PARTS: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.arange(0, PARTS)
    mask = idx < n_parts
    slices = part_ptr + (row * n_parts + idx).to(tl.int64) * _FIELDS
    z_max = tl.load(slices, mask=mask, other=float("-inf"))
    sum_exp = tl.load(slices + 1, mask=mask, other=0.0)
    score = tl.load(slices + 2, mask=mask, other=float("-inf"))
    m = tl.max(z_max, axis=0)
    log_normalizer = m + tl.log(tl.sum(sum_exp * tl.exp(z_max - m), axis=0))
    winner = tl.argmax(score, axis=0, tie_break_left=True)  # lowest token on ties
    at_winner = (idx == winner) & mask
    token = tl.sum(tl.where(at_winner, tl.load(slices + 3, mask=mask, other=0.0), 0.0), axis=0)
    z_token = tl.sum(tl.where(at_winner, tl.load(slices + 4, mask=mask, other=0.0), 0.0), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, z_token - log_normalizer)


def sample_tokens(logits, temperature, seed_key, rows, position):
    """logits (B, V) -> tokens (B,) int64, logprobs (B,) fp32 of log_softmax(logits / temperature),
    the tokens drawn by the race against sampling_noise(seed_key, rows, position, V); two
    launches."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_parts = triton.cdiv(V, _SAMPLE_SLICE)
    parts = torch.empty(B, n_parts, SAMPLE_FIELDS, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _sample_slice_kernel[(B, n_parts)](
            logits,
            logits.stride(0),
            seed_key,
            rows,
            position,
            parts,
            V,
            1.0 / (temperature or 1.0),
            GREEDY=temperature == 0,
            BLOCK=_SAMPLE_SLICE,
            num_warps=8,
        )
        _sample_merge_kernel[(B,)](
            parts, tokens, logprobs, n_parts, PARTS=triton.next_power_of_2(n_parts)
        )
    return tokens, logprobs
