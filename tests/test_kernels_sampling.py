"""Tests for gpu_kernels/sampling.py: the noise kernel against rollout.py's torch twin, and the
fused sampler against the exponential race computed in float64 from the same hash (on the CPU under
TRITON_INTERPRET=1, on a GPU natively)."""

import pytest
import torch

import rollout

sampling_kernels = pytest.importorskip("gpu_kernels.sampling")


def test_noise_kernel_equals_its_torch_twin(kernel_device):
    """One launch computes keys, hash and -log(u): equal to the twin up to the last ulp of the log
    (a wrong bit anywhere in the hash would move E by far more)."""
    # one token, a partial block, several blocks
    for seed, position, vocab in ((3, 11, 1), (2**33 + 5, 0, 37), (7, 200, 1500)):
        args = (
            torch.tensor([rollout.seed_key(seed)], device=kernel_device),
            torch.arange(5, device=kernel_device) * 1001,
            torch.tensor([position], device=kernel_device),
            vocab,
        )
        fast = sampling_kernels.sampling_noise(*args)
        torch.testing.assert_close(
            fast, rollout.sampling_noise_reference(*args), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_fused_sampler_wins_the_float64_exponential_race(kernel_device, temperature):
    """The fused sampler against the race computed in float64 from the same hash: the winner of
    argmax p_v / E_v, and the full tempered log-prob of it."""
    generator = torch.Generator().manual_seed(3)
    for rows, vocab, dtype in (
        (3, 5, torch.float32),
        (4, 4096, torch.bfloat16),
        (5, 9000, torch.bfloat16),
    ):
        logits = (2 * torch.randn(rows, vocab, generator=generator)).to(dtype)
        seed_key, position = torch.tensor([rollout.seed_key(11)]), torch.tensor([3])
        row_ids = 7 * torch.arange(rows)
        device_args = [t.to(kernel_device) for t in (seed_key, row_ids, position)]
        tokens, logprobs = sampling_kernels.sample_tokens(
            logits.to(kernel_device), temperature, *device_args
        )
        z = logits.double() / (temperature or 1.0)
        if temperature == 0:
            score = z
        else:  # the hash in exact integer ops, the rest in float64
            key = seed_key + row_ids * rollout.ROW_STRIDE + position * rollout.POSITION_STRIDE
            keys = rollout._mix32(key & rollout.MASK32)
            x = rollout._mix32(
                (keys[:, None] + torch.arange(vocab) * rollout.TOKEN_STRIDE) & rollout.MASK32
            )
            uniform = ((x >> 9).double() + 0.5) * 2.0**-23
            score = z - torch.log(-torch.log(uniform))
        top2 = score.topk(2, dim=-1)
        clear = top2.values[:, 0] - top2.values[:, 1] > 1e-4  # no near-tie that fp32 could flip
        assert clear.sum() >= rows - 1
        assert torch.equal(tokens.cpu()[clear], top2.indices[clear, 0])
        expected = torch.log_softmax(z, dim=-1).gather(-1, tokens.cpu()[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs.cpu().double(), expected, rtol=0, atol=2e-5)
