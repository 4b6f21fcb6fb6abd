"""The 3-way log-prob audit: one rollout batch per recipe, from a run's weights, its tokens scored
three ways.

    python -m tools.audit runs/quads                          # bf16, nvfp4, quads
    python -m tools.audit runs/quads/checkpoint.pt --recipes moeresq,trace --device cpu
    python -m tools.audit runs/quads --recipes nvfp4,nvfp4+row,w4a16,w16a4 --batches 2
    python -m tools.audit runs/quads --outliers               # the inputs NVFP4 quantizes

    A  the log-probs the rollout engine recorded while it generated the batch (decode, one token a
       step)
    B  the same rollout model re-scoring the same tokens in one prefill (rollout.score), done twice
    C  the recipe's trainer forward on the same tokens (what the loss sees as `old`)

A - B isolates the engine's own nondeterminism (decode vs prefill numerics; the dynamic per-tensor
activation scale that makes a token's rounding depend on the rest of its GEMM); B - C is precision
(the rollout's quantized layers against the trainer's); A - C is what the loss sees; B - B' must be
0 (a repeatable prefill). For each, over the completion tokens: signed mean, mean absolute error,
p95, p99 and max of |d|. A recipe name with `+row` runs it with --act-scale row; --batches N scores
N batches each.

--outliers reports instead how outlier-heavy each input of the NVFP4 rollout is on one batch of its
own tokens (its prefill re-score): max |x| / RMS; the largest block amax over the median one; the
share of blocks whose E4M3 scale falls below E4M3's smallest normal 2^-6 under the per-tensor global
scale (fewer scale bits); and the relative error |x - DQ(Q(x))| / |x| with a per-tensor and a
per-row scale. The activation error NVFP4 RL suffers grows with these ratios (pretrained LLMs have
channels hundreds of times their RMS). Writes outliers.md into the audit's directory.

The run's own config (preset, task, batch shape, temperature, RAC ratio, seed) is used, with this
command's device. Every recipe starts from the checkpoint's weights and scores a batch it sampled
itself (same prompts and seed). Writes audit.md (the full table: every statistic of every pair),
audit.json and each batch (tokens, A, B, C) as batch_<recipe>.pt into RUN/audit_step<N>/ (or --out
DIR), and prints a compact table (MAE and max of each pair) and the paths it wrote; an audit that is
there is refused unless --overwrite replaces it.
"""

import argparse
import copy
import dataclasses
import json
import os
import random
import sys
import textwrap

# also as a plain script
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import grpo  # noqa: E402
import nvfp4  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from tools import runs  # noqa: E402

STATS = [
    ("signed mean", "diff_mean"),
    ("MAE", "abs_diff_mean"),
    ("p95", "abs_diff_p95"),
    ("p99", "abs_diff_p99"),
    ("max", "abs_diff_max"),
]
# not the audit's business
SKIPPED = ("device", "run_name", "resume", "overwrite", "threads", "mipu", "tis", "log_to")


