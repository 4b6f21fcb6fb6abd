"""Figures and tables of finished runs: reward, pass@1 and mismatch over the RL steps.

    python -m tools.plot runs/quads                          # runs/quads/curves.png
    python -m tools.plot runs/bf16 runs/nvfp4 runs/quads --out runs/three.png --table

Reads each run's metrics.jsonl (train.py's log) and config.json; writes nothing else. The figure is
titled with what the runs share (recipe, preset, seed, steps, and the commit of the last start from
config.json's provenance) and has one legend for all its panels.
"""

import argparse
import json
import math
import os
import sys

# also as a plain script
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import runs  # noqa: E402


def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are
    noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def read_config(run_dir):
    """A run's config.json as a dict ({} when it has none: a run made before it was written)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def figure_title(run_dirs):
    """The figure's title: each of recipe, preset, seed, steps and commit, with its value when the
    runs share it and "various" when they do not (the legend tells the runs apart). The commit is
    that of each run's last start, "+changes" when its tree had uncommitted changes."""
    configs = [read_config(run_dir) for run_dir in run_dirs]

    def commit(config):
        starts = config.get("provenance") or [{}]
        last = starts[-1]
        if not last.get("commit"):
            return None
        return last["commit"][:7] + ("+changes" if last.get("dirty") else "")

    values = {
        "recipe": [c.get("recipe") for c in configs],
        "preset": [c.get("preset") or c.get("model") for c in configs],
        "seed": [c.get("seed") for c in configs],
        "steps": [c.get("steps") for c in configs],
        "commit": [commit(c) for c in configs],
    }
    parts = []
    for name, seen in values.items():
        known = {value for value in seen if value is not None}
        if len(known) == 1 and None not in seen:
            parts.append(f"{name} {known.pop()}")
        elif known:
            parts.append(f"{name} various")
    return ", ".join(parts)


def plot(run_dirs, path, window=10):
    """Reward, pass@1 and mismatch (mean and max |delta logp|, routing disagreement) over steps;
    every per-step curve is a trailing `window`-step mean (pass@1 evaluations are plotted as they
    are). One legend above the panels names the runs, whose colours are the same in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    panels = [
        ("reward", "reward (train batch)"),
        ("pass@1", "pass@1 (rollout model, held-out)"),
        ("mismatch/abs_diff_mean", "mean |delta logp|"),
        ("mismatch/abs_diff_max", "max |delta logp|"),
        ("mismatch/kl_k3", "K3 KL(rollout || trainer)"),
        ("routing_disagreement", "routing disagreement"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = []
    for index, run_dir in enumerate(run_dirs):
        records = runs.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        label = os.path.basename(os.path.normpath(run_dir))
        colour = colours[index % len(colours)]
        handles.append(Line2D([], [], color=colour, label=label))
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
                    color=colour,
                    marker="o" if key == "pass@1" else None,
                    markersize=3,
                )
            smoothed = "" if key == "pass@1" or window == 1 else f", {window}-step mean"
            ax.set_title(title + smoothed, fontsize=10)
            ax.set_xlabel("RL step", fontsize=8)
            if "mismatch" in key:
                ax.set_yscale("log")
    fig.suptitle(figure_title(run_dirs), fontsize=11)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=8, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"figure: {path}")


def summarize(run_dirs, checkpoints=(50, 100)):
    """A markdown table of the runs, one row each, its headers saying what each column holds: the
    last evaluation's pass@1 (rollout model / BF16 trainer, with its step); the mean |delta logp|,
    the largest per-step max |delta logp| (the run summary's "max") and the mean routing
    disagreement over the 10 steps up to each checkpoint step and up to the end; the mean rollout
    tokens/s and step time over the run."""
    tables = []
    for run_dir in run_dirs:
        records = runs.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        steps = [r for r in records if r["step"] > 0]
        evals = [r for r in records if "pass@1" in r]
        if steps and evals:
            tables.append((run_dir, steps, evals))
    # the checkpoint steps that every run has passed: one set of columns for all rows
    shared = [c for c in checkpoints if all(c < steps[-1]["step"] for _, steps, _ in tables)]
    rows = []
    for run_dir, steps, evals in tables:
        marks = shared + [steps[-1]["step"]]

        def window(key, end, reduce):
            values = [
                r[key] for r in steps if end - 10 < r["step"] <= end and not math.isnan(r[key])
            ]
            return reduce(values) if values else math.nan

        def mean(values):
            return sum(values) / len(values)

        rows.append(
            [
                os.path.basename(os.path.normpath(run_dir)),
                f"{evals[-1]['pass@1']:.3f} / "
                f"{evals[-1].get('pass@1_bf16_trainer', math.nan):.3f} "
                f"(step {evals[-1]['step']})",
            ]
            + [
                ", ".join(f"{window(key, m, reduce):{fmt}}" for m in marks)
                for key, reduce, fmt in (
                    ("mismatch/abs_diff_mean", mean, ".2e"),
                    ("mismatch/abs_diff_max", max, ".3f"),
                    ("routing_disagreement", mean, ".2%"),
                )
            ]
            + [
                f"{mean([r['rollout_tokens_per_s'] for r in steps]):,.0f}",
                f"{mean([r['step_s'] for r in steps]):.2f}",
            ]
        )
    windows = "".join(f"steps {max(1, c - 9)}-{c}, " for c in shared) + "the last 10 steps"
    header = [
        "run",
        "pass@1: rollout / BF16 trainer (last evaluation)",
        f"mean abs dlogp (mean of {windows})",
        f"max abs dlogp (largest step max of {windows})",
        f"routing disagreement (mean of {windows})",
        "rollout tokens/s (mean)",
        "step time, s (mean)",
    ]
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
