"""grpo.py: every formula against hand-computed numbers, on tiny CPU tensors."""

import math

import pytest
import torch

from conftest import raises_one_line
from grpo import (
    LOG_RATIO_LIMIT,
    group_advantages,
    mipu_proxy,
    mismatch_metrics,
    policy_loss,
    routing_disagreement,
    sampled_entropy,
)


# -----------------------------------------------------------------------------
# group_advantages


def test_group_advantages_population_std_and_zero_spread_group():
    # group 0: mean 0.5, population std 0.5; group 1: no spread, so exactly zero
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 0.7, 0.7, 0.7])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    assert torch.equal(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert adv.dtype == torch.float32

    # G = 3, rewards (0, 0, 1): mean 1/3, population std sqrt(2)/3
    adv = group_advantages(torch.tensor([0.0, 0.0, 1.0]), group_size=3, eps=0.0)
    expected = torch.tensor([-1 / 3, -1 / 3, 2 / 3]) / (math.sqrt(2) / 3)
    torch.testing.assert_close(adv, expected)


def test_group_advantages_without_std_is_centred_reward():
    rewards = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2, 0.2])
    adv = group_advantages(rewards, group_size=3, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.0, 0.5, 0.0, 0.0, 0.0]))


def test_group_advantages_eps_bounds_tiny_spread():
    adv = group_advantages(torch.tensor([0.0, 1e-9]), group_size=2, eps=1e-6)
    assert adv.abs().max() < 1e-2  # a near-tie is not blown up into +-1


# -----------------------------------------------------------------------------
# policy_loss


def _one_token_each(ratios, advantages):
    """N sequences of one valid token each, with the given ratios pi_theta / pi_old."""
    old = torch.full((len(ratios), 1), -1.0)
    logprobs = (old + torch.log(torch.tensor(ratios)).unsqueeze(1)).requires_grad_()
    return logprobs, old, torch.tensor(advantages), torch.ones(len(ratios), 1, dtype=torch.bool)


def test_policy_loss_clip_on_both_sides_for_both_signs():
    # (ratio, A):  (1.5, +1) clipped at 1+0.28   -> -1.28, no gradient
    #              (0.5, +1) below 1-0.2, A > 0  -> -0.5, gradient flows (min keeps the unclipped)
    #              (0.5, -2) clipped at 1-0.2    -> +1.6, no gradient
    #              (1.5, -2) above 1+0.28, A < 0 -> +3.0, gradient flows
    logprobs, old, adv, mask = _one_token_each([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -2.0, -2.0])
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor((-1.28 - 0.5 + 1.6 + 3.0) / 4))
    loss.backward()
    # d/dlogp of -ratio * A / 4 = -ratio * A / 4 on the unclipped tokens
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [-0.5 / 4], [0.0], [3.0 / 4]]))
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(0.25)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(0.5)
    assert stats["ratio/mean"].item() == pytest.approx(1.0)
    assert stats["ratio/max"].item() == pytest.approx(1.5)
    assert stats["ratio/min"].item() == pytest.approx(0.5)
    # K3 of KL(old || new) over the four tokens: exp(-log r) + log r - 1
    k3 = sum(1 / r + math.log(r) - 1 for r in (1.5, 0.5, 0.5, 1.5)) / 4
    assert stats["approx_kl"].item() == pytest.approx(k3, rel=1e-6)
    assert all(value.dim() == 0 and not value.requires_grad for value in stats.values())