def audit(
    path,
    recipes=("bf16", "nvfp4", "quads"),
    device="cpu",
    out_dir="",
    overwrite=False,
    cuda_graph=True,
    batches=1,
    outliers=False,
):
    """Audit the checkpoint at `path` (a run directory or a checkpoint file) -> the path of audit.md
    (of outliers.md with `outliers`)."""
    ckpt_path = path if os.path.isfile(path) else os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(ckpt_path):
        raise runs.ConfigError(
            f"argument RUN: no checkpoint at {path!r}; give a run directory holding "
            "checkpoint.pt or a checkpoint file"
        )
    ckpt = runs.load_checkpoint(ckpt_path, "cpu", "give another run directory or checkpoint")
    run_dir = os.path.dirname(os.path.abspath(ckpt_path))
    out_dir = out_dir or os.path.join(run_dir, f"audit_step{ckpt['step']}")
    ours = ("outliers.md",) if outliers else ("audit.md", "audit.json")
    earlier = sorted(
        name
        for name in (os.listdir(out_dir) if os.path.isdir(out_dir) else [])
        if name in ours or not outliers and name.startswith("batch_") and name.endswith(".pt")
    )
    if earlier and not overwrite:
        raise runs.ConfigError(
            f"{out_dir} holds an audit ({', '.join(earlier)}): add --overwrite to "
            "replace it, or give --out DIR"
        )
    known = {f.name for f in dataclasses.fields(train.TrainConfig)}
    cfg = train.TrainConfig(
        **{k: v for k, v in ckpt["config"].items() if k in known and k not in SKIPPED},
        device=device,
    )
    run_cfg = cfg
    default_rac_ratio = train.TrainConfig.rac_ratio
    task = train.build_task(cfg)
    model, tokenizer = train.build_model(cfg, task)
    model.load_state_dict(ckpt["trainer"])  # QAT layers keep moe.py's parameter names
    calib_tokens = train.calibration_tokens(cfg, task, tokenizer)  # the run's RAC calibration batch
    for name in earlier:  # --overwrite: the earlier audit's files, nothing else of the directory
        os.remove(os.path.join(out_dir, name))
    os.makedirs(out_dir, exist_ok=True)
    if outliers:
        return outlier_report(
            cfg, model, task, tokenizer, ckpt_path, ckpt["step"], out_dir, cuda_graph
        )

    results = {}
    for spec, batch in ((spec, b) for spec in recipes for b in range(batches)):
        recipe, _, scale = spec.partition("+")
        has_rac = train.RECIPES[recipe][2]
        # a recipe without RAC takes the RAC fields' defaults (it has nothing they apply to)
        rac_fields = {} if has_rac else {"rac_ratio": default_rac_ratio, "rac_refresh": 1}
        cfg = dataclasses.replace(
            run_cfg, recipe=recipe, act_scale=scale or "tensor", run_name="audit", **rac_fields
        )
        rac_ratio = cfg.rac_ratio if has_rac else 0.0
        rollout_model, trainer = train.build_recipe(cfg, copy.deepcopy(model), recipe, rac_ratio)
        if rac_ratio > 0:
            train.rac.calibrate_rac(rollout_model, calib_tokens)
        recorder = train.rollout_recorder(cfg, rollout_model)
        hand_offs = None
        if recorder is not None:
            hand_offs = recorder.hand_offs()
        out = sample_batch(cfg, rollout_model, task, tokenizer, batch, cuda_graph, hand_offs)
        rollout_share = train.share_of_rollout(cfg, rollout_model, out, recorder)
        seq = out.sequences()
        mask = seq.loss_mask[:, 1:]
        recorded = seq.logprobs[:, 1:]  # A
        rescored = rollout.score(rollout_model, seq.tokens, cfg.temperature)[:, 1:]  # B
        replayed = rollout.score(rollout_model, seq.tokens, cfg.temperature)[:, 1:]  # B'
        with torch.no_grad():
            trainer_logp = train.trainer_logprobs(cfg, trainer, seq, rollout_share)[0]  # C
        name = spec + (f" (batch {batch + 1})" if batches > 1 else "")
        results[name] = {
            "tokens": int(mask.sum()),
            "A-B": grpo.mismatch_metrics(recorded, rescored, mask),
            "B-C": grpo.mismatch_metrics(rescored, trainer_logp, mask),
            "A-C": grpo.mismatch_metrics(recorded, trainer_logp, mask),
            "B-B replay max": (rescored - replayed)[mask].abs().max().item(),
        }
        runs.atomic_save(
            {
                "tokens": seq.tokens.cpu(),
                "loss_mask": seq.loss_mask.cpu(),
                "A": recorded.cpu(),
                "B": rescored.cpu(),
                "C": trainer_logp.cpu(),
            },
            os.path.join(
                out_dir, f"batch_{spec}" + (f"_{batch + 1}" if batches > 1 else "") + ".pt"
            ),
        )
        del rollout_model, trainer

    header = (
        f"Log-prob audit of {ckpt_path} (RL step {ckpt['step']}): {cfg.prompts_per_step} prompts "
        f"x {cfg.group_size} samples per recipe, preset {cfg.preset or cfg.model}, temperature "
        f"{cfg.temperature:g}, {device}, torch {torch.__version__}. d in nats over completion "
        "tokens; A recorded at decode, B one-prefill re-score, C trainer forward."
    )
    columns = (
        ["recipe", "tokens"]
        + [f"{pair} {name}" for pair in ("A-B", "B-C", "A-C") for name, _ in STATS]
        + ["B replay max"]
    )
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for recipe, r in results.items():
        cells = [recipe, str(r["tokens"])] + [
            f"{r[pair][key]:.2e}" for pair in ("A-B", "B-C", "A-C") for _, key in STATS
        ]
        lines.append("| " + " | ".join(cells + [f"{r['B-B replay max']:.1e}"]) + " |")
    table = "\n".join(lines) + "\n"
    md_path = os.path.join(out_dir, "audit.md")
    runs.atomic_save(table, md_path, runs.write_text)
    record = {
        "checkpoint": ckpt_path,
        "step": ckpt["step"],
        "device": device,
        "torch": torch.__version__,
        "config": dataclasses.asdict(cfg),
        "recipes": results,
    }
    json_path = os.path.join(out_dir, "audit.json")
    runs.atomic_save(json.dumps(record, indent=2), json_path, runs.write_text)
    print(textwrap.fill(header, width=100))
    print(compact_table(results))
    print(f"full table (p95, p99, signed mean too): {md_path}")
    print(f"also written: {json_path}, and each batch as {out_dir}/batch_<recipe>.pt")
    return md_path


