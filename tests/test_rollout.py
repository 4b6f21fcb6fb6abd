"""rollout.py: the KV-cached sampler against cache-free decoding and the trainer's own forward.

CPU, fp32, the tiny preset with a small vocabulary. The CUDA tests (graph replay against eager
decoding, with rac.py's quantized layers when rac.py is importable) are skipped without a GPU.
"""

import math

import pytest
import torch
import torch.nn as nn

import rollout
from conftest import raises_one_line, report_diff, tiny_model

VOCAB = 32
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [19]]


def peaked_model(seed=0, **kwargs):
    """conftest's tiny model with this file's vocabulary, in eval mode, with a wider init
    (N(0, 0.2)) than the default, so the random model has peaked, seed-dependent next-token
    distributions."""
    return tiny_model(seed, std=0.2, vocab_size=VOCAB, **kwargs).eval()


@pytest.fixture(scope="module")
def model():
    return peaked_model()


def greedy_without_cache(model, prompt, max_new_tokens, eos_id=None):
    """The slow twin: a full forward over the growing sequence for every new token."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([tokens]))
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] == eos_id:
            break
    return tokens[len(prompt) :]


def trainer_logprobs(model, seq, temperature):
    """What the trainer computes: log_softmax(logits / temperature) of each next token, from a plain
    forward."""
    logits = model(seq.tokens).float()
    if temperature > 0:
        logits = logits / temperature
    all_logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    logprobs = all_logprobs.gather(-1, seq.tokens[:, 1:, None]).squeeze(-1)
    return torch.where(seq.loss_mask[:, 1:], logprobs, 0.0)  # aligned with [:, 1:]


def completion_list(out, row):
    n = int(out.completion_mask[row].sum())
    return out.completion_ids[row, :n].tolist()


# -------------------------------------------------------------------------------------- correctness
def test_greedy_with_cache_equals_greedy_without_cache(model):
    out = rollout.generate(model, PROMPTS, num_samples=2, max_new_tokens=12, temperature=0.0)
    for p, prompt in enumerate(PROMPTS):
        expected = greedy_without_cache(model, prompt, 12)
        for g in range(2):
            assert completion_list(out, p * 2 + g) == expected, f"prompt {p} sample {g}"


def test_padded_batch_rows_equal_each_prompt_alone(model):
    batch = rollout.generate(model, PROMPTS, num_samples=3, max_new_tokens=10, temperature=0.0)
    for p, prompt in enumerate(PROMPTS):
        alone = rollout.generate(model, [prompt], num_samples=1, max_new_tokens=10, temperature=0.0)
        for g in range(3):
            assert completion_list(batch, p * 3 + g) == completion_list(alone, 0)
            torch.testing.assert_close(
                batch.logprobs[p * 3 + g], alone.logprobs[0], atol=1e-5, rtol=0
            )
    # Sampled rows: the noise follows the row id, so tokens are compared in the batch-invariance
    # test below; here each sampled row's log-probs must be those of its prompt alone.
    sampled = rollout.generate(
        model, PROMPTS, num_samples=2, max_new_tokens=10, temperature=1.0, seed=3
    )
    for row in range(len(PROMPTS) * 2):
        prompt, completion = PROMPTS[row // 2], completion_list(sampled, row)
        logits = model(torch.tensor([prompt + completion])).float()
        alone = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
        alone = alone.gather(-1, torch.tensor(completion)[:, None])
        mx, _ = report_diff(
            sampled.logprobs[row, : len(completion)], alone.squeeze(-1), f"row {row}"
        )
        assert mx < 1e-5


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.6, 5, 0.9), (0.0, 0, 1.0)]
)
def test_logprobs_equal_trainer_logprobs_of_the_full_tempered_distribution(
    model, temperature, top_k, top_p
):
    out = rollout.generate(
        model,
        PROMPTS,
        num_samples=3,
        max_new_tokens=12,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=5,
        seed=1,
    )
    assert out.logprobs.dtype == torch.float32
    seq = out.sequences()
    expected = trainer_logprobs(model, seq, temperature)
    mx, _ = report_diff(seq.logprobs[:, 1:], expected, f"T={temperature} k={top_k} p={top_p}")
    assert mx < 1e-5
    assert int(seq.loss_mask.sum()) == int(out.completion_mask.sum())
    assert (seq.logprobs[seq.loss_mask] < 0).all()


def test_eos_masks_and_recorded_routes(model):
    eos = 7
    out = rollout.generate(
        model,
        PROMPTS * 2,
        num_samples=4,
        max_new_tokens=16,
        temperature=1.5,
        eos_id=eos,
        pad_id=0,
        seed=2,
    )
    N, T = out.completion_ids.shape
    lengths = out.completion_lengths
    ended = [row for row in range(N) if eos in completion_list(out, row)]
    assert 0 < len(ended) < N, "the test needs rows that end early and rows that do not"
    for row in range(N):
        n = int(lengths[row])
        # the mask is a prefix
        assert out.completion_mask[row, :n].all() and not out.completion_mask[row, n:].any()
        completion = out.completion_ids[row, :n].tolist()
        if row in ended:  # EOS is the last completion token, masked 1, with its log-prob
            assert completion.index(eos) == n - 1 and out.logprobs[row, n - 1] < 0
        else:
            assert n == 16
        assert (out.completion_ids[row, n:] == 0).all() and (out.logprobs[row, n:] == 0).all()
    assert T == int(lengths.max())

    # routes: the experts a plain forward over the full sequence chooses, for prompt and completion
    # tokens
    seq = out.sequences()
    _, routes = model(seq.tokens, return_routes=True)  # (L, N, W, A)
    valid = seq.valid_mask
    assert seq.routes.shape == routes.shape
    assert torch.equal(seq.routes[:, valid], routes[:, valid])
    L, A = model.config.n_layers, model.config.n_active
    assert out.routes.shape == (L, N, T, A)
    assert out.prompt_routes.shape == (L, N, out.prompt_ids.shape[1], A)
    # replaying them (R3) reproduces the forward on every valid token (padding columns route
    # differently)
    replayed = model(seq.tokens, forced_routes=seq.routes)
    torch.testing.assert_close(replayed[valid], model(seq.tokens)[valid], atol=1e-5, rtol=0)


def test_all_rows_ending_stops_the_loop_and_trims(model):
    first = rollout.generate(model, PROMPTS[:1], num_samples=3, max_new_tokens=8, temperature=0.0)
    eos = int(first.completion_ids[0, 0])
    out = rollout.generate(
        model, PROMPTS[:1], num_samples=3, max_new_tokens=8, temperature=0.0, eos_id=eos
    )
    assert out.completion_ids.tolist() == [[eos]] * 3 and out.completion_mask.all()


def test_prompt_layout_and_sequences(model):
    out = rollout.generate(
        model, PROMPTS, num_samples=2, max_new_tokens=6, temperature=1.0, pad_id=31, seed=4
    )
    longest = max(map(len, PROMPTS))
    assert out.prompt_ids.shape == (8, longest)
    for row in range(8):
        prompt = PROMPTS[row // 2]
        assert out.prompt_ids[row, longest - len(prompt) :].tolist() == prompt
        assert (out.prompt_ids[row, : longest - len(prompt)] == 31).all()
        assert out.prompt_mask[row].sum() == len(prompt) == out.prompt_lengths[row]
    seq = out.sequences()
    for row in range(8):
        prompt, completion = PROMPTS[row // 2], completion_list(out, row)
        n = len(prompt) + len(completion)
        assert (
            seq.tokens[row, :n].tolist() == prompt + completion
            and (seq.tokens[row, n:] == 31).all()
        )
        assert seq.valid_mask[row].sum() == n and seq.loss_mask[row, len(prompt) : n].all()


# ----------------------------------------------------------------------------------------- sampling
def test_same_seed_same_tokens_different_seed_different(model):
    kwargs = dict(num_samples=4, max_new_tokens=12, temperature=1.0, top_p=0.95)
    a = rollout.generate(model, PROMPTS, seed=11, **kwargs)
    b = rollout.generate(model, PROMPTS, seed=11, **kwargs)
    c = rollout.generate(model, PROMPTS, seed=12, **kwargs)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the G samples of one prompt differ from each other
    assert len({tuple(completion_list(a, g)) for g in range(4)}) > 1


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6)])
def test_top_k_one_and_tiny_top_p_are_greedy(model, truncation):
    greedy = rollout.generate(model, PROMPTS, num_samples=2, max_new_tokens=10, temperature=0.0)
    out = rollout.generate(
        model, PROMPTS, num_samples=2, max_new_tokens=10, temperature=0.8, seed=5, **truncation
    )
    assert torch.equal(out.completion_ids, greedy.completion_ids)


def test_truncate_keeps_the_smallest_set_reaching_top_p_after_top_k():
    logprobs = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept = lambda **kw: torch.isfinite(rollout.truncate(logprobs, **kw))[0].tolist()
    assert kept(top_p=0.49) == [False, True, False, False]
    assert kept(top_p=0.79) == [False, True, False, True]
    assert kept(top_p=0.81) == [True, True, False, True]
    assert kept(top_k=2) == [False, True, False, True]
    # (0.5+0.3)/0.95 < 0.9: the third survivor stays
    assert kept(top_k=3, top_p=0.9) == [True, True, False, True]
    assert kept(top_k=3, top_p=0.8) == [False, True, False, True]


def test_sampling_frequencies_follow_the_truncated_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0]).expand(40000, 5)
    noise = rollout.sampling_noise(
        torch.tensor([rollout.seed_key(0)]), torch.arange(40000), torch.tensor([0]), 5
    )
    tokens, logprobs = rollout.sample_tokens(logits, temperature=2.0, top_k=3, noise=noise)
    full = torch.log_softmax(logits[0] / 2.0, dim=-1)
    expected = torch.zeros(5)
    expected[:3] = torch.softmax(logits[0, :3] / 2.0, dim=-1)
    frequencies = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    mx, _ = report_diff(frequencies, expected, "sampled frequencies")
    assert mx < 0.01
    assert torch.equal(logprobs, full[tokens])  # the returned log-prob is the full tempered one


def _mix32_python(x):
    """The noise hash in plain Python integers (arbitrary precision, explicit mod 2^32): the
    oracle."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x1B873593) % 2**32
    return x ^ (x >> 16)


