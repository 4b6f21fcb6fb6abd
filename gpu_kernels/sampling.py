"""The sampler's random numbers as a Triton kernel.

Twin (in rollout.py): sampling_noise = rollout.sampling_noise_reference, the hash bit for bit.

E (N, V) ~ Exp(1) is a counter-based hash of (seed key, row id, position, token id): two rounds of a
32-bit xor-shift / multiply mixer, u = (top 23 bits + 1/2) * 2^-23, E = -log(u). The twin computes it in
masked int64 arithmetic; here every product is uint32, which wraps mod 2^32 exactly as the twin's masks
do. One program per (row, block of tokens), one pass; the rest of the sampler (tempered log-softmax,
top-k / top-p, the race argmax) stays in torch.

Shape letters: N rows, V vocab.
"""
import torch
import triton
import triton.language as tl

# the hash's constants (rollout.py's ROW_STRIDE, POSITION_STRIDE, TOKEN_STRIDE: odd "Weyl" increments)
_ROW_STRIDE = tl.constexpr(0x27D4EB2F)
_POSITION_STRIDE = tl.constexpr(0x165667B1)
_TOKEN_STRIDE = tl.constexpr(0x61C88647)
_NOISE_BLOCK = 1024    # tokens per program of the noise kernel


@triton.jit
def _mix32_kernel(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x1B873593
    return x ^ (x >> 16)


@triton.jit
def _noise_kernel(seed_key_ptr, rows_ptr, position_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """One (row, token block) per program, one pass: the twin's arithmetic in uint32, whose products wrap
    mod 2^32 exactly as the twin's masked int64 ones."""
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = (tl.load(seed_key_ptr).to(tl.uint32) + tl.load(rows_ptr + row).to(tl.uint32) * _ROW_STRIDE
           + tl.load(position_ptr).to(tl.uint32) * _POSITION_STRIDE)
    x = _mix32_kernel(_mix32_kernel(key) + tokens.to(tl.uint32) * _TOKEN_STRIDE)
    uniform = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07                  # 2^-23
    tl.store(out_ptr + row.to(tl.int64) * V + tokens, -tl.log(uniform), mask=tokens < V)


def sampling_noise(seed_key, rows, position, vocab):
    """E (N, V) fp32 for seed_key and position (1,) int64 tensors and row ids rows (N,) int64."""
    out = torch.empty(rows.shape[0], vocab, dtype=torch.float32, device=rows.device)
    _noise_kernel[(rows.shape[0], triton.cdiv(vocab, _NOISE_BLOCK))](
        seed_key, rows, position, out, vocab, BLOCK=_NOISE_BLOCK)
    return out