def test_policy_loss_at_ratio_one_is_minus_advantage():
    logprobs, old, adv, mask = _one_token_each([1.0, 1.0], [2.0, -0.5])
    loss, stats = policy_loss(logprobs, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor((-2.0 + 0.5) / 2))
    assert stats["clip_ratio/region_mean"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_dapo_token_level_normalization_across_lengths():
    # Sequence 0: 1 valid token, A = +1; sequence 1: 3 valid tokens, A = -1; ratio 1 everywhere.
    # Token-level: (-1 + 1 + 1 + 1) / 4 = 0.5. (A per-sequence mean would give (-1 + 1) / 2 = 0.)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]))


def test_num_valid_tokens_makes_micro_batches_sum_to_full_batch():
    torch.manual_seed(0)
    logprobs, old = -torch.rand(4, 5), -torch.rand(4, 5)
    mask = torch.rand(4, 5) > 0.3
    adv = torch.randn(4)
    full, _ = policy_loss(logprobs, old, adv, mask)
    total = mask.sum().item()
    halves = [
        policy_loss(logprobs[rows], old[rows], adv[rows], mask[rows], num_valid_tokens=total)[0]
        for rows in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(halves[0] + halves[1], full)


def test_padding_garbage_never_reaches_loss_or_gradient():
    mask = torch.tensor([[True, False], [True, True]])
    logprobs = torch.tensor([[-1.0, float("nan")], [-0.5, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")], [-0.5, -2.0]])
    rollout = torch.tensor([[-1.0, 50.0], [-0.5, -2.0]])
    ref = torch.tensor([[-1.0, float("inf")], [-0.5, -2.0]])
    loss, stats = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0, -1.0]),
        mask,
        rollout_logprobs=rollout,
        tis_cap=2.0,
        ref_logprobs=ref,
        kl_coef=0.1,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1] == 0
    assert all(torch.isfinite(value) for value in stats.values())


def test_truncated_importance_sampling_weights():
    # old - rollout = log 3 -> weight min(3, 2) = 2;  log 0.5 -> weight 0.5. Ratio 1, A = +1.
    logprobs, old, adv, mask = _one_token_each([1.0, 1.0], [1.0, 1.0])
    rollout = old - torch.log(torch.tensor([[3.0], [0.5]]))
    loss, stats = policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0)
    torch.testing.assert_close(loss, torch.tensor(-(2.0 + 0.5) / 2))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0 / 2], [-0.5 / 2]]))
    # constant per batch: mismatch_metrics logs it
    assert not any(name.startswith("tis") for name in stats)

    # Without a cap, rollout log-probs are ignored.
    plain, _ = policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout)
    torch.testing.assert_close(plain, torch.tensor(-1.0))


def test_clip_acts_on_new_over_old_and_the_weight_on_old_over_rollout():
    # Decoupled: token 0 has new/old = 1.5 (clipped at 1.28, A > 0) and old/rollout = 3 (weight
    # capped at 2); token 1 has new/old = 1 and old/rollout = 0.5. The clip must not see the
    # rollout's log-probs, and the weight must not see the current policy's.
    old = torch.tensor([[-1.0], [-1.0]])
    logprobs = (old + torch.log(torch.tensor([[1.5], [1.0]]))).requires_grad_()
    rollout = old - torch.log(torch.tensor([[3.0], [0.5]]))
    adv, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 1, dtype=torch.bool)
    loss, stats = policy_loss(
        logprobs,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        rollout_logprobs=rollout,
        tis_cap=2.0,
    )
    torch.testing.assert_close(loss, torch.tensor(-(2.0 * 1.28 + 0.5 * 1.0) / 2))
    loss.backward()
    # token 0 is clipped: no gradient
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [-0.5 / 2]]))
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(0.5)


def test_clip_fraction_responds_to_clip_high():
    # ratios spread around 1, half the advantages positive: a wider upper clip clips fewer tokens
    torch.manual_seed(0)
    old = -torch.rand(8, 16)
    logprobs = old + 0.3 * torch.randn(8, 16)
    adv, mask = torch.tensor([1.0, -1.0] * 4), torch.ones(8, 16)
    fractions = [
        policy_loss(logprobs, old, adv, mask, clip_high=c)[1]["clip_ratio/high_mean"].item()
        for c in (0.05, 0.28, 10.0)
    ]
    expected = [
        ((logprobs - old).exp()[::2] > 1 + c).float().sum().item() / 128 for c in (0.05, 0.28, 10.0)
    ]
    assert fractions == pytest.approx(expected)
    assert fractions[0] > fractions[1] > fractions[2] == 0.0


