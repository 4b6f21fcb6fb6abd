"""policy.py: the warm-start is cached by what determines it (not the recipe), lowers the loss on the
demonstrations, and loads back bit for bit; a model that cannot be loaded is one line naming the flag."""
import pytest
import torch

import grpo
import policy
import runs
import train


def config(out_dir, **overrides):
    return train.TrainConfig(**{**dict(preset="tiny", difficulty=1, warmstart_steps=40, warmstart_batch=16,
                                       device="cpu", out_dir=str(out_dir)), **overrides})


def demonstration_loss(cfg, model, task, tokenizer):
    """Mean negative log-prob of 64 fixed demonstrations' completion + EOS tokens (the oracle: a loop)."""
    import random
    rng, total, count = random.Random(123), 0.0, 0
    for p in task.sample(64, "train", rng):
        prompt = tokenizer.encode(p.prompt)
        row = torch.tensor([prompt + tokenizer.encode(task.demonstration(p, rng)) + [tokenizer.eos_id]])
        with torch.no_grad():
            logp = grpo.token_logprobs(model(row[:, :-1]).float(), row[:, 1:])[0, len(prompt) - 1:]
        total, count = total - logp.sum().item(), count + logp.numel()
    return total / count


def test_the_warm_start_is_keyed_by_what_determines_it_and_not_by_the_recipe(tmp_path):
    base = policy.warmstart_path(config(tmp_path))
    assert policy.warmstart_path(config(tmp_path, recipe="nvfp4", tis=2.0)) == base
    assert policy.warmstart_path(config(tmp_path, seed=1)) != base
    assert policy.warmstart_path(config(tmp_path, warmstart_lr=1e-3)) != base


def test_the_warm_start_lowers_the_demonstration_loss_and_loads_back_bit_for_bit(tmp_path, capsys):
    cfg = config(tmp_path)
    task = policy.build_task(cfg)
    model, tokenizer = policy.build_model(cfg, task)
    before = demonstration_loss(cfg, model, task, tokenizer)
    policy.warmstart(cfg, model, task, tokenizer)
    after = demonstration_loss(cfg, model, task, tokenizer)
    assert after < 0.8 * before, (before, after)
    again, _ = policy.build_model(cfg, task)
    policy.warmstart(cfg, again, task, tokenizer)
    assert f"warm-start: loaded {policy.warmstart_path(cfg)}" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_model_that_cannot_be_loaded_is_one_line_naming_the_flag(tmp_path):
    cfg = train.TrainConfig(model=str(tmp_path), task="gsm8k", device="cpu")
    with pytest.raises(runs.ConfigError, match="argument --model: cannot load") as error:
        policy.build_model(cfg, None)
    assert str(error.value).startswith(f"argument --model: cannot load {tmp_path} (the directory)")
