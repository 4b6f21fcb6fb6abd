"""gpu_kernels/expert_layout.py: the experts' blocked weight layout against a hand-computed position
of every code and scale, and back."""

import itertools

import torch

import nvfp4
from gpu_kernels import expert_layout


def test_expert_weights_store_each_row_block_and_k_chunk_as_one_run():
    # the oracle walks every code and scale and computes where ExpertWeights' layout puts it by hand
    E, N, K = 2, 32, 384
    w_q = nvfp4.quantize_weight(torch.randn(E, N, K))
    w = expert_layout.chunk_experts(w_q)
    assert w.shape == (E, N, K) and w.chunk == 128
    data, scale = w.data.flatten().tolist(), w.block_scale.view(torch.uint8).flatten().tolist()
    codes, scales = w_q.data.tolist(), w_q.block_scale.view(torch.uint8).tolist()

    # (expert, row block, chunk, row in block, within the run)
    def position(e, n, chunk, within, run):
        return (((e * (N // 16) + n // 16) * (K // 128) + chunk) * 16 + n % 16) * run + within

    # byte j: elements 2j, 2j + 1
    for e, n, j in itertools.product(range(E), range(N), range(K // 2)):
        assert data[position(e, n, j // 64, j % 64, 64)] == codes[e][n][j]
    for e, n, b in itertools.product(range(E), range(N), range(K // 16)):
        assert scale[position(e, n, b // 8, b % 8, 8)] == scales[e][n][b]
    data, block_scale, global_scale = expert_layout.unchunk_experts(w)
    assert torch.equal(data, w_q.data)
    assert torch.equal(block_scale.view(torch.uint8), w_q.block_scale.view(torch.uint8))
    assert global_scale is w_q.global_scale
    # K not a multiple of 128: one chunk, the row-major codes in blocks of 16 rows, and unchunking
    # is a view
    w = expert_layout.chunk_experts(nvfp4.quantize_weight(torch.randn(E, N, 96)))
    assert w.chunk == 96 and expert_layout.unchunk_experts(w)[0].data_ptr() == w.data.data_ptr()
