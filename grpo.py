"""GRPO on tensors: group advantages, the clipped token-level loss, truncated importance sampling,
the MIPU acceptance proxy and the train/rollout mismatch metrics. Pure functions of tensors:
train.py (read after rollout.py) runs the models and hands the log-probs over.

Group advantages. Each prompt is sampled G times; a completion is measured against its own group,
    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)          population std (unbiased=False)
and a group whose rewards are all equal gets exactly A = 0 (no signal, no gradient).

Three policies, kept apart by name: `rollout_logprobs` (log pi_rollout: what the NVFP4/FP8/BF16
engine scored while it sampled, the probabilities the tokens were drawn from); `old_logprobs` (log
pi_old: the trainer under the weights that sampled, once, without gradient; with perfect numerics
old == rollout, and their gap is the mismatch this project studies); `logprobs` (log pi_theta: the
trainer now, carrying the gradient; from a batch's second mini-batch on, theta has moved and
pi_theta / pi_old departs from 1).

Policy loss: PPO's clip with DAPO's clip-higher, dual-clip for negative advantages, token-level
normalization, and the engine's mismatch corrected separately (decoupled, as in verl's and slime's
rollout correction):
    ratio_t = exp(logp_t - logp_old_t)                   the update so far (PPO)
    w_t     = min(pi_old / pi_rollout, C), detached      the engine's mismatch (TIS, C = 2 in verl)
    clip_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
    pg_t    = w_t * (min(clip_t, c * |A|) if A < 0 else clip_t)     dual-clip, c = clip_ratio_c
    loss    = sum_{valid t} pg_t / (valid tokens)  +  kl_coef * sum_{valid t} k3_t / (valid tokens)
Without `tis_cap`, w_t = 1; without `clip_ratio_c`, pg_t = w_t * clip_t; with one mini-batch per
rollout batch, ratio = 1 and only w_t remains. Every valid token weighs the same (DAPO), not each
sequence. The KL to a reference policy (GRPO's reference term, off by default) uses K3:
k3_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1 >= 0.

Guards against a runaway ratio, the regime a collapsing FP4 rollout produces. PPO's clip leaves a
token with A < 0 unbounded above: its loss is ratio * |A|, so one token at a log-ratio of 25 weighs
7e10, and past 88.7 the fp32 exp is inf. Dual-clip (Ye et al. 2020; verl's clip_ratio_c, 3 by
default) caps that loss at c * |A|, where its gradient is zero. Every log-ratio is also clamped to
+-LOG_RATIO_LIMIT (20, as in verl) before its exp, in the loss, the TIS weight and both KL terms, so
no exp overflows; beyond the clamp a token's term is a constant (no gradient), as the clip makes it
anyway for every token but one with A < 0 and no dual-clip.

MIPU's acceptance proxy (the objective is the rollout policy mu, which samples and is deployed):
after a candidate update is synced, the rollout model re-scores the batch (mu' against mu, both
prefill scores, so decode/prefill differences cancel) and the candidate is kept only if
    proxy = sum_{valid t} A_t * (mu'_t / mu_t - 1) / (valid tokens)  >  0,
the first-order term of the policy-improvement identity (in-sample, so optimistic, without the
trust-region penalty): it rejects updates that do not move the *inference* policy the way the
advantages ask.

Mismatch metrics (completion tokens only), with d_t = logp_train_t - logp_rollout_t: |d| mean, max,
p95, p99 and the signed mean; KL(pi_rollout || pi_train) as K1 = mean(-d) and K3 = mean(exp(d) - 1 -
d) (unbiased too, since E_rollout[exp(d)] = 1, and >= 0 per token: far less variance; verl's
direction); trainer and rollout perplexity; exp(d) min, mean, max before and after the TIS cap; for
MoE the fraction of (token, layer) pairs whose chosen experts differ (`routing_disagreement`).

Shapes: N = P prompts x G samples, prompt-major (rows p*G .. p*G+G-1 are one group); T completion
length (padded), mask (N, T) the valid tokens; V vocabulary; L MoE layers; A active experts per
token.

Entropy, for logging only: from the sampled tokens' log-probs alone (all the rollout engine
reports), the Monte-Carlo estimate mean_t(-log p(y_t)), unbiased since E_{y ~ p}[-log p(y)] = H(p)
(sampled_entropy). The exact H = -sum_v p_v log p_v needs the logits: the trainer's pass computes it
beside its log-probs (moe.py's token_logprobs, return_entropy), in chunks of positions.

Left out: value functions and GAE (no critic), sequence-level ratios (GSPO), masking tokens by ratio
(IcePop and other rejection variants), entropy bonuses. Loss statistics are 0-d detached tensors
(no GPU sync per mini-batch); the mismatch metrics are Python floats, computed once per step.
"""

