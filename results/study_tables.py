"""Rebuild the tables and the figures of RESULTS.md from the study folders beside this script.

    python results/study_tables.py          # from the repository root; CPU, a few seconds

Each study folder holds what the runs wrote and a README.md with the command, the commits and the machines:

    cpu_replication_600steps   12 recipes x 5-8 seeds, tiny preset, lr 3e-4, 600 steps: one folder per run
                               (config.json, metrics.jsonl gzipped); two outlier reports
    h200_audit                 the log-prob audit (tools.audit) and the outlier report of one small-preset
                               checkpoint on the H200, as the tool wrote them
    cpu_width_sweep            bf16, nvfp4 and quads on the tiny preset widened to 128 and 256 (the
                               replication's command with --preset-overrides), one folder per run

This script reads only those files (it imports nothing from the project, so it runs on any checkout),
prints every table of RESULTS.md as markdown and draws figures/cpu_replication_600steps.png and
figures/cpu_width_sweep.png.
"""

import gzip
import json
import math
import os
import random
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(os.path.dirname(HERE), "figures")
REPLICATION = os.path.join(HERE, "cpu_replication_600steps")
WIDTH_SWEEP = os.path.join(HERE, "cpu_width_sweep")
ORDER = [
    "bf16",
    "fp8",
    "nvfp4",
    "w4a16",
    "w16a4",
    "qat",
    "rac",
    "quads",
    "moeresq",
    "trace",
    "nvfp4+row",
    "quads+row",
]
COMMAND = (
    "python train.py --recipe R [--act-scale row] --steps 600 --lr 3e-4 --eval-prompts 512 --seed S"
)


# ----------------------------------------------------------------------------- reading runs
def records_of(run_dir):
    """The run's metrics.jsonl as train.py wrote it, or gzipped (metrics.jsonl.gz: the studies' runs, kept small)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) if os.path.isfile(path) else gzip.open(path + ".gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(records):
    """The RL steps' records (step 0 holds only the first evaluation)."""
    return [r for r in records if r["step"] > 0]


def evals_of(records):
    return [r for r in records if "pass@1" in r]