def test_k3_kl_to_reference():
    # ref - logp = log 2: k3 = 2 - log 2 - 1; d k3 / d logp = 1 - exp(ref - logp) = -1. A = 0.
    logprobs = torch.full((1, 1), math.log(0.25), requires_grad=True)
    ref = torch.full((1, 1), math.log(0.5))
    loss, stats = policy_loss(
        logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.1
    )
    k3 = 2.0 - math.log(2.0) - 1.0
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(k3, rel=1e-6)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-0.1, rel=1e-6)


def test_gradient_flows_only_through_logprobs():
    torch.manual_seed(0)
    shape = (4, 3)
    logprobs = (-torch.rand(shape)).requires_grad_()
    others = {name: (-torch.rand(shape)).requires_grad_() for name in ("old", "rollout", "ref")}
    adv = torch.randn(4, requires_grad=True)
    loss, _ = policy_loss(
        logprobs,
        others["old"],
        adv,
        torch.ones(shape),
        rollout_logprobs=others["rollout"],
        tis_cap=2.0,
        ref_logprobs=others["ref"],
        kl_coef=0.05,
    )
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    assert adv.grad is None and all(tensor.grad is None for tensor in others.values())


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_abs_a():
    # (ratio, A) with c = 3:  (5, -1)  PPO's loss 5 > 3 * 1: capped at 3, no gradient
    #                         (2, -1)  loss 2 < 3: unchanged, gradient -A * ratio / 4 = 2 / 4
    #                         (5, +1)  clipped at 1 + 0.28 as before: -1.28, no gradient
    #                         (6, -0.5) loss 3 > 3 * 0.5: capped at 1.5, no gradient
    logprobs, old, adv, mask = _one_token_each([5.0, 2.0, 5.0, 6.0], [-1.0, -1.0, 1.0, -0.5])
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 + 2.0 - 1.28 + 1.5) / 4))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [2.0 / 4], [0.0], [0.0]]))
    assert stats["clip_ratio/dual_mean"].item() == pytest.approx(2 / 4)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 4)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(3 / 4)

    # without it (the default) the loss of a negative advantage grows with the ratio, as in PPO
    plain, plain_stats = policy_loss(logprobs.detach(), old, adv, mask)
    torch.testing.assert_close(plain, torch.tensor((5.0 + 2.0 - 1.28 + 3.0) / 4))
    assert plain_stats["clip_ratio/dual_mean"].item() == 0.0


def test_extreme_log_ratios_give_a_finite_loss_and_gradient():
    # log-ratios far past fp32's exp overflow (88.7), both signs of A, with and without dual-clip:
    # every exp sees a log-ratio clamped to +-20, where a token's term is constant (zero gradient).
    limit = LOG_RATIO_LIMIT
    log_ratios = [25.0, 100.0, 1000.0, -100.0, 0.5]
    advantages = [-1.0, -1.0, 1.0, 1.0, -1.0]
    old = torch.full((5, 1), -3.0)
    logprobs = (old + torch.tensor(log_ratios).unsqueeze(1)).requires_grad_()
    adv, mask = torch.tensor(advantages), torch.ones(5, 1)
    # hand-computed per-token losses: (25, -1) and (100, -1) weigh exp(20) each without dual-clip
    # and 3 with it; (1000, +1) is clipped at 1.28; (-100, +1) is -exp(-20); (0.5, -1) is exp(0.5)
    plain_tokens = [math.exp(limit), math.exp(limit), -1.28, -math.exp(-limit), math.exp(0.5)]
    dual_tokens = [3.0, 3.0, -1.28, -math.exp(-limit), math.exp(0.5)]
    for clip_ratio_c, tokens in ((None, plain_tokens), (3.0, dual_tokens)):
        logprobs.grad = None
        loss, stats = policy_loss(logprobs, old, adv, mask, clip_ratio_c=clip_ratio_c)
        loss.backward()
        assert loss.item() == pytest.approx(sum(tokens) / 5, rel=1e-6)
        # only the in-range token (0.5, -1) has a gradient: -A * exp(0.5) / 5
        expected_grad = torch.tensor([[0.0], [0.0], [0.0], [0.0], [math.exp(0.5) / 5]])
        torch.testing.assert_close(logprobs.grad, expected_grad)
        assert all(torch.isfinite(value) for value in stats.values())
        assert stats["ratio/max"].item() == pytest.approx(math.exp(limit), rel=1e-6)
        # K3 of KL(old || new) at log-ratio x: exp(-x) - 1 + x, x clamped
        clamped = [min(max(x, -limit), limit) for x in log_ratios]
        k3 = [math.expm1(-x) + x for x in clamped]
        assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 5, rel=1e-6)


