"""A few completions of a checkpoint, to read what a policy writes.

    python -m tools.generate runs/quads --prompt "12+34="            # 4 samples at its temperature
    python -m tools.generate runs/quads --prompt "12+34=" --greedy   # the most likely completion
    python -m tools.generate runs/quads --prompt "12+34=" --precision nvfp4 --rac-ratio 0.5
    python -m tools.generate path/to/qwen3-moe --prompt "What is 2+3?"   # a Hugging Face checkpoint

RUN is a run directory (its checkpoint.pt), a checkpoint file, or a Hugging Face Qwen3-MoE
directory with a tokenizer (tools/export.py writes one; an arith run's export has no tokenizer:
give the run). The prompt is encoded as a run encodes its prompts (no BOS, no chat template) and
sampled by the rollout's own sampler, rollout.generate, at the run's temperature unless
--temperature or --greedy says otherwise. --precision converts the model to a rollout precision
first (rac.convert_for_rollout's modes; bf16 leaves it unquantized: BF16 on a GPU, FP32 on the CPU,
as the rollout runs there), so a policy can be read as the NVFP4 rollout samples it. --rac-ratio
calibrates RAC's blocks on the prompt itself (a run calibrates on a batch of its prompts and
demonstrations, so its selection can differ).

For each completion: its tokens (EOS included), whether it ended with EOS or at the token limit,
its mean log-prob under the sampling distribution, and its text. Row n of a call draws the noise of
(seed, n), as a run's rows do: one seed gives the same completions again.
"""

import argparse
import os
import sys
from typing import NamedTuple

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # also as a plain script

import torch  # noqa: E402

import moe  # noqa: E402
import nvfp4  # noqa: E402
import rac  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from tools import export, runs  # noqa: E402

DEFAULT_SAMPLES = 4
GSM8K_NEW_TOKENS = 256  # a --model run without --max-new-tokens: as train.py's default for gsm8k


def load_policy(path: str):
    """-> (model (FP32, CPU), tokenizer with CharTokenizer's interface, the run's temperature, its
    completion length, a label). A run's tokenizer is its task's or its source checkpoint's."""
    run = os.path.isfile(path) or os.path.isfile(os.path.join(path, "checkpoint.pt"))
    if not run and os.path.isfile(os.path.join(path, "config.json")):  # a run has one too
        try:
            model, hf_tokenizer = moe.load_hf(path)
        except (OSError, ValueError) as error:
            raise runs.ConfigError(
                f"argument RUN: cannot load {path} ({runs.one_line(error)})"
            ) from None
        export.refuse_run(
            hf_tokenizer is None,
            f"{path} has no tokenizer files (an arith run's export has none: give the run)",
        )
        return model, tasks.HFTokenizer(hf_tokenizer), 1.0, GSM8K_NEW_TOKENS, path
    policy = export.read_run(path)
    train_config = policy.train_config
    # an arith run: the task's character tokenizer, and its longest completion + EOS
    if policy.source is None:
        task = tasks.make_task("arith", difficulty=train_config["difficulty"])
        tokenizer, new_tokens = task.tokenizer, task.max_completion_chars + 1
    else:
        from transformers import AutoTokenizer

        tokenizer = tasks.HFTokenizer(AutoTokenizer.from_pretrained(policy.source))
        new_tokens = GSM8K_NEW_TOKENS
    new_tokens = train_config.get("max_new_tokens") or new_tokens
    label = f"{path} (step {policy.step})"
    return policy.model, tokenizer, train_config["temperature"], new_tokens, label


def rollout_model(model, precision: str, rac_ratio: float, act_scale: str, prompt_ids, device):
    """The model in a rollout precision on `device`, RAC's blocks (if any) chosen on the prompt."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = rac.convert_for_rollout(
        model.to(device=device, dtype=dtype), precision, rac_ratio=rac_ratio, act_scale=act_scale
    )
    if rac_ratio > 0:
        rac.calibrate_rac(model, torch.tensor([prompt_ids], device=device))
    return model


class Completion(NamedTuple):
    text: str
    ids: list  # the sampled token ids, EOS included
    ended: bool  # with EOS (else at the token limit)
    mean_logprob: float  # of its tokens under the sampling distribution


def complete(model, tokenizer, prompt_ids, samples, max_new_tokens, temperature, seed):
    """-> `samples` Completions of prompt_ids, sampled by the rollout's sampler."""
    out = rollout.generate(
        model,
        [prompt_ids],
        samples,
        max_new_tokens,
        temperature=temperature,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        seed=seed,
    )
    results = []
    for ids, mask, logprobs in zip(
        out.completion_ids.cpu(), out.completion_mask.cpu(), out.logprobs.cpu()
    ):
        tokens = ids[mask].tolist()
        ended = tokens[-1] == tokenizer.eos_id
        mean_logprob = logprobs[mask].mean().item()
        results.append(Completion(tokenizer.decode(tokens), tokens, ended, mean_logprob))
    return results


