"""The experts' weight layout the grouped W4A4 kernels stream (torch only: the CPU references use it
too).

nvfp4.quantize_weight gives an expert stack row-major: codes (E, N, K/2), block scales (E, N, K/16).
A grouped-GEMM program reads 16 weight rows by a K step at a time, which row-major puts in 16 pieces
of 64 bytes 1 KB apart. Stored here as rows in blocks of 16 and K in chunks of 128 elements, each
(16 rows x chunk) tile is one contiguous run: 84 us instead of 102 for the gate/up GEMM at 64 decode
tokens on the H200. K not a multiple of 128 is one chunk. rac.NVFP4Experts keeps its weights in this
layout.
"""

from typing import NamedTuple

import torch

EXPERT_ROW_BLOCK = 16  # rows in blocks of 16 ...
EXPERT_K_CHUNK = 128  # ... by chunks of 128 elements of K (all of K when it is not a multiple)


class ExpertWeights(NamedTuple):
    """An NVFP4 expert stack (E, N, K) in the grouped kernels' order."""

    data: torch.Tensor  # uint8 (E, N / 16, K / chunk, 16, chunk / 2)
    block_scale: torch.Tensor  # float8_e4m3fn (E, N / 16, K / chunk, 16, chunk / 16)
    global_scale: torch.Tensor  # float32 (E,)

    @property
    def shape(self):
        E, blocks, chunks, rows, half = self.data.shape
        return (E, blocks * rows, chunks * half * 2)

    chunk = property(lambda self: self.data.shape[-1] * 2)
    device = property(lambda self: self.data.device)


def chunk_experts(w_q):
    """An NVFP4 weight (E, N, K) (data, block_scale, global_scale; N a multiple of 16) ->
    ExpertWeights."""
    E, N, K = w_q.data.shape[0], w_q.data.shape[1], w_q.data.shape[2] * 2
    chunk, rows = EXPERT_K_CHUNK if K % EXPERT_K_CHUNK == 0 else K, EXPERT_ROW_BLOCK
    if N % rows:
        raise ValueError(f"chunk_experts: N={N} rows is not a multiple of {rows}")

    # (E, N, K / per_byte) -> (E, N / 16, K / chunk, 16, chunk / per_byte)
    def blocked(t, per_byte):
        split = t.reshape(E, N // rows, rows, K // chunk, chunk // per_byte)
        return split.transpose(2, 3).contiguous()

    return ExpertWeights(blocked(w_q.data, 2), blocked(w_q.block_scale, 16), w_q.global_scale)


def unchunk_experts(w):
    """ExpertWeights -> (data (E, N, K/2), block_scale (E, N, K/16), global_scale): views when K is
    one chunk, else copies."""
    E, N, _ = w.shape
    return (*(t.transpose(2, 3).reshape(E, N, -1) for t in (w.data, w.block_scale)), w.global_scale)


def expert_shape(w_data):
    """Codes in the experts' layout (E, N/16, K/chunk, 16, chunk/2) -> (E, N, K, chunk)."""
    E, blocks, chunks, rows, half = w_data.shape
    return E, blocks * rows, chunks * half * 2, half * 2