import math

import torch

# |log-ratio| above which exp is not taken (verl's bound): exp(20) = 4.9e8 is far from fp32's 3.4e38
LOG_RATIO_LIMIT = 20.0

# -----------------------------------------------------------------------------
# Advantages


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: A_i = (r_i - mean_group(r)) / (std_group(r) + eps), shape (N,) -> (N,) fp32.

    std is the population std (unbiased=False): with G=2 and rewards {0, 1} the advantages are
    exactly +-1, and the scale does not carry Bessel's sqrt(G/(G-1)) factor (TRL and verl use the
    unbiased std; the two differ only by that constant factor per G). With normalize_std=False the
    advantage is the centred reward only (Dr. GRPO), which does not up-weight groups that are nearly
    all-right or all-wrong. Groups with no reward spread (max == min) get exactly zero, not a
    rounding residue.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
            f"group_size={group_size}"
        )
    grouped = rewards.float().reshape(-1, group_size)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    if normalize_std:
        std = grouped.std(dim=1, unbiased=False, keepdim=True)  # (P, 1)
        centred = centred / (std + eps)
    has_spread = grouped.amax(dim=1, keepdim=True) > grouped.amin(dim=1, keepdim=True)
    return torch.where(has_spread, centred, torch.zeros_like(centred)).view(-1)  # (N,)


# -----------------------------------------------------------------------------
# Entropy from the sampled tokens