def _python_noise(seed, row, position, vocab):
    """E_v for v in 0..vocab-1 of one row id at one completion position, from the Python-integer
    hash: the oracle of rollout.sampling_noise."""
    key = _mix32_python((seed ^ (seed >> 32)) % 2**32)
    row_key = _mix32_python((key + row * 0x27D4EB2F + position * 0x165667B1) % 2**32)
    noise = []
    for v in range(vocab):
        x = _mix32_python((row_key + v * 0x61C88647) % 2**32)
        uniform = ((x >> 9) + 0.5) / 2**23
        noise.append(-math.log(uniform))
    return noise


def test_sampling_noise_matches_a_python_integer_oracle():
    seed, rows, position, vocab = 2**40 + 12345, [0, 1, 7, 1000], 5, 9
    key = rollout.seed_key(seed)
    assert key == _mix32_python((seed ^ (seed >> 32)) % 2**32)
    noise = rollout.sampling_noise_reference(
        torch.tensor([key]), torch.tensor(rows), torch.tensor([position]), vocab
    )
    for i, row in enumerate(rows):
        expected = _python_noise(seed, row, position, vocab)
        for v in range(vocab):
            assert noise[i, v].item() == pytest.approx(expected[v], rel=1e-6)


def sampled_without_cache(model, prompt, row_id, seed, max_new_tokens, temperature):
    """The slow twin of a sampled row: a full forward over the growing sequence for every token,
    the exponential race argmax(p / E) in float64 with the Python-integer noise of (seed, row id,
    completion position). No EOS, no truncation."""
    tokens = list(prompt)
    for position in range(max_new_tokens):
        logits = model(torch.tensor([tokens]))[0, -1].double()
        probs = torch.softmax(logits / temperature, dim=-1)
        noise = torch.tensor(_python_noise(seed, row_id, position, VOCAB), dtype=torch.float64)
        tokens.append(int((probs / noise).argmax()))
    return tokens[len(prompt) :]