def compact_table(results):
    """The audit for a terminal: per recipe, the tokens and the MAE and max |d| of each pair and of
    the repeated prefill, in columns a person reads at 100 characters."""
    columns = ["recipe", "tokens"]
    columns += [f"{pair} {name}" for pair in ("A-B", "B-C", "A-C") for name in ("MAE", "max")]
    columns += ["B-B' max"]
    rows = [columns]
    for recipe, r in results.items():
        cells = [recipe, str(r["tokens"])]
        for pair in ("A-B", "B-C", "A-C"):
            cells += [f"{r[pair]['abs_diff_mean']:.2e}", f"{r[pair]['abs_diff_max']:.2e}"]
        rows.append(cells + [f"{r['B-B replay max']:.1e}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for row in rows:
        # the recipe's name to the left, the numbers to the right of their columns
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def sample_batch(cfg, rollout_model, task, tokenizer, batch, cuda_graph, decode_hand_offs=None):
    """The rollout of audit batch `batch`: its own prompts and sampling seed, the same for every
    recipe."""
    problems = task.sample(cfg.prompts_per_step, "train", random.Random(cfg.seed + 4242 + batch))
    return rollout.generate(
        rollout_model,
        train.encode_prompts(tokenizer, problems),
        cfg.group_size,
        train.max_new_tokens(cfg, task),
        temperature=cfg.temperature,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        seed=cfg.seed + 4242 + batch,
        cuda_graph=cuda_graph,
        decode_hand_offs=decode_hand_offs,
    )


def outlier_stats(x):
    """The outlier figures of one quantized input x (M, K) (see the module docstring)."""
    x = x.float()
    rms, amax = x.pow(2).mean().sqrt(), x.abs().amax()
    blocks = x.abs().reshape(len(x), -1, nvfp4.BLOCK_SIZE).amax(-1)
    blocks = blocks[blocks > 0]
    e4m3_scales = (
        blocks / nvfp4.E2M1_MAX / nvfp4.activation_global_scale(x)
    )  # under the tensor's scale
    error = {
        s: ((x - nvfp4.fake_quantize_activation(x, None, s)).norm() / x.norm()).item()
        for s in nvfp4.ACT_SCALES
    }
    return {
        "rows": len(x),
        "max/rms": (amax / rms).item(),
        "block amax max/median": (blocks.max() / blocks.median()).item(),
        "blocks below 2^-6": (e4m3_scales < 2**-6).float().mean().item(),
        "rel. error tensor": error["tensor"],
        "rel. error row": error["row"],
    }


class InputCapture:
    """Keeps the first input each NVFP4 layer quantizes, unquantized: a recorder for
    rac.record_slots, {(layer path, number of layers reading it): x (M, K)}."""

    def __init__(self):
        self.inputs = {}

    def record(self, paths, index, x, routes=None):
        name = paths[0] + ("", " (down)")[index]
        self.inputs.setdefault((name, len(paths)), x.detach().reshape(-1, x.shape[-1]).clone())


def outlier_report(cfg, model, task, tokenizer, ckpt_path, step, out_dir, cuda_graph):
    """The inputs of the checkpoint's NVFP4 rollout (no RAC) on one batch it sampled ->
    outliers.md, whose table is printed with its path."""
    rollout_model = train.rac.convert_for_rollout(model, "nvfp4")
    out = sample_batch(cfg, rollout_model, task, tokenizer, 0, cuda_graph)
    inputs = InputCapture()  # (layer path, readers) -> x of one prefill
    with torch.no_grad():
        hand_offs = train.rac.record_slots(rollout_model, inputs)
        rollout_model(out.sequences().tokens, hand_offs=hand_offs)
    inputs = inputs.inputs
    stats = {
        f"{path}" + (f" (+{n - 1} sharing it)" if n > 1 else ""): outlier_stats(x)
        for (path, n), x in inputs.items()
    }
    columns = list(next(iter(stats.values())))
    lines = [
        f"Inputs of the NVFP4 rollout of {ckpt_path} (RL step {step}), one prefill of its own "
        f"batch of {cfg.prompts_per_step} x {cfg.group_size} samples, {cfg.device}, torch "
        f"{torch.__version__}.",
        "",
        "| input | " + " | ".join(columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for name, row in stats.items():
        lines.append(
            f"| {name} | {row['rows']} | " + " | ".join(f"{row[c]:.3g}" for c in columns[1:]) + " |"
        )
    table = "\n".join(lines) + "\n"
    md_path = os.path.join(out_dir, "outliers.md")
    runs.atomic_save(table, md_path, runs.write_text)
    print(table)
    print(f"written: {md_path}")
    return md_path


def main(argv=None):
    """The command line. A ConfigError exits 2 with its one line."""
    parser = runs.Parser(
        prog="python -m tools.audit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run", metavar="RUN", help="a run directory (its checkpoint.pt) or a checkpoint file"
    )
    parser.add_argument(
        "--recipes",
        default="bf16,nvfp4,quads",
        help="the recipes whose rollout and trainer score the batch (default: bf16,nvfp4,quads)",
    )
    parser.add_argument(
        "--device", default="", help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--out", default="", help="the audit's directory (default: RUN/audit_step<N>)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an audit that is there")
    parser.add_argument(
        "--batches",
        type=int,
        default=1,
        help="batches scored per recipe, each its own prompts and sampling seed (default: 1)",
    )
    parser.add_argument(
        "--outliers",
        action="store_true",
        help="report the NVFP4 rollout's input outliers instead of the log-prob audit (see above)",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps as a captured CUDA graph (GPU only) (default: True)",
    )
    args = parser.parse_args(argv)
    try:
        for spec in args.recipes.split(","):  # (an empty name, as in "bf16,", is refused too)
            recipe, plus, scale = spec.partition("+")
            runs.require(
                recipe in train.RECIPES and scale in (("row",) if plus else ("",)),
                "recipes",
                spec,
                f"choose from {', '.join(train.RECIPES)}, each optionally with +row",
            )
        runs.require(args.batches >= 1, "batches", args.batches, "must be an integer >= 1")
        runs.refuse(
            args.outliers and args.batches != 1,
            "batches",
            "the outlier report scores one batch (--outliers takes no --batches)",
        )
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        train.TrainConfig(device=device)  # checks the device as train.py does
        return audit(
            args.run,
            args.recipes.split(","),
            device,
            args.out,
            args.overwrite,
            args.cuda_graph,
            args.batches,
            args.outliers,
        )
    except runs.ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
