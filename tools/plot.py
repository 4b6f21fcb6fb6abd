"""Figures and tables of finished runs: reward, pass@1 and mismatch over the RL steps.

    python -m tools.plot runs/quads                          # runs/quads/curves.png
    python -m tools.plot runs/bf16 runs/nvfp4 runs/quads --out runs/three.png --table

Reads each run's metrics.jsonl (train.py's log); writes nothing else.
"""

import argparse
import math
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # also as a plain script

from tools import runs  # noqa: E402


def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(run_dirs, path, window=10):
    """Reward, pass@1 and mismatch (mean and max |delta logp|, routing disagreement) over steps; every
    per-step curve is a trailing `window`-step mean (pass@1 evaluations are plotted as they are)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", "reward (train batch)"),
        ("pass@1", "pass@1 (rollout model, held-out)"),
        ("mismatch/abs_diff_mean", "mean |delta logp|"),
        ("mismatch/abs_diff_max", "max |delta logp|"),
        ("mismatch/kl_k3", "K3 KL(rollout || trainer)"),
        ("routing_disagreement", "routing disagreement"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for run_dir in run_dirs:
        records = runs.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        label = os.path.basename(os.path.normpath(run_dir))
        for ax, (key, title) in zip(axes.flat, panels):
            points = [
                (r["step"], r[key])
                for r in records
                if key in r and r[key] is not None and not math.isnan(r[key])
            ]
            if points and key != "pass@1":
                steps, values = zip(*points)
                points = list(zip(steps, smooth(values, window)))
            if points:
                ax.plot(
                    *zip(*points),
                    label=label,
                    marker="o" if key == "pass@1" else None,
                    markersize=3,
                )
            smoothed = "" if key == "pass@1" or window == 1 else f", {window}-step mean"
            ax.set_title(title + smoothed, fontsize=10)
            ax.set_xlabel("RL step", fontsize=8)
            if "mismatch" in key:
                ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"figure: {path}")


def summarize(run_dirs, checkpoints=(50, 100)):
    """A markdown table of the runs: final pass@1 (rollout model, BF16 trainer), mean and max |delta logp|
    and routing disagreement averaged over the 10 steps up to each checkpoint step and the end, mean
    rollout tokens/s and step time."""
    header = ["run", "pass@1 rollout / bf16 trainer"]
    rows = []
    for run_dir in run_dirs:
        records = runs.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        steps = [r for r in records if r["step"] > 0]
        evals = [r for r in records if "pass@1" in r]
        if not steps or not evals:
            continue
        marks = [c for c in checkpoints if c < steps[-1]["step"]] + [steps[-1]["step"]]
        header = ["run", "pass@1 rollout / bf16 trainer"] + [
            f"{name} @ {', '.join(map(str, marks))}"
            for name in ("mean abs dlogp", "max abs dlogp", "routing disagr.")
        ]
        header += ["rollout tok/s", "step s"]

        def window(key, end):
            values = [
                r[key] for r in steps if end - 10 < r["step"] <= end and not math.isnan(r[key])
            ]
            return sum(values) / len(values) if values else float("nan")

        rows.append(
            [
                os.path.basename(os.path.normpath(run_dir)),
                f"{evals[-1]['pass@1']:.3f} / {evals[-1]['pass@1_bf16_trainer']:.3f}",
            ]
            + [
                ", ".join(f"{window(key, m):{fmt}}" for m in marks)
                for key, fmt in (
                    ("mismatch/abs_diff_mean", ".2e"),
                    ("mismatch/abs_diff_max", ".3f"),
                    ("routing_disagreement", ".2%"),
                )
            ]
            + [
                f"{sum(r['rollout_tokens_per_s'] for r in steps) / len(steps):,.0f}",
                f"{sum(r['step_s'] for r in steps) / len(steps):.2f}",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = runs.Parser(
        prog="python -m tools.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories (each with metrics.jsonl)"
    )
    parser.add_argument(
        "--out", default="", help="the figure (default: RUN_DIR/curves.png for one run)"
    )
    parser.add_argument(
        "--window", type=int, default=10, help="steps of the trailing mean (default: 10)"
    )
    parser.add_argument(
        "--table", action="store_true", help="also print a markdown table of the runs"
    )
    args = parser.parse_args(argv)
    missing = [d for d in args.runs if not os.path.exists(os.path.join(d, "metrics.jsonl"))]
    if missing:
        parser.error(f"argument RUN_DIR: no metrics.jsonl in {missing[0]}")
    if not args.out and len(args.runs) > 1:
        parser.error("argument --out: required with several runs (where the shared figure goes)")
    plot(args.runs, args.out or os.path.join(args.runs[0], "curves.png"), args.window)
    if args.table:
        print(summarize(args.runs))


if __name__ == "__main__":
    main()
