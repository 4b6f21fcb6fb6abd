"""Tests for gpu_kernels/sampling.py: the noise kernel against rollout.py's torch twin (on the CPU under
TRITON_INTERPRET=1, on a GPU natively)."""
import pytest
import torch

import rollout

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import sampling as sampling_kernels  # noqa: E402


def test_noise_kernel_equals_its_torch_twin(kernel_device):
    """One launch computes keys, hash and -log(u): equal to the twin up to the last ulp of the log (a
    wrong bit anywhere in the hash would move E by far more)."""
    # one token, a partial block, several blocks
    for seed, position, vocab in ((3, 11, 1), (2 ** 33 + 5, 0, 37), (7, 200, 1500)):
        args = (torch.tensor([rollout.seed_key(seed)], device=kernel_device),
                torch.arange(5, device=kernel_device) * 1001,
                torch.tensor([position], device=kernel_device), vocab)
        fast = sampling_kernels.sampling_noise(*args)
        torch.testing.assert_close(fast, rollout.sampling_noise_reference(*args), rtol=1e-6, atol=1e-7)