def sampled_entropy(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Estimate of the mean token entropy from the sampled tokens' log-probs: mean over valid tokens
    of -log p(y_t), (N, T), (N, T) -> 0-d fp32 tensor, NaN when no token is valid.

    Unbiased when the tokens were sampled from the distribution that scored them (the rollout's
    log-probs, tempered as it sampled): E_{y ~ p}[-log p(y)] = H(p). Of another policy's log-probs
    (the trainer's) it is the cross-entropy H(p_rollout, p_trainer) = H + KL, not an entropy.
    """
    _check_same_shape("logprobs", logprobs, mask=mask)
    valid = mask.bool()
    return (-logprobs.detach().double()[valid]).mean().float()


# -----------------------------------------------------------------------------
# The loss


def _check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must match (N, T)"
            )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_valid_tokens: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped GRPO loss with decoupled TIS and optional dual-clip (module docstring).

    logprobs (N, T) carries the gradient; old_logprobs, rollout_logprobs, ref_logprobs (N, T) and
    advantages (N,) are treated as constants (detached here). mask (N, T) marks valid tokens.

    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher
        keeps low-probability tokens that got a positive advantage growing, which slows entropy
        collapse).
    tis_cap: if given, each token's policy-gradient term is multiplied by
        w = min(pi_old / pi_rollout, tis_cap). Needs rollout_logprobs. w is a constant of the
        rollout batch: its statistics are mismatch_metrics' tis_ratio_* (once per batch), not
        repeated here for every mini-batch.
    ref_logprobs, kl_coef: with kl_coef > 0, add kl_coef * K3(pi_theta || pi_ref) per token, the
        reference policy being whatever ref_logprobs scored (GRPO's: the starting policy).
    num_valid_tokens: the DAPO denominator. Defaults to the valid tokens in this call; when a batch
        is split into micro-batches for gradient accumulation, pass the whole batch's count so the
        summed micro-batch losses equal the full-batch loss.
    clip_ratio_c: if given (> 1), dual-clip: a token with A < 0 loses at most c * |A|, however
        large its ratio. None (the default) leaves the loss of such a token unbounded, as plain PPO.

    Returns (loss, stats). loss is a 0-d tensor; stats are 0-d detached fp32 tensors (float() them
    to log), named as TRL's GRPO trainer logs them where it has a name: pg_loss; ratio/mean,
    ratio/min, ratio/max of pi_theta / pi_old (of the clamped log-ratio: at most exp(20));
    clip_ratio/low_mean (ratio < 1 - clip_low with A < 0), clip_ratio/high_mean (ratio >
    1 + clip_high with A > 0), clip_ratio/dual_mean (ratio > c with A < 0: the dual clip's; 0
    without it), clip_ratio/region_mean (their sum: the tokens whose gradient a clip removed);
    approx_kl (K3 of KL(pi_theta || pi_old), the form of the reference term: how far the update has
    moved); and kl (K3 to the reference) whenever ref_logprobs is given.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (N, T), got shape {tuple(logprobs.shape)}")
    _check_same_shape(
        "logprobs",
        logprobs,
        old_logprobs=old_logprobs,
        mask=mask,
        rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs,
    )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be (N,) = ({logprobs.shape[0]},), got shape {tuple(advantages.shape)}"
        )
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError("tis_cap needs rollout_logprobs (the rollout engine's log-probs)")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (the dual clip's bound on the ratio), got {clip_ratio_c}"
        )

    is_valid = mask.bool()  # (N, T)
    valid = is_valid.float()
    denominator = (
        float(num_valid_tokens) if num_valid_tokens is not None else valid.sum().clamp(min=1.0)
    )

    def safe_log_ratio(log_diff: torch.Tensor) -> torch.Tensor:
        # Padding may hold anything (-inf, NaN, stale values): zeroing log-differences there
        # before exp keeps every product finite, so padding cannot leak NaN into the sum or the
        # gradient. The clamp keeps exp finite on valid tokens too (module docstring).
        on_valid = torch.where(is_valid, log_diff, torch.zeros_like(log_diff))
        return on_valid.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)

    def batch_mean(per_token: torch.Tensor) -> torch.Tensor:
        return (per_token * valid).sum() / denominator

    logprobs = logprobs.float()
    old_logprobs = old_logprobs.detach().float()
    adv = advantages.detach().float().unsqueeze(1)  # (N, 1)

    log_ratio = safe_log_ratio(logprobs - old_logprobs)  # (N, T)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (N, T)
    dual_clipped = torch.zeros_like(is_valid)
    if clip_ratio_c is not None:
        dual_bound = clip_ratio_c * adv.abs()  # (N, 1)
        dual_clipped = (adv < 0) & (pg_per_token > dual_bound)  # (N, T)
        pg_per_token = torch.where(adv < 0, torch.minimum(pg_per_token, dual_bound), pg_per_token)
    if tis_cap is not None:
        rollout_log_ratio = safe_log_ratio(old_logprobs - rollout_logprobs.detach().float())
        old_over_rollout = torch.exp(rollout_log_ratio)
        pg_per_token = pg_per_token * old_over_rollout.clamp(max=tis_cap)  # w_t, a constant
    pg_loss = batch_mean(pg_per_token)

    stats: dict[str, torch.Tensor] = {}
    loss = pg_loss
    if ref_logprobs is not None:
        ref_log_ratio = safe_log_ratio(ref_logprobs.detach().float() - logprobs)  # (N, T)
        k3 = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        if kl_coef > 0:
            loss = loss + kl_coef * batch_mean(k3)
        stats["kl"] = _masked_mean(k3.detach(), valid)

    with torch.no_grad():
        ratio_d, log_ratio_d = ratio.detach(), log_ratio.detach()
        clipped_low = (ratio_d < 1.0 - clip_low) & (adv < 0)
        clipped_high = (ratio_d > 1.0 + clip_high) & (adv > 0)
        stats["pg_loss"] = pg_loss.detach()
        stats["ratio/mean"] = _masked_mean(ratio_d, valid)
        stats["ratio/min"] = _masked_min(ratio_d, valid)
        stats["ratio/max"] = _masked_max(ratio_d, valid)
        stats["clip_ratio/low_mean"] = _masked_mean(clipped_low.float(), valid)
        stats["clip_ratio/high_mean"] = _masked_mean(clipped_high.float(), valid)
        stats["clip_ratio/dual_mean"] = _masked_mean(dual_clipped.float(), valid)
        region = clipped_low | clipped_high | dual_clipped
        stats["clip_ratio/region_mean"] = _masked_mean(region.float(), valid)
        # expm1: exp(-x) - 1 + x cancels catastrophically in fp32 for the small x of a
        # near-on-policy step
        stats["approx_kl"] = _masked_mean(torch.expm1(-log_ratio_d) + log_ratio_d, valid)
    return loss, stats


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid entries, 0 when there are none (training stats stay finite; no device
    sync)."""
    return ((values * valid).sum() / valid.sum().clamp(min=1.0)).detach().float()


def _masked_max(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Max over valid entries of a non-negative tensor, 0 when there are none (no device sync)."""
    return torch.where(valid.bool(), values, torch.zeros_like(values)).amax().detach().float()


def _masked_min(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Min over valid entries of a non-negative tensor, 0 when there are none (no device sync)."""
    inf = torch.full_like(values, math.inf)
    smallest = torch.where(valid.bool(), values, inf).amin()
    return torch.where(torch.isinf(smallest), torch.zeros_like(smallest), smallest).detach().float()


# -----------------------------------------------------------------------------
# Train/rollout mismatch


def mismatch_metrics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float | None = None,
) -> dict[str, float]:
    """Train/rollout log-prob mismatch over valid completion tokens, as Python floats.

    trainer_logprobs: log pi_train of the sampled tokens under the weights that sampled them;
    rollout_logprobs: log pi_rollout reported by the rollout engine. d = trainer - rollout, and:

        abs_diff_mean, abs_diff_max, abs_diff_p95, abs_diff_p99
                         |d| (the quantiles linearly interpolated)
        diff_mean        mean d (signed; > 0: the trainer finds the sampled tokens more likely)
        kl_k1            mean(-d)              } both estimate KL(pi_rollout || pi_train),
        kl_k3            mean(exp(d) - 1 - d)  } the tokens being samples of pi_rollout
        trainer_ppl      exp(-mean logp_train)
        rollout_ppl      exp(-mean logp_rollout)
        is_ratio_min/mean/max    of exp(d) = pi_train / pi_rollout
        tis_ratio_min/mean/max   of min(exp(d), tis_cap), and tis_clip_frac (only with tis_cap)
        num_tokens

    Computed in float64 and read back with one device sync. With no valid token every metric is NaN
    (num_tokens 0) instead of raising, so a degenerate step shows up as a gap in the plots.
    """
    _check_same_shape(
        "trainer_logprobs", trainer_logprobs, rollout_logprobs=rollout_logprobs, mask=mask
    )
    valid = mask.bool()
    trainer = trainer_logprobs.detach()[valid].double()  # (M,)
    rollout = rollout_logprobs.detach()[valid].double()  # (M,)
    names = [
        "abs_diff_mean",
        "abs_diff_max",
        "abs_diff_p95",
        "abs_diff_p99",
        "diff_mean",
        "kl_k1",
        "kl_k3",
        "trainer_ppl",
        "rollout_ppl",
        "is_ratio_min",
        "is_ratio_mean",
        "is_ratio_max",
    ]
    if tis_cap is not None:
        names += ["tis_ratio_min", "tis_ratio_mean", "tis_ratio_max", "tis_clip_frac"]
    num_tokens = trainer.numel()
    if num_tokens == 0:
        return {**{name: math.nan for name in names}, "num_tokens": 0}

    diff = trainer - rollout
    abs_diff_sorted = diff.abs().sort().values
    ratio = diff.exp()
    values = [
        abs_diff_sorted.mean(),
        abs_diff_sorted[-1],
        _quantile_sorted(abs_diff_sorted, 0.95),
        _quantile_sorted(abs_diff_sorted, 0.99),
        diff.mean(),
        (-diff).mean(),
        (ratio - 1.0 - diff).mean(),
        torch.exp(-trainer.mean()),
        torch.exp(-rollout.mean()),
        ratio.min(),
        ratio.mean(),
        ratio.max(),
    ]
    if tis_cap is not None:
        truncated = ratio.clamp(max=tis_cap)
        values += [
            truncated.min(),
            truncated.mean(),
            truncated.max(),
            (ratio > tis_cap).double().mean(),
        ]
    metrics = dict(zip(names, torch.stack(values).tolist()))
    metrics["num_tokens"] = num_tokens
    return metrics


def _quantile_sorted(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile of an ascending 1-D tensor with linear interpolation (numpy's default).
    torch.quantile
    refuses inputs above 2**24 elements, which a large batch of tokens can exceed."""
    position = q * (sorted_values.numel() - 1)
    below = int(math.floor(position))
    above = min(below + 1, sorted_values.numel() - 1)
    fraction = position - below
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * fraction


def routing_disagreement(
    trainer_routes: torch.Tensor,
    rollout_routes: torch.Tensor,
    token_mask: torch.Tensor,
    any_layer: bool = False,
) -> float:
    """Fraction of (valid token, layer) pairs where trainer and rollout chose different expert
    *sets*.

    routes: (L, N, T, A) integer expert ids, top-k per token and layer; token_mask (N, T). The order
    within the top-k is irrelevant (both are sorted along A first): only which experts run matters.
    With any_layer=True, returns instead the fraction of valid tokens that differ in at least one
    layer (R3 reports ~10% per (token, layer) but ~94% per token between two engines). NaN when no
    token is valid.
    """
    if trainer_routes.dim() != 4 or trainer_routes.shape != rollout_routes.shape:
        raise ValueError(
            f"expected trainer and rollout routes of one shape (L, N, T, A), got "
            f"{tuple(trainer_routes.shape)} and {tuple(rollout_routes.shape)}"
        )
    if token_mask.shape != trainer_routes.shape[1:3]:
        raise ValueError(
            f"token_mask has shape {tuple(token_mask.shape)} but routes "
            f"{tuple(trainer_routes.shape)} need (N, T) = {tuple(trainer_routes.shape[1:3])}"
        )
    trainer_sets = trainer_routes.sort(dim=-1).values  # (L, N, T, A)
    rollout_sets = rollout_routes.sort(dim=-1).values
    differs = (trainer_sets != rollout_sets).any(dim=-1)  # (L, N, T)
    valid = token_mask.bool()  # (N, T)
    if not bool(valid.any()):
        return math.nan
    if any_layer:
        return differs.any(dim=0)[valid].float().mean().item()
    return differs[:, valid].float().mean().item()


# -----------------------------------------------------------------------------
# MIPU


def mipu_proxy(
    candidate_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> float:
    """MIPU's acceptance proxy (module docstring): sum_valid A * (mu'/mu - 1) / valid tokens, a
    float.

    candidate_logprobs: log mu', the rollout model's scores of the batch's tokens after the
    candidate update was synced into it; current_logprobs: log mu, the same model's scores of the
    same tokens before the update; both (N, T). advantages (N,), mask (N, T). > 0: the candidate
    raises the inference policy's expected advantage on these tokens; accept it. Computed in
    float64; 0.0 with no valid token.
    """
    _check_same_shape(
        "candidate_logprobs", candidate_logprobs, current_logprobs=current_logprobs, mask=mask
    )
    if advantages.shape != candidate_logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be (N,) = ({candidate_logprobs.shape[0]},), got shape "
            f"{tuple(advantages.shape)}"
        )
    valid = mask.bool()
    log_ratio = (candidate_logprobs.double() - current_logprobs.double())[valid]  # (M,)
    token_advantages = advantages.double().unsqueeze(1).expand_as(valid)[valid]  # (M,)
    if log_ratio.numel() == 0:
        return 0.0
    return (token_advantages * torch.expm1(log_ratio)).mean().item()
