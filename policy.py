"""The policy RL starts from: the task and the model the flags name, warm-started by supervised
fine-tuning on the task's demonstrations.

    task   = build_task(cfg)                    the built-in arithmetic task, or GSM8K (a file or the hub)
    model  = build_model(cfg, task)             a preset with the task's tokenizer, or a Hugging Face
                                                Qwen3-MoE checkpoint with its own (tasks.HFTokenizer)
    model  = warmstart(cfg, model, task, tok)   SFT on demonstrations: loss on completion + EOS tokens,
                                                AdamW, 50-step warm-up then cosine decay, gradient clip 1

The demonstrations are deliberately imperfect (tasks.py: a share `demo_error_rate` holds one mistake), so
the warm-started policy leaves room for RL. The result is cached under out_dir/warmstart/, keyed by
everything that determines it and not by the recipe: every recipe and every later run with the same
settings starts from the same weights. A task or model that cannot be loaded is one line naming the flag
and the fix (runs.ConfigError).
"""
import hashlib
import json
import math
import os
import random

import torch
from tqdm import tqdm

import grpo
import moe
import tasks
from runs import ConfigError, atomic_save, load_checkpoint, one_line


def build_task(cfg):
    """The task, loaded; a dataset that cannot be loaded is a ConfigError naming the source and the fix."""
    if cfg.task == "arith":
        return tasks.make_task("arith", difficulty=cfg.difficulty, demo_error_rate=cfg.demo_error_rate,
                               seed=cfg.seed)
    import datasets
    source = cfg.task_source or "openai/gsm8k"
    try:
        return tasks.make_task(cfg.task, source=source, seed=cfg.seed)
    except FileNotFoundError as error:
        raise ConfigError(f"argument --task-source: {error}") from None
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        cause = f"; {one_line(error.__cause__)}" if error.__cause__ else ""
        raise ConfigError(f"argument --task-source: cannot load the {cfg.task} dataset {source!r} "
                          f"({one_line(error)}{cause}); offline, give a local file: --task-source "
                          "FILE.jsonl (one JSON object per line with 'question' and 'answer')") from None


def build_model(cfg, task):
    """The BF16 policy before warm-start: a preset with the task's vocabulary, or a real checkpoint."""
    torch.manual_seed(cfg.seed)
    if not cfg.model:
        config = moe.MoEConfig.from_preset(cfg.preset, vocab_size=task.tokenizer.vocab_size)
        model = moe.MoETransformer(config)
        model.init_weights()
        return model.to(cfg.device), task.tokenizer
    try:
        model, hf_tokenizer = moe.load_hf(cfg.model)
    except (OSError, ValueError) as error:  # no config.json, weights that do not fit, an unreachable hub
        where = "the directory" if os.path.isdir(cfg.model) else "no such directory, and the hub id"
        raise ConfigError(f"argument --model: cannot load {cfg.model} ({where}): "
                          f"{one_line(error)}") from None
    if hf_tokenizer is None:
        raise ConfigError(f"argument --model: {cfg.model} has no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json or vocab.json); RL needs one")
    try:
        return model.to(cfg.device), tasks.HFTokenizer(hf_tokenizer)
    except ValueError as error:
        raise ConfigError(f"argument --model: {error}") from None


def autocast(cfg):
    """BF16 compute with FP32 master weights on the GPU; plain FP32 on the CPU (exact, for tests)."""
    if cfg.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- warm-start
def warmstart_path(cfg):
    """The cache file of the warm-start, keyed by everything that determines it (not by the recipe)."""
    key = json.dumps({k: getattr(cfg, k) for k in ("preset", "model", "task", "task_source", "difficulty",
                                                   "demo_error_rate", "warmstart_steps", "warmstart_batch",
                                                   "warmstart_lr", "seed", "device")}, sort_keys=True)
    return os.path.join(cfg.out_dir, "warmstart", hashlib.sha1(key.encode()).hexdigest()[:12] + ".pt")


def warmstart(cfg, model, task, tokenizer):
    """Supervised fine-tuning on demonstrations (loss on completion + EOS tokens), cached on disk."""
    path = warmstart_path(cfg)
    if os.path.exists(path):
        model.load_state_dict(load_checkpoint(path, cfg.device, "delete it to recompute it",
                                              "warm-start cache"))
        print(f"warm-start: loaded {path}")
        return model
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0,
                                  betas=(0.9, 0.95))
    bar = tqdm(range(cfg.warmstart_steps), desc="warm-start", dynamic_ncols=True)
    for step in bar:
        warmup = min(1.0, (step + 1) / 50)
        lr = cfg.warmstart_lr * warmup * 0.5 * (1 + math.cos(math.pi * step / cfg.warmstart_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows, loss_starts = [], []
        for p in task.sample(cfg.warmstart_batch, "train", rng):
            prompt = tokenizer.encode(p.prompt)
            rows.append(prompt + tokenizer.encode(task.demonstration(p, rng)) + [tokenizer.eos_id])
            loss_starts.append(len(prompt))
        width = max(map(len, rows))
        tokens = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
        target_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (row, start) in enumerate(zip(rows, loss_starts)):
            tokens[i, :len(row)] = torch.tensor(row)
            target_mask[i, start:len(row)] = True
        tokens, target_mask = tokens.to(cfg.device), target_mask.to(cfg.device)
        with autocast(cfg):
            logits = model(tokens[:, :-1])
        logp = grpo.token_logprobs(logits.float(), tokens[:, 1:])                # (N, W-1)
        mask = target_mask[:, 1:]
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    atomic_save(model.state_dict(), path)
    return model