def test_extreme_reference_and_rollout_log_ratios_give_a_finite_kl_and_weight():
    # ref - logp = 100: K3 = exp(20) - 20 - 1 (was inf in fp32, and its gradient NaN); = -100:
    # exp(-20) + 20 - 1. old - rollout = 100: the TIS weight is its cap. A = 0: only the KL counts.
    logprobs = torch.full((2, 1), -50.0, requires_grad=True)
    ref = logprobs.detach() + torch.tensor([[100.0], [-100.0]])
    rollout = logprobs.detach() - 100.0
    loss, stats = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.zeros(2),
        torch.ones(2, 1),
        rollout_logprobs=rollout,
        tis_cap=2.0,
        ref_logprobs=ref,
        kl_coef=0.5,
    )
    k3 = [math.exp(20) - 20 - 1, math.exp(-20) + 20 - 1]
    assert stats["kl"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 2, rel=1e-6)
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 1))  # both beyond the clamp: constant
    # a kl term is reported whenever a reference is given, and adds nothing at kl_coef 0
    no_kl, no_kl_stats = policy_loss(
        logprobs, logprobs.detach(), torch.ones(2), torch.ones(2, 1), ref_logprobs=ref
    )
    assert no_kl.item() == pytest.approx(-1.0) and no_kl_stats["kl"].item() == stats["kl"].item()


# -----------------------------------------------------------------------------
# sampled_entropy


def test_sampled_entropy_is_the_mean_negative_logprob_and_estimates_the_entropy():
    logprobs = torch.tensor([[-1.0, -2.0, 99.0], [-0.5, 99.0, 99.0]])  # the 99s are padding
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert sampled_entropy(logprobs, mask).item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    assert math.isnan(sampled_entropy(logprobs, torch.zeros(2, 3)).item())
    # tokens drawn from p: the mean of -log p(y) converges to H(p) = -sum p log p
    p = torch.tensor([0.7, 0.2, 0.05, 0.05], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p, 100_000, replacement=True, generator=generator).view(1, -1)
    entropy = -(p * p.log()).sum().item()
    estimate = sampled_entropy(p.log()[tokens].float(), torch.ones_like(tokens)).item()
    assert estimate == pytest.approx(entropy, abs=0.01)


# -----------------------------------------------------------------------------
# mismatch_metrics


def test_mismatch_metrics_identical_logprobs():
    logp = -torch.rand(3, 4) * 3
    metrics = mismatch_metrics(logp, logp.clone(), torch.ones(3, 4), tis_cap=2.0)
    for name in (
        "abs_diff_mean",
        "abs_diff_max",
        "abs_diff_p95",
        "abs_diff_p99",
        "diff_mean",
        "kl_k1",
        "kl_k3",
        "tis_clip_frac",
    ):
        assert metrics[name] == 0.0, name
    for name in ("is_ratio_min", "is_ratio_mean", "is_ratio_max", "tis_ratio_min", "tis_ratio_max"):
        assert metrics[name] == 1.0, name
    assert metrics["trainer_ppl"] == pytest.approx(math.exp(-logp.mean().item()))
    assert metrics["rollout_ppl"] == metrics["trainer_ppl"]
    assert metrics["num_tokens"] == 12
    assert all(isinstance(value, (int, float)) for value in metrics.values())