def mean(records, key, lo=0, hi=10**9):
    """Mean of `key` over the records of steps lo < step <= hi (NaN values skipped)."""
    values = [r[key] for r in records if lo < r["step"] <= hi and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def replication_runs(base=REPLICATION, suffix=""):
    """{recipe: {seed: records}} of the runs named recipe<suffix>_s<seed> that finished their 600 steps."""
    runs = {}
    for name in sorted(os.listdir(base)):
        head, _, seed = name.rpartition("_s")
        path = os.path.join(base, name)
        if seed.isdigit() and head.endswith(suffix) and os.path.isdir(path):
            records = records_of(path)
            if records[-1]["step"] == 600:
                runs.setdefault(head[: len(head) - len(suffix)], {})[int(seed)] = records
    return runs


def width_runs(widths=(128, 256)):
    """{width: {recipe: {seed: records}}}: the replication's bf16, nvfp4 and quads at width 64, the sweep's
    runs recipe_d<width>_s<seed> at the others."""
    out = {64: {r: v for r, v in replication_runs().items() if r in WIDTH_RECIPES}}
    for width in widths:
        out[width] = {
            r: v
            for r, v in replication_runs(WIDTH_SWEEP, f"_d{width}").items()
            if r in WIDTH_RECIPES
        }
    return out


def probe_runs(base=WIDTH_SWEEP):
    """The probes: short runs of other shapes (folders probe_*), with their width, depth and recipe."""
    probes = []
    for name in sorted(n for n in os.listdir(base) if n.startswith("probe_")):
        with open(os.path.join(base, name, "config.json")) as f:
            config = json.load(f)
        fields = dict(item.split("=") for item in config["preset_overrides"].split(","))
        probes.append(
            {
                "dim": fields.get("dim", "64"),
                "n_layers": fields.get("n_layers", "2"),
                "recipe": config["recipe"],
                "records": records_of(os.path.join(base, name)),
            }
        )
    return probes


# ----------------------------------------------------------------------------- statistics and tables
def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join(
        ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
        + ["| " + " | ".join(row) + " |" for row in rows]
    )


def bootstrap_interval(values, draws=10000, seed=0):
    """95% percentile-bootstrap interval of the mean of `values` (e.g. per-seed paired differences)."""
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


METRICS = [  # (column, format, value of one run's records)
    ("late reward (301-600)", ".3f", lambda r: mean(steps_of(r), "reward", 300)),
    ("final pass@1, rollout", ".3f", lambda r: evals_of(r)[-1]["pass@1"]),
    ("final pass@1, BF16 trainer", ".3f", lambda r: evals_of(r)[-1]["pass@1_bf16_trainer"]),
    ("mean abs dlogp", ".2e", lambda r: mean(steps_of(r), "mismatch/abs_diff_mean")),
    ("per-step max abs dlogp", ".2f", lambda r: mean(steps_of(r), "mismatch/abs_diff_max")),
    ("routing disagr.", ".1%", lambda r: mean(steps_of(r), "routing_disagreement")),
    (
        "gap growth (501-600 / 1-100)",
        ".2f",
        lambda r: (
            mean(steps_of(r), "mismatch/abs_diff_mean", 500)
            / mean(steps_of(r), "mismatch/abs_diff_mean", 0, 100)
        ),
    ),
]


def run_values(runs, metrics=METRICS):
    """{recipe: {seed: [metric values]}} in ORDER."""
    return {
        r: {s: [f(records) for _, _, f in metrics] for s, records in runs[r].items()}
        for r in ORDER
        if r in runs
    }


def paired(values, recipe, reference, index):
    """Per-seed differences recipe - reference of metric `index`, on the seeds both have."""
    seeds = sorted(set(values[recipe]) & set(values.get(reference, {})))
    return [values[recipe][s][index] - values[reference][s][index] for s in seeds]


def difference_cell(diffs):
    if not diffs:
        return "-"
    interval = (
        "[{:+.3f}, {:+.3f}]".format(*bootstrap_interval(diffs)) if len(diffs) >= 3 else "(n < 3)"
    )
    return f"{statistics.mean(diffs):+.3f} {interval}"


def seed_mean_rows(values, metrics=METRICS):
    """[recipe, seeds, the seed mean of each metric] per recipe."""
    return [
        [r, str(len(v))]
        + [
            f"{statistics.mean(x[i] for x in v.values()):{fmt}}"
            for i, (_, fmt, _) in enumerate(metrics)
        ]
        for r, v in values.items()
    ]


def per_recipe_table(values):
    return table(["recipe", "seeds"] + [c for c, _, _ in METRICS], seed_mean_rows(values))


def headline_table(values):
    """Late reward and final pass@1: the mean over seeds, and the paired per-seed differences against bf16
    and against nvfp4 with 95% bootstrap intervals."""
    rows = []
    for recipe, v in values.items():
        row = [recipe, str(len(v))]
        for index in (0, 1):
            row.append(f"{statistics.mean(x[index] for x in v.values()):.3f}")
            row += [
                difference_cell(paired(values, recipe, ref, index)) if recipe != ref else "-"
                for ref in ("bf16", "nvfp4")
            ]
        rows.append(row)
    return table(
        [
            "recipe",
            "seeds",
            "late reward",
            "minus bf16",
            "minus nvfp4",
            "final pass@1",
            "minus bf16",
            "minus nvfp4",
        ],
        rows,
    )


def row_scale_table(values):
    """The per-row activation scale against the per-tensor one, paired per seed."""
    rows = [
        [f"{recipe}+row minus {recipe}"]
        + [difference_cell(paired(values, f"{recipe}+row", recipe, i)) for i in (0, 1, 3)]
        for recipe in ("nvfp4", "quads")
        if f"{recipe}+row" in values and recipe in values
    ]
    return table(["pair", "late reward", "final pass@1", "mean abs dlogp"], rows)


WIDTH_RECIPES = ("bf16", "nvfp4", "quads")


def width_table(sweep):
    """Per width: the warm-started policy's pass@1; the paired per-seed differences nvfp4 - bf16 of the
    reward of steps 1-100 (while even the widest BF16 policy has room to learn) and of late reward (the
    failure criterion); late reward per recipe; QUADS's recovery (quads - nvfp4); final pass@1 nvfp4 - bf16."""
    early = ("reward 1-100", ".3f", lambda records: mean(steps_of(records), "reward", 0, 100))
    rows = []
    for width, runs in sweep.items():
        values = run_values(runs, METRICS + [early])
        start = [evals_of(rec)[0]["pass@1"] for rec in runs.get("bf16", {}).values()]
        seeds = "/".join(str(len(runs.get(r, {}))) for r in WIDTH_RECIPES)
        late = [
            f"{statistics.mean(x[0] for x in values[r].values()):.3f}" if r in values else "-"
            for r in WIDTH_RECIPES
        ]
        diffs = [
            difference_cell(paired(values, a, b, i)) if a in values and b in values else "-"
            for a, b, i in (
                ("nvfp4", "bf16", len(METRICS)),
                ("nvfp4", "bf16", 0),
                ("quads", "nvfp4", 0),
                ("nvfp4", "bf16", 1),
            )
        ]
        rows.append(
            [str(width), seeds, f"{statistics.mean(start):.3f}" if start else "-"]
            + diffs[:1]
            + late
            + diffs[1:]
        )
    return table(
        [
            "width",
            "seeds (bf16/nvfp4/quads)",
            "pass@1 at step 0",
            "reward 1-100, nvfp4 minus bf16",
            "late reward bf16",
            "nvfp4",
            "quads",
            "late reward, nvfp4 minus bf16",
            "quads minus nvfp4",
            "final pass@1, nvfp4 minus bf16",
        ],
        rows,
    )


GAP_METRICS = [
    (
        "mean abs dlogp, steps 1-100",
        ".2e",
        lambda r: mean(steps_of(r), "mismatch/abs_diff_mean", 0, 100),
    ),
    ("steps 1-600", *METRICS[3][1:]),
    ("per-step max", *METRICS[4][1:]),
    METRICS[6],
    METRICS[5],
    ("trainer perplexity", ".3f", lambda r: mean(steps_of(r), "mismatch/trainer_ppl")),
]


def width_gap_table(sweep):
    """Per width and recipe, seed means: the train/rollout gap over the first 100 steps and all 600, its
    per-step max and growth, routing disagreement, and the trainer's perplexity of the sampled tokens."""
    rows = [
        [str(width)] + row
        for width, runs in sweep.items()
        for row in seed_mean_rows(run_values(runs, GAP_METRICS), GAP_METRICS)
    ]
    return table(
        ["width", "recipe", "seeds"] + [c for c, _, _ in GAP_METRICS],
        rows,
        ["---:", "---"] + ["---:"] * 7,
    )


def nll(records):
    """The trainer's mean negative log-prob a sampled token, ln of its perplexity, per step."""
    return [dict(r, nll=math.log(r["mismatch/trainer_ppl"])) for r in records]


def uncertainty_table(sweep, probes, steps=10):
    """The gap at the start of RL (steps 1-10) against how uncertain the policy is there (the trainer's
    mean negative log-prob a sampled token): a token's |delta logp| is about (1 - p) times the error of its
    logit margins, so gap / NLL estimates the logit error itself. Rows: the sweep (seed means), the probes
    (one run each), the small preset on the H200 (its 10-step quads run; nvfp4 from the audit's A-C MAE at
    that run's checkpoint, over the run's NLL)."""
    rows = []
    entries = [
        (f"{w}", "2", r, list(runs[r].values()))
        for w, runs in sweep.items()
        for r in ("nvfp4", "quads")
        if r in runs
    ]
    entries += [(p["dim"], p["n_layers"], p["recipe"], [p["records"]]) for p in probes]
    for width, layers, recipe, runs in sorted(entries, key=lambda e: (int(e[0]), int(e[1]), e[2])):
        gap = statistics.mean(mean(steps_of(r), "mismatch/abs_diff_mean", 0, steps) for r in runs)
        uncertainty = statistics.mean(mean(nll(steps_of(r)), "nll", 0, steps) for r in runs)
        rows.append(
            [
                width,
                layers,
                recipe,
                str(len(runs)),
                f"{uncertainty:.3f}",
                f"{gap:.2e}",
                f"{gap / uncertainty:.3f}",
            ]
        )
    small = steps_of(records_of(os.path.join(HERE, "h200_audit")))
    uncertainty = mean(nll(small), "nll", 0, steps)
    audit_nvfp4 = [
        float(x) for x in audit_rows(os.path.join(HERE, "h200_audit", "audit.md"))["nvfp4"][2]
    ]
    for recipe, gap in (
        ("nvfp4 (audit)", statistics.mean(audit_nvfp4)),
        ("quads", mean(small, "mismatch/abs_diff_mean", 0, steps)),
    ):
        rows.append(
            [
                "512 (small preset, H200)",
                "8",
                recipe,
                "1",
                f"{uncertainty:.3f}",
                f"{gap:.2e}",
                f"{gap / uncertainty:.3f}",
            ]
        )
    return table(
        [
            "width",
            "layers",
            "recipe",
            "runs",
            "trainer NLL a token",
            "mean abs dlogp",
            "gap per nat of NLL",
        ],
        rows,
        ["---", "---:", "---"] + ["---:"] * 4,
    )


# ----------------------------------------------------------------------------- the figure
def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(
    runs, values, path, recipes=("bf16", "w4a16", "quads", "trace", "w16a4", "nvfp4"), window=25
):
    """Train reward and mean |delta logp| over steps (seed means, trailing 25-step means), and each
    recipe's late reward with the 95% bootstrap interval of its seed mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    seeds = sorted(set.union(*(set(runs[r]) for r in ORDER if r in runs)))
    n_runs = sum(len(runs[r]) for r in ORDER if r in runs)
    for recipe in recipes:
        per_seed = [steps_of(runs[recipe][s]) for s in runs[recipe]]
        for ax, key in zip(axes[:2], ("reward", "mismatch/abs_diff_mean")):
            curve = [statistics.mean(s[i][key] for s in per_seed) for i in range(600)]
            ax.plot(range(1, 601), smooth(curve, window), label=f"{recipe} ({len(per_seed)} seeds)")
    axes[0].set_title(f"train reward, seed mean, {window}-step mean", fontsize=10)
    axes[1].set_title(f"mean |delta logp| rollout vs trainer, {window}-step mean", fontsize=10)
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xlabel("RL step", fontsize=9)
    axes[0].legend(fontsize=8)
    names = list(values)
    late = [[x[0] for x in values[r].values()] for r in names]
    centers = [statistics.mean(v) for v in late]
    low, high = zip(*(bootstrap_interval(v) for v in late))
    axes[2].errorbar(
        range(len(names)),
        centers,
        yerr=[[c - lo for c, lo in zip(centers, low)], [hi - c for c, hi in zip(centers, high)]],
        fmt="o",
    )
    axes[2].set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    axes[2].set_title("late reward (steps 301-600), seed mean, 95% bootstrap", fontsize=10)
    fig.suptitle(
        f"CPU, tiny preset, {n_runs} runs, seeds {min(seeds)}-{max(seeds)} (per recipe in the legend "
        f"and RESULTS.md), commits f233fbb and 8d36956: {COMMAND}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_widths(sweep, path, window=25):
    """Per width, train reward of each recipe (seed means, trailing 25-step means); then nvfp4's and
    quads's mean |delta logp| at every width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep) + 1, figsize=(4.6 * (len(sweep) + 1), 4.2))
    for ax, (width, runs) in zip(axes, sweep.items()):
        for recipe in (r for r in WIDTH_RECIPES if r in runs):
            per_seed = [steps_of(rec) for rec in runs[recipe].values()]
            curve = [statistics.mean(s[i]["reward"] for s in per_seed) for i in range(600)]
            ax.plot(range(1, 601), smooth(curve, window), label=f"{recipe} ({len(per_seed)} seeds)")
            if recipe != "bf16":
                gap = [
                    statistics.mean(s[i]["mismatch/abs_diff_mean"] for s in per_seed)
                    for i in range(600)
                ]
                axes[-1].plot(
                    range(1, 601),
                    smooth(gap, window),
                    label=f"{recipe}, width {width}",
                    ls="-" if recipe == "nvfp4" else "--",
                    color=f"C{list(sweep).index(width)}",
                )
        ax.set_title(f"width {width}: train reward, seed mean, {window}-step mean", fontsize=9)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    axes[-1].set_yscale("log")
    axes[-1].set_title(f"mean |delta logp| rollout vs trainer, {window}-step mean", fontsize=9)
    axes[-1].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("RL step", fontsize=9)
    fig.suptitle(
        "CPU, tiny preset at width 64 (the replication's runs) and widened (commit 0c80b9c); seeds per "
        "recipe in the legends\npython train.py --recipe R --steps 600 --lr 3e-4 --eval-prompts 512 --seed S"
        " [--preset-overrides dim=W,head_dim=W/4,expert_dim=W]",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- RESULTS.md
def audit_rows(path):
    """{recipe: [[A-B MAE, B-C MAE, A-C MAE, A-C p99] per batch]} from the audit.md tools.audit wrote, as
    printed there."""
    rows = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and cells[0] != "recipe" and not cells[0].startswith("---"):
                rows.setdefault(cells[0].split(" (batch")[0], []).append(
                    [cells[i] for i in (3, 8, 13, 15)]
                )
    return {name: [list(column) for column in zip(*batches)] for name, batches in rows.items()}


def audit_summary(path):
    """The audit's mean absolute errors (A-B, B-C, A-C) and A-C p99, one row per recipe, its batches side
    by side."""
    return table(
        ["recipe", "A-B MAE", "B-C MAE", "A-C MAE", "A-C p99"],
        [
            [name] + [" / ".join(column) for column in columns]
            for name, columns in audit_rows(path).items()
        ],
    )


def outlier_summary(reports):
    """{model: outliers.md} -> per model and kind of input (over its layers): the range of max/RMS, of the
    largest over the median block amax, of the blocks below 2^-6, and of the relative error per tensor / row."""
    rows = []
    for model, path in reports.items():
        kinds = {}
        with open(path) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if cells[0].startswith("layers."):
                    kind = cells[0].split(".", 2)[2].replace("q_proj (+2 sharing it)", "q/k/v_proj")
                    kinds.setdefault(kind, []).append([float(c) for c in cells[2:]])
        for kind, layers in kinds.items():
            ranges = [
                f"{min(v):.3g}" + (f"-{max(v):.3g}" if max(v) > min(v) else "")
                for v in zip(*layers)
            ]
            rows.append(
                [model, f"{kind} ({len(layers)} layers)"]
                + ranges[:3]
                + [f"{ranges[3]} / {ranges[4]}"]
            )
    return table(
        [
            "model",
            "input",
            "max/RMS",
            "block amax max/median",
            "blocks below 2^-6",
            "rel. error, tensor / row scale",
        ],
        rows,
        ["---", "---"] + ["---:"] * 4,
    )


def main():
    runs = replication_runs()
    values = run_values(runs)
    sections = [
        (
            "The replication: late reward and final pass@1 with paired 95% intervals",
            headline_table(values),
        ),
        ("The replication: every metric, seed means", per_recipe_table(values)),
        ("Per-row against per-tensor activation scales, paired per seed", row_scale_table(values)),
        (
            "H200: the log-prob audit of a small-preset checkpoint, two batches (batch 1 / batch 2)",
            audit_summary(os.path.join(HERE, "h200_audit", "audit.md")),
        ),
        (
            "The inputs NVFP4 quantizes: outliers per kind of input, range over layers",
            outlier_summary(
                {
                    "small, H200 (quads, step 10)": os.path.join(HERE, "h200_audit", "outliers.md"),
                    "tiny, CPU (bf16 seed 0, step 600)": os.path.join(
                        REPLICATION, "outliers_bf16_s0.md"
                    ),
                    "tiny, CPU (nvfp4 seed 0, step 600)": os.path.join(
                        REPLICATION, "outliers_nvfp4_s0.md"
                    ),
                }
            ),
        ),
        (
            "Width: the replication's three recipes on the tiny preset at widths 64, 128 and 256",
            width_table(width_runs()),
        ),
        ("Width: the train/rollout gap, seed means", width_gap_table(width_runs())),
        (
            "The gap at the start of RL against the policy's uncertainty, steps 1-10",
            uncertainty_table(width_runs(), probe_runs()),
        ),
    ]
    for title, text in sections:
        print(f"## {title}\n\n{text}\n")
    os.makedirs(FIGURES, exist_ok=True)
    plot(runs, values, os.path.join(FIGURES, "cpu_replication_600steps.png"))
    sweep = {width: runs for width, runs in width_runs().items() if runs}
    plot_widths(sweep, os.path.join(FIGURES, "cpu_width_sweep.png"))
    print(f"figures written to {FIGURES}: cpu_replication_600steps.png, cpu_width_sweep.png")


if __name__ == "__main__":
    main()