@pytest.mark.cuda
def test_sampler_takes_the_fused_kernels_on_cuda_only_without_truncation(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = []
    original = rollout.sampling_kernels.sample_tokens

    def counted_sample_tokens(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(rollout.sampling_kernels, "sample_tokens", counted_sample_tokens)
    logits = torch.randn(64, 32768, device="cuda", dtype=torch.bfloat16)
    args = (
        torch.tensor([rollout.seed_key(5)], device="cuda"),
        torch.arange(64, device="cuda"),
        torch.tensor([9], device="cuda"),
    )
    for temperature, top_k, top_p, fused in (
        (1.0, 0, 1.0, True),
        (0.0, 0, 1.0, True),
        (1.0, 40, 1.0, False),
        (0.8, 0, 0.9, False),
    ):
        calls.clear()
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        tokens, logprobs = rollout.sample_next(logits, sampling, *args)
        assert bool(calls) == fused
        noise = None if temperature == 0 else rollout.sampling_noise(*args, logits.shape[-1])
        twin_tokens, twin_logprobs = rollout.sample_tokens(logits, temperature, top_k, top_p, noise)
        assert (tokens == twin_tokens).float().mean() > 0.98  # near-ties in fp32 may part, rarely
        same = tokens == twin_tokens
        torch.testing.assert_close(logprobs[same], twin_logprobs[same], rtol=0, atol=2e-5)


def test_noise_is_exponential_and_independent_across_rows_positions_and_seeds():
    def draw(seed, position):
        return rollout.sampling_noise(
            torch.tensor([rollout.seed_key(seed)]), torch.arange(2000), torch.tensor([position]), 64
        )

    e = draw(0, 0)
    assert abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03  # Exp(1) moments
    assert (e > 0).all() and torch.isfinite(e).all()
    for other in (draw(0, 1), draw(1, 0), draw(2**32, 0)):  # position, seed, seed >> 32
        assert abs(torch.corrcoef(torch.stack([e.flatten(), other.flatten()]))[0, 1].item()) < 0.01
    # neighbouring rows
    rows = torch.corrcoef(torch.stack([e[:-1].flatten(), e[1:].flatten()]))[0, 1].item()
    assert abs(rows) < 0.01


def test_sampled_rows_do_not_depend_on_the_rest_of_the_batch(model):
    """A row's samples are a function of its prompt, the seed and its row id alone: every row of a
    batch, and of a slice of it sampled with row_offset, holds the tokens a cache-free sampler draws
    for that row id on its own, which is what lets each torchrun rank sample its own groups."""
    seed = 3
    kwargs = dict(num_samples=2, max_new_tokens=10, temperature=1.0, seed=seed)
    batch = rollout.generate(model, PROMPTS, **kwargs)
    for p, prompt in enumerate(PROMPTS):
        alone = rollout.generate(model, [prompt], row_offset=2 * p, **kwargs)
        for g in range(2):
            row = 2 * p + g
            expected = sampled_without_cache(model, prompt, row, seed, 10, 1.0)
            assert completion_list(batch, row) == expected, f"row {row} in the batch"
            assert completion_list(alone, g) == expected, f"row {row} alone"
            torch.testing.assert_close(alone.logprobs[g], batch.logprobs[row], atol=1e-5, rtol=0)
    # prompt 0 under row ids 2 and 3 draws those ids' noise, not that of its rows in the batch
    shifted = rollout.generate(model, PROMPTS[:1], row_offset=2, **kwargs)
    for g in range(2):
        expected = sampled_without_cache(model, PROMPTS[0], 2 + g, seed, 10, 1.0)
        assert completion_list(shifted, g) == expected, f"row id {2 + g}"


def _alone_and_in_a_batch(model, n_others=63, **kwargs):
    """Row 0's rollout alone and in a batch with n_others random prompts (the same row id and
    seed)."""
    generator = torch.Generator().manual_seed(11)
    others = [
        torch.randint(1, VOCAB, (int(n),), generator=generator).tolist()
        for n in torch.randint(2, 16, (n_others,), generator=generator)
    ]
    kwargs = dict(num_samples=1, max_new_tokens=16, temperature=1.0, seed=5, **kwargs)
    alone = rollout.generate(model, PROMPTS[:1], **kwargs)
    in_a_batch = rollout.generate(model, PROMPTS[:1] + others, **kwargs)
    return alone, in_a_batch


@pytest.mark.parametrize("mode", ["nvfp4", "w16a4"])
def test_row_scales_make_a_quantized_rows_rollout_independent_of_its_batch(mode):
    """Per tensor, a token's NVFP4 rounding depends on the largest value anywhere in its decode
    batch; per row, on its own row only: the row's tokens are the same alone and among 63 other
    rows, and its log-probs differ by the fp32 order of the model's GEMMs only (as a BF16 rollout's
    do; those are not batch-invariant on the CPU either)."""
    import rac

    for act_scale in ("row", "tensor"):
        model = rac.convert_for_rollout(peaked_model(), mode, act_scale=act_scale)
        alone, batch = _alone_and_in_a_batch(model)
        same_tokens = completion_list(alone, 0) == completion_list(batch, 0)
        gap = math.inf
        if same_tokens:
            gap = (alone.logprobs[0] - batch.logprobs[0]).abs().max().item()
        verdict = "equal" if same_tokens else "differ"
        print(f"{mode} {act_scale}: tokens {verdict}, max |dlogp| {gap:.2e}")
        assert (same_tokens and gap < 1e-5) == (act_scale == "row"), act_scale


@pytest.mark.cuda
def test_cuda_row_scales_make_a_rows_rollout_independent_of_its_batch():
    import rac

    gaps = {}
    for act_scale in ("row", "tensor"):
        model = rac.convert_for_rollout(
            peaked_model(device="cuda", dtype=torch.bfloat16), "nvfp4", act_scale=act_scale
        )
        alone, batch = _alone_and_in_a_batch(model)
        assert alone.used_cuda_graph and batch.used_cuda_graph
        gaps[act_scale] = math.inf
        if completion_list(alone, 0) == completion_list(batch, 0):
            gaps[act_scale] = (alone.logprobs[0] - batch.logprobs[0]).abs().max().item()
    print("H200 row 0 alone vs among 63 others, max |dlogp|:", gaps)
    # row: bit-identical (the GPU GEMMs' order is M-free)
    assert gaps["row"] == 0.0 and gaps["tensor"] > 0.0


# ---------------------------------------------------------------------------------- arguments, pool
def _generate(**kwargs):
    """rollout.generate on valid defaults with kwargs replacing some of them, as a call given the
    model."""
    arguments = dict(prompts=[[1, 2, 3, 4, 5]], num_samples=2, max_new_tokens=4)
    arguments.update(kwargs)
    return lambda model: rollout.generate(model, **arguments)


# (id, call given the model, exception, what the message names, the problem it states)
BAD_CALLS = [
    (
        "negative temperature",
        _generate(temperature=-0.5),
        ValueError,
        "temperature",
        "must be >= 0 (0 = greedy), got -0.5",
    ),
    ("nan temperature", _generate(temperature=float("nan")), ValueError, "temperature", "got nan"),
    ("empty prompt", _generate(prompts=[[1, 2], []]), ValueError, "prompt 1", "is empty"),
    ("no prompts", _generate(prompts=[]), ValueError, "prompts", "must be a non-empty list"),
    (
        "id = vocab",
        _generate(prompts=[[1, VOCAB]]),
        ValueError,
        "prompts[0]",
        "token id 32, outside [0, 32)",
    ),
    (
        "negative id",
        _generate(prompts=[[1, 2], [3, -1]]),
        ValueError,
        "prompts[1]",
        "token id -1, outside [0, 32)",
    ),
    (
        "id past vocab in a tensor",
        _generate(prompts=[torch.tensor([1, VOCAB + 5])]),
        ValueError,
        "prompts[0]",
        "token id 37, outside",
    ),
    (
        "float ids",
        _generate(prompts=[[1.0, 2.7]]),
        TypeError,
        "prompts[0]",
        "must hold integer token ids, got 1.0",
    ),
    (
        "float id, second prompt",
        _generate(prompts=[[1, 2], [3, 4.5]]),
        TypeError,
        "prompts[1]",
        "must hold integer token ids, got 4.5",
    ),
    (
        "None id",
        _generate(prompts=[[1, None]]),
        TypeError,
        "prompts[0]",
        "must hold integer token ids, got None",
    ),
    (
        "bool id",
        _generate(prompts=[[True, 2]]),
        TypeError,
        "prompts[0]",
        "must hold integer token ids, got True",
    ),
    (
        "float tensor",
        _generate(prompts=[torch.tensor([1.0, 2.0])]),
        TypeError,
        "prompts[0]",
        "must be a 1-D integer tensor of token ids, got torch.float32",
    ),
    (
        "2-D tensor",
        _generate(prompts=[torch.tensor([[1, 2]])]),
        TypeError,
        "prompts[0]",
        "must be a 1-D integer tensor of token ids, got torch.int64 of shape (1, 2)",
    ),
    (
        "text prompt",
        _generate(prompts=["123"]),
        TypeError,
        "prompts[0]",
        "must be a list of integer token ids, got str (encode",
    ),
    (
        "num_samples",
        _generate(num_samples=0),
        ValueError,
        "num_samples",
        "must be an int >= 1, got 0",
    ),
    (
        "max_new_tokens",
        _generate(max_new_tokens=0),
        ValueError,
        "max_new_tokens",
        "must be an int >= 1, got 0",
    ),
    (
        "too long",
        _generate(max_new_tokens=60),
        ValueError,
        "max_new_tokens (60)",
        "exceeds the model's max_seq_len=64",
    ),
    ("top_p 0", _generate(top_p=0.0), ValueError, "top_p", "must be in (0, 1], got 0.0"),
    ("top_p above 1", _generate(top_p=1.5), ValueError, "top_p", "must be in (0, 1], got 1.5"),
    ("top_k", _generate(top_k=-1), ValueError, "top_k", "must be an int >= 0 (0 = off), got -1"),
    (
        "eos_id = vocab",
        _generate(eos_id=VOCAB),
        ValueError,
        "eos_id",
        "a token id in [0, 32), got 32",
    ),
    (
        "float eos_id",
        _generate(eos_id=6.5),
        TypeError,
        "eos_id",
        "must be None or an integer token id, got 6.5",
    ),
    (
        "str eos_id",
        _generate(eos_id="3"),
        TypeError,
        "eos_id",
        "must be None or an integer token id, got '3'",
    ),
    (
        "negative pad_id",
        _generate(pad_id=-1),
        ValueError,
        "pad_id",
        "must be a token id in [0, 32)",
    ),
    (
        "float pad_id",
        _generate(pad_id=1.5),
        TypeError,
        "pad_id",
        "must be an integer token id, got 1.5",
    ),
    (
        "tensor pad_id",
        _generate(pad_id=torch.tensor(1.0)),
        TypeError,
        "pad_id",
        "must be an integer token id",
    ),
    (
        "score float tokens",
        lambda model: rollout.score(model, torch.zeros(2, 3)),
        ValueError,
        "tokens",
        "must be an integer tensor (N, W)",
    ),
    (
        "score one column",
        lambda model: rollout.score(model, torch.zeros(2, 1, dtype=torch.long)),
        ValueError,
        "tokens",
        "must have at least 2 columns",
    ),
    (
        "score temperature",
        lambda model: rollout.score(model, torch.zeros(2, 3, dtype=torch.long), temperature=-1.0),
        ValueError,
        "temperature",
        "must be >= 0 (0 = untempered), got -1.0",
    ),
]


@pytest.mark.parametrize(
    "call, error, names, problem",
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(
    model, call, error, names, problem
):
    raises_one_line(lambda: call(model), names, problem, error)


def test_integer_prompts_of_any_integer_kind_give_the_same_tokens(model):
    """Lists, tuples, int64/int32 tensors and 0-d integer ids are the same prompt: no float path
    sneaks in."""
    as_list = rollout.generate(model, [[1, 2, 3]], 2, 4, eos_id=5, pad_id=0, seed=3)
    for prompts, eos_id, pad_id in (
        ([(1, 2, 3)], 5, 0),
        ([torch.tensor([1, 2, 3])], torch.tensor(5), 0),
        ([torch.tensor([1, 2, 3], dtype=torch.int32)], 5, torch.tensor(0)),
    ):
        out = rollout.generate(model, prompts, 2, 4, eos_id=eos_id, pad_id=pad_id, seed=3)
        assert torch.equal(out.completion_ids, as_list.completion_ids)


def test_decode_state_is_reused_and_dropped_when_weights_are_replaced():
    model = peaked_model(seed=1)
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
    rollout.generate(model, PROMPTS, num_samples=2, max_new_tokens=5)
    state = rollout.get_decode_state(model, 8, 16, 5, sampling, cuda_graph=False)
    # same shapes: same buffers
    rollout.generate(model, [[3, 4, 5]], num_samples=8, max_new_tokens=5, seed=9)
    assert rollout.last_decode_state(model) is state
    # another shape: its own state
    rollout.generate(model, [[3, 4, 5]], num_samples=3, max_new_tokens=5)
    assert rollout.last_decode_state(model).tokens.shape[0] == 3
    rollout.generate(model, [[3, 4, 5]], num_samples=8, max_new_tokens=5)
    assert rollout.last_decode_state(model) is state  # the latest call's, again
    # a weight replaced (not copied in place) makes every pooled state stale
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))
    out = rollout.generate(model, PROMPTS, num_samples=1, max_new_tokens=5, temperature=0.0)
    assert rollout.last_decode_state(model) is not state
    assert rollout.get_decode_state(model, 8, 16, 5, sampling, cuda_graph=False) is not state
    assert completion_list(out, 0) == greedy_without_cache(model, PROMPTS[0], 5)
    rollout.free_decode_states(model)
    assert rollout.last_decode_state(model) is None


def test_rollout_through_rac_fp8_layers_matches_their_forward():
    # FP8 scales activations per token, so a decode step computes each token as the full
    # forward does: the cached sampler with quantized layers must reproduce that forward's
    # log-probs and routes
    import rac

    model = rac.convert_for_rollout(peaked_model(), "fp8")
    out = rollout.generate(model, PROMPTS, num_samples=2, max_new_tokens=8, temperature=1.0, seed=0)
    seq = out.sequences()
    mx, _ = report_diff(
        seq.logprobs[:, 1:], trainer_logprobs(model, seq, 1.0), "fp8 rollout vs fp8 forward"
    )
    assert mx < 1e-3
    _, routes = model(seq.tokens, return_routes=True)
    assert torch.equal(seq.routes[:, seq.valid_mask], routes[:, seq.valid_mask])


# --------------------------------------------------------------------------------------------- CUDA
def _graph_and_eager(model, **kwargs):
    graph = rollout.generate(model, PROMPTS * 4, cuda_graph=True, **kwargs)
    eager = rollout.generate(model, PROMPTS * 4, cuda_graph=False, **kwargs)
    assert graph.used_cuda_graph and not eager.used_cuda_graph
    return graph, eager


@pytest.mark.cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graph_decode_equals_eager_decode(temperature):
    model = peaked_model(device="cuda", dtype=torch.bfloat16)
    graph, eager = _graph_and_eager(
        model,
        num_samples=4,
        max_new_tokens=40,
        temperature=temperature,
        top_p=0.9,
        eos_id=3,
        seed=7,
    )
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    assert torch.equal(graph.logprobs, eager.logprobs) and torch.equal(graph.routes, eager.routes)
    again = rollout.generate(
        model,
        PROMPTS * 4,
        num_samples=4,
        max_new_tokens=40,
        temperature=temperature,
        top_p=0.9,
        eos_id=3,
        seed=7,
    )
    assert torch.equal(again.completion_ids, graph.completion_ids)
    # BF16 rollout against the BF16 trainer forward on the same tokens: small, not bit-exact
    # (different kernels)
    seq = graph.sequences()
    mx, mean = report_diff(
        seq.logprobs[:, 1:][seq.loss_mask[:, 1:]],
        trainer_logprobs(model, seq, temperature)[seq.loss_mask[:, 1:]],
        "bf16 rollout vs trainer",
    )
    assert mean < 0.05


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode,rac_ratio", [("bf16", 0.0), ("fp8", 0.0), ("nvfp4", 0.0), ("nvfp4", 0.5)]
)
def test_cuda_graph_captures_rac_rollout_layers(mode, rac_ratio):
    import rac

    model = peaked_model(device="cuda", dtype=torch.bfloat16)
    rac.convert_for_rollout(model, mode, rac_ratio=rac_ratio)
    graph, eager = _graph_and_eager(
        model, num_samples=4, max_new_tokens=24, temperature=1.0, seed=3
    )
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    assert torch.equal(graph.logprobs, eager.logprobs)