def test_mismatch_metrics_known_delta_and_masking():
    rollout = torch.full((2, 3), -1.0)
    trainer = rollout + torch.tensor([[0.1, -0.2, 99.0], [0.3, 0.0, -99.0]])  # the +-99 are padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    m = mismatch_metrics(trainer, rollout, mask, tis_cap=1.2)
    deltas = torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64)
    assert m["num_tokens"] == 4
    assert m["abs_diff_mean"] == pytest.approx(0.15)
    assert m["abs_diff_max"] == pytest.approx(0.3)
    assert m["abs_diff_p99"] == pytest.approx(torch.quantile(deltas.abs(), 0.99).item())
    assert m["abs_diff_p95"] == pytest.approx(torch.quantile(deltas.abs(), 0.95).item())
    assert m["diff_mean"] == pytest.approx(0.05)
    assert m["kl_k1"] == pytest.approx(-0.05)
    assert m["kl_k3"] == pytest.approx((deltas.exp() - 1 - deltas).mean().item())
    assert m["trainer_ppl"] == pytest.approx(math.exp(1.0 - 0.05))
    assert m["rollout_ppl"] == pytest.approx(math.e)
    assert m["is_ratio_min"] == pytest.approx(math.exp(-0.2))
    assert m["is_ratio_max"] == pytest.approx(math.exp(0.3))
    assert m["is_ratio_mean"] == pytest.approx(deltas.exp().mean().item())
    assert m["tis_ratio_max"] == pytest.approx(1.2)  # exp(0.3) = 1.35 truncated
    assert m["tis_ratio_mean"] == pytest.approx(deltas.exp().clamp(max=1.2).mean().item())
    assert m["tis_clip_frac"] == pytest.approx(0.25)
    assert "tis_ratio_max" not in mismatch_metrics(trainer, rollout, mask)


def test_k3_estimates_kl_of_rollout_to_trainer():
    # Tokens sampled from the rollout distribution q; trainer distribution p. K3 and K1 must
    # estimate KL(q || p) = 0.391, not KL(p || q) = 0.666.
    q = torch.tensor([0.9, 0.09, 0.01])
    p = torch.tensor([0.5, 0.3, 0.2])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=generator).view(1, -1)
    m = mismatch_metrics(p.log()[tokens], q.log()[tokens], torch.ones_like(tokens))
    kl_q_p = (q * (q / p).log()).sum().item()
    assert m["kl_k3"] == pytest.approx(kl_q_p, abs=0.01)
    assert m["kl_k1"] == pytest.approx(kl_q_p, abs=0.01)


def test_mismatch_metrics_empty_mask_is_nan_not_an_error():
    m = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), tis_cap=2.0)
    assert m["num_tokens"] == 0
    assert all(math.isnan(value) for name, value in m.items() if name != "num_tokens")


# -----------------------------------------------------------------------------
# routing_disagreement


def test_routing_disagreement_ignores_order_within_top_k():
    torch.manual_seed(0)
    L, N, T, E, A = 3, 2, 4, 16, 4
    trainer = torch.stack([torch.randperm(E)[:A] for _ in range(L * N * T)]).view(L, N, T, A)
    rollout = trainer.flip(-1)  # same sets, other order
    mask = torch.ones(N, T, dtype=torch.bool)
    assert routing_disagreement(trainer, rollout, mask) == 0.0

    # Layer 1 differs on every token: 1 of 3 layers. Padding differences are ignored.
    rollout = rollout.clone()
    rollout[1, ..., 0] = E + 1
    mask[:, -1] = False
    rollout[:, :, -1] = E + 2  # only in padding
    assert routing_disagreement(trainer, rollout, mask) == pytest.approx(1 / 3)
    assert routing_disagreement(trainer, rollout, mask, any_layer=True) == 1.0
    assert math.isnan(routing_disagreement(trainer, rollout, torch.zeros(N, T)))


# -----------------------------------------------------------------------------
# mipu_proxy