def check_arguments(args, device):
    """Every flag's value and combination, before a model is loaded (one line each)."""
    runs.require(args.prompt != "", "prompt", args.prompt, "must be some text")
    runs.require(args.n is None or runs.is_int(args.n) and args.n >= 1, "n", args.n, "must be >= 1")
    runs.refuse(
        args.greedy and args.n not in (None, 1),
        "n",
        f"{args.n} with --greedy: greedy decoding has one completion (drop --n or --greedy)",
    )
    runs.refuse(
        args.greedy and args.temperature is not None,
        "temperature",
        "not allowed with argument --greedy (greedy is temperature 0)",
    )
    runs.require(
        args.temperature is None or runs.is_real(args.temperature) and args.temperature > 0,
        "temperature",
        args.temperature,
        "must be a number > 0 (--greedy for temperature 0)",
    )
    runs.require(
        args.max_new_tokens is None or args.max_new_tokens >= 1,
        "max-new-tokens",
        args.max_new_tokens,
        "must be >= 1",
    )
    runs.require(
        args.precision in rac.MODES,
        "precision",
        args.precision,
        f"choose from {', '.join(rac.MODES)}",
    )
    runs.require(0 <= args.rac_ratio <= 1, "rac-ratio", args.rac_ratio, "must be in [0, 1]")
    runs.refuse(
        args.rac_ratio > 0 and args.precision not in rac.ACTIVATION_MODES,
        "rac-ratio",
        f"compensates NVFP4 activations; --precision {args.precision} has none "
        f"(choose from {', '.join(rac.ACTIVATION_MODES)})",
    )
    runs.require(
        args.act_scale in nvfp4.ACT_SCALES,
        "act-scale",
        args.act_scale,
        f"choose from {', '.join(nvfp4.ACT_SCALES)}",
    )
    runs.refuse(
        args.act_scale != "tensor" and args.precision not in rac.ACTIVATION_MODES,
        "act-scale",
        f"{args.act_scale!r} scales NVFP4 activations; --precision {args.precision} has none",
    )
    runs.require(args.seed >= 0, "seed", args.seed, "must be an integer >= 0")
    # the device, as train.py checks it
    kind, _, index = device.partition(":")
    runs.require(
        kind in ("cpu", "cuda") and (not index or kind == "cuda" and index.isdigit()),
        "device",
        device,
        "choose from cpu, cuda, cuda:N",
    )
    runs.refuse(
        kind == "cuda" and not torch.cuda.is_available(),
        "device",
        f"{device!r} but torch sees no CUDA GPU; use --device cpu",
    )


def main(argv=None):
    """The command line: prints the completions and returns them; a ConfigError exits 2."""
    parser = runs.Parser(
        prog="python -m tools.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run",
        metavar="RUN",
        help="a run directory, a checkpoint file or a Hugging Face Qwen3-MoE directory",
    )
    parser.add_argument("--prompt", required=True, help="the text to complete")
    parser.add_argument(
        "--n", type=int, help=f"completions (default: {DEFAULT_SAMPLES}, or 1 with --greedy)"
    )
    parser.add_argument("--greedy", action="store_true", help="the most likely token at each step")
    parser.add_argument("--temperature", type=float, help="(default: the run's)")
    parser.add_argument(
        "--max-new-tokens", type=int, help="(default: the run's, or its task's longest + EOS)"
    )
    parser.add_argument(
        "--precision", default="bf16", help=f"the rollout's: {', '.join(rac.MODES)} (default: bf16)"
    )
    parser.add_argument(
        "--rac-ratio", type=float, default=0.0, help="RAC's compensated share of blocks (nvfp4)"
    )
    parser.add_argument(
        "--act-scale",
        default="tensor",
        help="NVFP4 activation scale: tensor or row (default: tensor)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the sampling noise's seed (default: 0)"
    )
    parser.add_argument("--device", default="", help="cpu, cuda or cuda:N (default: cuda if any)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_arguments(args, device)
        model, tokenizer, temperature, max_new_tokens, label = load_policy(args.run)
        try:
            prompt_ids = tokenizer.encode(args.prompt)
        except ValueError as error:  # the arith tokenizer knows its alphabet only
            raise runs.ConfigError(f"argument --prompt: {error}") from None
        max_new_tokens = args.max_new_tokens or max_new_tokens
        room = model.config.max_seq_len - len(prompt_ids)
        runs.refuse(
            max_new_tokens > room,
            "max-new-tokens",
            f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the model's "
            f"max_seq_len={model.config.max_seq_len} (at most {room} new tokens)",
        )
        if args.greedy:
            temperature = 0.0
        if args.temperature is not None:
            temperature = args.temperature
        samples = args.n or (1 if args.greedy else DEFAULT_SAMPLES)
        try:
            model = rollout_model(
                model, args.precision, args.rac_ratio, args.act_scale, prompt_ids, device
            )
        except ValueError as error:  # a width NVFP4's 16-element blocks do not divide
            raise runs.ConfigError(f"argument --precision: {error}") from None
        results = complete(
            model, tokenizer, prompt_ids, samples, max_new_tokens, temperature, args.seed
        )
    except runs.ConfigError as error:
        parser.error(str(error))
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}, seed {args.seed}"
    print(f"{label}: {args.prompt!r}, {args.precision} rollout, {how}, {device}")
    for i, completion in enumerate(results, 1):
        end = "EOS" if completion.ended else f"the {max_new_tokens}-token limit"
        print(
            f"--- {i}: {len(completion.ids)} tokens, ended at {end}, "
            f"mean log-prob {completion.mean_logprob:.3f}"
        )
        print(completion.text)
    return results


if __name__ == "__main__":
    main()