# -------------------------------------------------------------------------------------------- score
def score_without_batching(model, tokens, temperature):
    """The slow twin of rollout.score: every row alone, every position from a forward over its own
    prefix."""
    expected = torch.zeros(tokens.shape)
    for row in range(tokens.shape[0]):
        for j in range(1, tokens.shape[1]):
            logits = model(tokens[row : row + 1, :j])[0, -1].float()
            if temperature > 0:
                logits = logits / temperature
            logprobs = torch.log_softmax(logits, dim=-1)
            expected[row, j] = logprobs[tokens[row, j]]
    return expected


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_score_equals_per_prefix_forwards_and_the_sampler_recorded_logprobs(
    model, temperature, monkeypatch
):
    out = rollout.generate(
        model, PROMPTS, num_samples=2, max_new_tokens=8, temperature=temperature, seed=5
    )
    seq = out.sequences()
    scored = rollout.score(model, seq.tokens, temperature)
    assert scored.shape == seq.tokens.shape and scored.dtype == torch.float32
    assert (scored[:, 0] == 0).all()
    mask = seq.loss_mask
    slow = score_without_batching(model, seq.tokens, temperature)
    report_diff(scored[mask], slow[mask], "score vs per-prefix forwards")
    torch.testing.assert_close(scored[mask], slow[mask], atol=2e-5, rtol=0)
    # fp32 and no quantized layers: one prefill re-scores what decoding recorded, up to the order
    # of summation
    torch.testing.assert_close(scored[mask], seq.logprobs[mask], atol=2e-5, rtol=0)
    # rows in chunks of the logits budget: the same values
    monkeypatch.setattr(rollout, "PREFILL_LOGITS_BUDGET", seq.tokens.shape[1] * VOCAB * 3)
    chunked = rollout.score(model, seq.tokens, temperature)
    torch.testing.assert_close(chunked[mask], scored[mask], atol=2e-5, rtol=0)