def test_mipu_proxy_is_the_advantage_weighted_change_of_the_inference_policy():
    # tokens of a positive-advantage sequence become twice as likely, those of a negative one half
    # as likely
    current = torch.full((2, 3), -2.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    better = current + torch.tensor([[math.log(2)] * 3, [math.log(0.5)] * 3])
    better[0, 2] = 50.0  # padding: ignored
    # (1 * (2 - 1) * 2 tokens + (-0.5) * (0.5 - 1) * 3 tokens) / 5 tokens
    assert mipu_proxy(better, current, adv, mask) == pytest.approx((2.0 + 0.75) / 5)
    # the opposite move: the inference policy got worse on the batch -> negative (reject)
    worse = current - (better - current)
    assert mipu_proxy(worse, current, adv, mask) == pytest.approx(
        (2 * (0.5 - 1) - 0.5 * (2 - 1) * 3) / 5
    )
    assert mipu_proxy(worse, current, adv, mask) < 0 < mipu_proxy(better, current, adv, mask)
    assert mipu_proxy(current, current, adv, mask) == 0.0  # no change
    assert mipu_proxy(better, current, adv, torch.zeros(2, 3)) == 0.0


# -----------------------------------------------------------------------------
# bad input

LOGPROBS = torch.zeros(2, 3)
MASK = torch.ones(2, 3)
ROUTES = torch.zeros(2, 3, 4, 2, dtype=torch.long)
BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "rewards not in groups",
        lambda: group_advantages(torch.zeros(7), group_size=4),
        "group_size=4",
        "shape (7,) do not split into groups",
    ),
    (
        "rewards 2-D",
        lambda: group_advantages(torch.zeros(2, 4), group_size=4),
        "rewards",
        "1-D (N,), got shape (2, 4)",
    ),
    (
        "old_logprobs shape",
        lambda: policy_loss(LOGPROBS, torch.zeros(2, 4), torch.zeros(2), MASK),
        "old_logprobs",
        "shape (2, 4) but logprobs has shape (2, 3)",
    ),
    (
        "advantages shape",
        lambda: policy_loss(LOGPROBS, LOGPROBS, torch.zeros(3), MASK),
        "advantages",
        "(N,) = (2,), got shape (3,)",
    ),
    (
        "mask shape",
        lambda: policy_loss(LOGPROBS, LOGPROBS, torch.zeros(2), torch.ones(3, 2)),
        "mask",
        "shape (3, 2) but logprobs has shape (2, 3)",
    ),
    (
        "tis_cap without rollout_logprobs",
        lambda: policy_loss(LOGPROBS, LOGPROBS, torch.zeros(2), MASK, tis_cap=2.0),
        "rollout_logprobs",
        "tis_cap needs",
    ),
    (
        "clip_ratio_c not above 1",
        lambda: policy_loss(LOGPROBS, LOGPROBS, torch.zeros(2), MASK, clip_ratio_c=1.0),
        "clip_ratio_c",
        "must be > 1",
    ),
    (
        "kl_coef without ref_logprobs",
        lambda: policy_loss(LOGPROBS, LOGPROBS, torch.zeros(2), MASK, kl_coef=0.1),
        "ref_logprobs",
        "kl_coef > 0 needs",
    ),
    (
        "mismatch shapes",
        lambda: mismatch_metrics(LOGPROBS, torch.zeros(2, 4), MASK),
        "rollout_logprobs",
        "shape (2, 4) but trainer_logprobs has shape (2, 3)",
    ),
    (
        "routes shapes",
        lambda: routing_disagreement(
            ROUTES, torch.zeros(2, 3, 4, 3, dtype=torch.long), torch.ones(3, 4)
        ),
        "routes",
        "of one shape (L, N, T, A), got (2, 3, 4, 2) and (2, 3, 4, 3)",
    ),
    (
        "token_mask shape",
        lambda: routing_disagreement(ROUTES, ROUTES, torch.ones(3, 5)),
        "token_mask",
        "shape (3, 5) but routes (2, 3, 4, 2) need (N, T) = (3, 4)",
    ),
    (
        "mipu logprobs shapes",
        lambda: mipu_proxy(LOGPROBS, torch.zeros(2, 4), torch.zeros(2), MASK),
        "current_logprobs",
        "shape (2, 4) but candidate_logprobs has shape (2, 3)",
    ),
    (
        "mipu advantages shape",
        lambda: mipu_proxy(LOGPROBS, LOGPROBS, torch.zeros(3), MASK),
        "advantages",
        "(N,) = (2,), got shape (3,)",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)
