"""Rebuild the tables and figures of RESULTS.md from the study folders beside this script.

    python results/study_tables.py          # from the repository root; CPU, a few seconds

Each study folder holds one run per subfolder (`config.json`, `metrics.jsonl`: one JSON line per RL step,
as train.py writes them) and a README.md with the command, the commit and the machine it ran on. This
script reads only those files (it imports nothing from the project, so it runs on any checkout), prints
every table of RESULTS.md as markdown and draws the figures into figures/.

    cpu_replication_600steps       11 recipes incl. w4a16, w16a4 and row scales, seeds as finished (CPU)
    h200_200steps                  every recipe, 200 steps, two seeds; the RAC ratio sweep (H200)
    h200_lr1e-4, h200_d6           the two knobs tried to make naive NVFP4 drift (H200)
    h200_audit                     the three-way log-prob audit of a quads checkpoint (H200)
    cpu_lr3e-4_600steps            six rollout precisions, three seeds, where FP4 error is large (CPU)
    cpu_lr3e-4_30steps_check       the symmetric recipes beside QUADS, 30 steps, one seed (CPU)
    cpu_lr3e-4_600steps_symmetric  the same, 600 steps, three seeds (CPU)

Averages skip NaN values; "trainer NLL" is log(mean trainer perplexity) over the steps asked for.
"""
import json
import math
import os
import random
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(os.path.dirname(HERE), "figures")
# QUADS paper (arXiv 2607.15810): per-step maximum |delta logp| against the RAC ratio; naive "about 1.3"
PAPER_MAX_GAP = {0.0: 1.3, 0.125: 0.923, 0.25: 0.901, 0.5: 0.854, 0.75: 0.812, 1.0: 0.759}


# ----------------------------------------------------------------------------- reading runs
def records_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(run_dir):
    """The RL steps' records (step 0 holds only the first evaluation)."""
    return [r for r in records_of(run_dir) if r["step"] > 0]


def evals_of(run_dir):
    return [r for r in records_of(run_dir) if "pass@1" in r]


def mean(records, key, lo=0, hi=10**9):
    """Mean of `key` over the records of steps lo < step <= hi."""
    values = [r[key] for r in records if lo < r["step"] <= hi and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def nll(records, lo=0, hi=10**9):
    """The trainer's mean per-token NLL of the sampled completions (log of its perplexity)."""
    return math.log(mean(records, "mismatch/trainer_ppl", lo, hi))


def ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a, b):
    return statistics.correlation(ranks(a), ranks(b))


# ----------------------------------------------------------------------------- tables
def table(header, rows, align=None):
    align = align or ["---"] * len(header)
    return "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def summarize(base, names, marks=(50, 100)):
    """Final pass@1 (rollout model / BF16 trainer); mean and max |delta logp| and routing disagreement
    averaged over the 10 steps up to each mark and the last step; mean rollout tokens/s and step time.
    (train.py --compare writes the same table for its runs.)"""
    rows = []
    for name in names:
        steps, evals = steps_of(os.path.join(base, name)), evals_of(os.path.join(base, name))
        ends = [m for m in marks if m < steps[-1]["step"]] + [steps[-1]["step"]]
        cells = [name, f"{evals[-1]['pass@1']:.3f} / {evals[-1]['pass@1_bf16_trainer']:.3f}"]
        for key, fmt in (("mismatch/abs_diff_mean", ".2e"), ("mismatch/abs_diff_max", ".3f"),
                         ("routing_disagreement", ".2%")):
            cells.append(", ".join(f"{mean(steps, key, end - 10, end):{fmt}}" for end in ends))
        cells += [f"{mean(steps, 'rollout_tokens_per_s'):,.0f}", f"{mean(steps, 'step_s'):.2f}"]
        rows.append(cells)
    at = ", ".join(map(str, ends))
    return table(["run", "pass@1 rollout / bf16 trainer", f"mean abs dlogp @ {at}", f"max abs dlogp @ {at}",
                  f"routing disagr. @ {at}", "rollout tok/s", "step s"], rows)


def whole_run_table(base, names):
    """Averages over the whole run and over its first and last 50 steps."""
    rows = []
    for name in names:
        s = steps_of(os.path.join(base, name))
        n = s[-1]["step"]
        e = [r["pass@1"] for r in evals_of(os.path.join(base, name)) if r["step"] > 0]
        rows.append([name, str(n),
                     f"{mean(s, 'mismatch/abs_diff_mean'):.2e} / {mean(s, 'mismatch/abs_diff_mean', 0, 50):.2e}"
                     f" / {mean(s, 'mismatch/abs_diff_mean', n - 50):.2e}",
                     f"{mean(s, 'mismatch/abs_diff_max'):.3f} / {max(r['mismatch/abs_diff_max'] for r in s):.2f}",
                     f"{mean(s, 'routing_disagreement'):.2%}", f"{nll(s, 0, 50):.4f} / {nll(s, n - 50):.4f}",
                     f"{mean(s, 'reward', n - 50):.3f}", f"{statistics.mean(e):.3f}"])
    return table(["run", "steps", "mean abs dlogp: all / 1-50 / last 50", "per-step max abs dlogp: mean / largest",
                  "routing disagr.", "trainer NLL 1-50 / last 50", "train reward, last 50",
                  "pass@1 rollout: mean of evals after step 0"], rows,
                 ["---", "---:", "---", "---", "---:", "---", "---:", "---:"])


def racsweep_rates(path):
    """{RAC ratio: (tokens/s at batch 64, at batch 256)} from a `bench.py racsweep` table."""
    rates = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[0].startswith("rac nvfp4 + RAC"):
                ratio, batch = float(cells[0].split()[-1]), int(cells[1])
                rates.setdefault(ratio, {})[batch] = int(cells[3].replace(",", ""))
    return {ratio: (r[64], r[256]) for ratio, r in rates.items()}


def sweep_table(base):
    runs = {0.0: "nvfp4", 0.125: "rac@0.125", 0.25: "rac@0.25", 0.5: "rac", 0.75: "rac@0.75", 1.0: "rac@1"}
    bench = racsweep_rates(os.path.join(base, "bench_racsweep.md"))
    naive = steps_of(os.path.join(base, "nvfp4"))
    n = naive[-1]["step"]
    rows = []
    for ratio, name in runs.items():
        s = steps_of(os.path.join(base, name))
        e = [r["pass@1"] for r in evals_of(os.path.join(base, name)) if r["step"] > 0]
        m = mean(s, "mismatch/abs_diff_max")
        rows.append([f"{ratio:g}", f"{m:.3f}", f"{m / mean(naive, 'mismatch/abs_diff_max'):.2f}x",
                     f"{PAPER_MAX_GAP[ratio]:.3f}", f"{PAPER_MAX_GAP[ratio] / PAPER_MAX_GAP[0.0]:.2f}x",
                     f"{mean(s, 'mismatch/abs_diff_mean'):.2e}", f"{mean(s, 'routing_disagreement'):.2%}",
                     f"{e[-1]:.3f} / {statistics.mean(e):.3f}", f"{bench[ratio][0]:,} / {bench[ratio][1]:,}"])
    return table(["RAC ratio", f"per-step max abs dlogp (mean over {n} steps)", "vs naive", "paper: per-step max",
                  "paper vs naive", "mean abs dlogp", "routing disagr.", f"pass@1 step {n} / mean of {len(e)} evals",
                  "decode tok/s, batch 64 / 256"], rows, ["---:"] * 7 + ["---", "---"])


def eval_table(base, names, both=False):
    """Held-out pass@1 of the rollout model at every evaluation (and of the BF16 trainer with `both`)."""
    marks = [r["step"] for r in evals_of(os.path.join(base, names[0]))]
    rows = []
    for name in names:
        rows.append([name] + [f"{r['pass@1']:.2f} / {r['pass@1_bf16_trainer']:.2f}" if both else f"{r['pass@1']:.3f}"
                              for r in evals_of(os.path.join(base, name))])
    return table(["run"] + [f"step {m}" for m in marks], rows, ["---"] + ["---:"] * len(marks))


def reward_per_100(base, names):
    rows = []
    for name in names:
        s = steps_of(os.path.join(base, name))
        rows.append([name] + [f"{mean(s, 'reward', a, a + 100):.3f}" for a in range(0, s[-1]["step"], 100)])
    return table(["run"] + [f"{a + 1}-{a + 100}" for a in range(0, 600, 100)], rows, ["---"] + ["---:"] * 6)


def dose_response(base, recipes, seeds, figure):
    """Each run's mean |delta logp| over all steps against its train reward over the second half; the
    Spearman rank correlation across runs; a scatter plot of the two (figures/`figure`)."""
    points, rows = [], []
    for recipe in recipes:
        cells = [recipe]
        for seed in seeds:
            s = steps_of(os.path.join(base, f"seed{seed}_{recipe}"))
            gap, reward = mean(s, "mismatch/abs_diff_mean"), mean(s, "reward", s[-1]["step"] // 2)
            points.append((recipe, seed, gap, reward))
            cells.append(f"{gap:.4f} / {reward:.3f}")
        rows.append(cells)
    rho = spearman([p[2] for p in points], [p[3] for p in points])
    print(table(["recipe"] + [f"seed {s}: mean abs dlogp / reward, second half" for s in seeds], rows))
    print(f"\nSpearman rank correlation of mean gap and second-half reward over the {len(points)} runs: "
          f"{rho:.2f}")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, recipe in enumerate(recipes):
        xs = [max(p[2], 1e-4) for p in points if p[0] == recipe]
        ax.scatter(xs, [p[3] for p in points if p[0] == recipe], label=recipe, color=f"C{i}")
    ax.set_xscale("log")
    ax.set_xlabel("mean |delta logp| over the run (bf16 drawn at 1e-4; it is 3e-7)", fontsize=8)
    ax.set_ylabel("train reward, steps 301-600", fontsize=8)
    ax.set_title(f"CPU tiny preset, lr 3e-4, three seeds: Spearman {rho:.2f}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, figure), dpi=80)
    plt.close(fig)


def per_recipe_table(base, recipes, seeds):
    """Per recipe over the seeds: the mean and, in parentheses, the range."""
    def cell(values, fmt):
        return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
    rows = []
    for recipe in recipes:
        runs = [steps_of(os.path.join(base, f"seed{seed}_{recipe}")) for seed in seeds]
        finals = [evals_of(os.path.join(base, f"seed{seed}_{recipe}"))[-1]["pass@1"] for seed in seeds]
        rows.append([recipe, cell([mean(s, "mismatch/abs_diff_mean") for s in runs], ".2e"),
                     cell([mean(s, "routing_disagreement") for s in runs], ".2%"),
                     cell([mean(s, "reward", s[-1]["step"] // 2) for s in runs], ".3f"), cell(finals, ".3f")])
    return table(["recipe", "mean abs dlogp", "routing disagr.", "reward 301-600", "final pass@1"], rows)


def bootstrap_interval(values, draws=10000, seed=0):
    """95% percentile-bootstrap interval of the mean of `values` (per-seed paired differences)."""
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def replication_runs(base):
    """{recipe: {seed: run dir}} of a study whose runs are named recipe_s<seed> and finished (600 steps)."""
    runs = {}
    for name in sorted(os.listdir(base)):
        recipe, _, seed = name.rpartition("_s")
        path = os.path.join(base, name)
        if seed.isdigit() and os.path.isfile(os.path.join(path, "metrics.jsonl")) and steps_of(path):
            if steps_of(path)[-1]["step"] == 600:
                runs.setdefault(recipe, {})[int(seed)] = path
    return runs


REPLICATION_METRICS = [  # (column, format, per-run value)
    ("late reward (301-600)", ".3f", lambda s, e: mean(s, "reward", 300)),
    ("pass@1 rollout", ".3f", lambda s, e: e[-1]["pass@1"]),
    ("pass@1 BF16 trainer", ".3f", lambda s, e: e[-1]["pass@1_bf16_trainer"]),
    ("mean abs dlogp", ".2e", lambda s, e: mean(s, "mismatch/abs_diff_mean")),
    ("per-step max abs dlogp", ".3f", lambda s, e: mean(s, "mismatch/abs_diff_max")),
    ("routing disagr.", ".2%", lambda s, e: mean(s, "routing_disagreement")),
    ("gap growth (501-600 / 1-100)", ".2f",
     lambda s, e: mean(s, "mismatch/abs_diff_mean", 500) / mean(s, "mismatch/abs_diff_mean", 0, 100)),
]


def replication_tables(base, order):
    """Per recipe the mean over seeds (and the seed count) of each metric; then, for late reward and final
    pass@1, the paired per-seed differences against bf16 and against nvfp4 with 95% bootstrap intervals."""
    runs = replication_runs(base)
    values = {r: {s: [f(steps_of(p), evals_of(p)) for _, _, f in REPLICATION_METRICS] for s, p in runs[r].items()}
              for r in order if r in runs}
    rows = [[r, str(len(v))] + [f"{statistics.mean(x[i] for x in v.values()):{fmt}}"
                                for i, (_, fmt, _) in enumerate(REPLICATION_METRICS)] for r, v in values.items()]
    out = [table(["recipe", "seeds"] + [c for c, _, _ in REPLICATION_METRICS], rows,
                 ["---", "---:"] + ["---:"] * len(REPLICATION_METRICS))]
    for index, label in ((0, "late reward"), (1, "final pass@1 of the rollout")):
        rows = []
        for recipe, v in values.items():
            cells = [recipe]
            for ref in ("bf16", "nvfp4"):
                seeds = sorted(set(v) & set(values.get(ref, {})))
                diffs = [v[s][index] - values[ref][s][index] for s in seeds]
                interval = "[{:+.3f}, {:+.3f}]".format(*bootstrap_interval(diffs)) if len(diffs) >= 3 else \
                    "(no interval under 3 seeds)"
                cells.append(f"{statistics.mean(diffs):+.3f} {interval} (n={len(diffs)})"
                             if diffs and recipe != ref else "-")
            rows.append(cells)
        out.append(f"Paired differences of {label}, per seed, mean [95% bootstrap interval]:\n\n"
                   + table(["recipe", "minus bf16", "minus nvfp4"], rows))
    return "\n\n".join(out)


def check_table(base, names):
    """The 30-step check: step 1 (same rollout tokens for nvfp4, qat, w4a4, trace) and the run's means."""
    rows = []
    for name in names:
        s, e = steps_of(os.path.join(base, name)), evals_of(os.path.join(base, name))
        rows.append([name, f"{s[0]['mismatch/abs_diff_mean']:.2e} / {mean(s, 'mismatch/abs_diff_mean'):.2e}",
                     f"{mean(s, 'mismatch/abs_diff_max'):.3f}", f"{mean(s, 'routing_disagreement'):.2%}",
                     f"{mean(s, 'mismatch/kl_k3'):.2e}", f"{nll(s):.4f}", f"{mean(s, 'reward'):.3f}",
                     f"{e[-1]['pass@1']:.3f} / {e[-1]['pass@1_bf16_trainer']:.3f}"])
    n = s[-1]["step"]
    return table(["recipe", f"mean abs dlogp: step 1 / steps 1-{n}", "per-step max abs dlogp, mean",
                  "routing disagr.", "K3 KL", "trainer NLL", f"train reward, {n} steps",
                  f"pass@1 step {n} rollout / bf16 trainer"], rows, ["---"] + ["---:"] * 7)


def audit_table(path):
    """The audit's summary: A recorded at decode, B one-prefill re-score, C the recipe's trainer."""
    with open(path) as f:
        audit = json.load(f)
    rows = []
    for recipe, r in audit["recipes"].items():
        rows.append([recipe, str(r["tokens"])]
                    + [f"{r[pair][key]:.1e}" if key != "abs_diff_max" else f"{r[pair][key]:.3g}"
                       for pair in ("A-B", "B-C") for key in ("abs_diff_mean", "abs_diff_p99", "abs_diff_max")]
                    + [f"{r['B-B replay max']:g}" if "B-B replay max" in r else "-"])
    return table(["recipe", "tokens", "A-B MAE", "A-B p99", "A-B max", "B-C MAE", "B-C p99", "B-C max",
                  "B replayed: max diff"], rows, ["---"] + ["---:"] * 8)


def gap_nll_correlation(run_dir):
    """Pearson correlation across steps of log(mean |delta logp|) and log(trainer NLL)."""
    s = [r for r in steps_of(run_dir) if r["mismatch/abs_diff_mean"] > 0]
    return statistics.correlation([math.log(r["mismatch/abs_diff_mean"]) for r in s],
                                  [math.log(math.log(r["mismatch/trainer_ppl"])) for r in s])


# ----------------------------------------------------------------------------- figures
def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def smooth(values, window):
    """Trailing mean over the last `window` values (fewer at the start): per-step RL metrics are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(base, names, figure, window=10):
    """Reward, pass@1 and mismatch (mean and max |delta logp|, K3 KL, routing disagreement) over steps;
    every per-step curve is a trailing `window`-step mean (pass@1 evaluations as they are)."""
    plt = pyplot()
    panels = [("reward", "reward (train batch)"), ("pass@1", "pass@1 (rollout model, held-out)"),
              ("mismatch/abs_diff_mean", "mean |delta logp|"), ("mismatch/abs_diff_max", "max |delta logp|"),
              ("mismatch/kl_k3", "K3 KL(rollout || trainer)"), ("routing_disagreement", "routing disagreement")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for name in names:
        records = records_of(os.path.join(base, name))
        for ax, (key, title) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in records
                      if key in r and r[key] is not None and not math.isnan(r[key])]
            if points and key != "pass@1":
                steps, values = zip(*points)
                points = list(zip(steps, smooth(values, window)))
            if points:
                ax.plot(*zip(*points), label=name, marker="o" if key == "pass@1" else None, markersize=3)
            ax.set_title(title + ("" if key == "pass@1" else f", {window}-step mean"), fontsize=10)
            ax.set_xlabel("RL step", fontsize=8)
            if "mismatch" in key:
                ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, figure), dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- the studies
def main():
    os.makedirs(FIGURES, exist_ok=True)
    b200, blr, bd6, bcpu, bsym, bcheck = (os.path.join(HERE, d) for d in (
        "h200_200steps", "h200_lr1e-4", "h200_d6", "cpu_lr3e-4_600steps", "cpu_lr3e-4_600steps_symmetric",
        "cpu_lr3e-4_30steps_check"))
    main_runs = ["bf16", "fp8", "nvfp4", "qat", "rac", "quads", "w4a4", "nvfp4+tis2", "quads+r3",
                 "seed1_bf16", "seed1_nvfp4", "seed1_quads"]
    lr_runs = ["seed0_bf16", "seed0_nvfp4", "seed0_quads", "seed1_bf16", "seed1_nvfp4", "seed1_quads",
               "seed2_nvfp4", "seed2_quads"]
    d6_runs = ["bf16", "nvfp4", "quads"]
    cpu_runs = [f"seed{s}_{r}" for s in (0, 1, 2) for r in ("bf16", "nvfp4", "quads")]
    symmetric = ("bf16", "nvfp4", "quads", "moeresq", "trace")
    sym_runs = [f"seed{s}_{r}" for s in (0, 1, 2) for r in symmetric]

    replication = ["bf16", "nvfp4", "w4a16", "w16a4", "qat", "rac", "quads", "moeresq", "trace", "nvfp4+row",
                   "quads+row"]
    sections = [
        ("CPU replication: 11 recipes, tiny preset, lr 3e-4, 600 steps, per-seed pairs",
         lambda: replication_tables(os.path.join(HERE, "cpu_replication_600steps"), replication)),
        ("H200, 200 steps, lr 2e-5: 10-step windows", lambda: summarize(b200, main_runs)),
        ("H200, 200 steps, lr 2e-5: whole run", lambda: whole_run_table(b200, main_runs)),
        ("H200: RAC ratio sweep", lambda: sweep_table(b200)),
        ("H200, lr 1e-4, 300 steps: whole run", lambda: whole_run_table(blr, lr_runs)),
        ("H200, lr 1e-4: held-out pass@1 of the rollout model", lambda: eval_table(blr, lr_runs)),
        ("H200, difficulty 6, lr 1e-4, 300 steps: whole run", lambda: whole_run_table(bd6, d6_runs)),
        ("H200, difficulty 6: held-out pass@1 of the rollout model", lambda: eval_table(bd6, d6_runs)),
        ("H200: the log-prob audit", lambda: audit_table(os.path.join(HERE, "h200_audit", "audit.json"))),
        ("CPU, lr 3e-4, 600 steps: whole run", lambda: whole_run_table(bcpu, cpu_runs)),
        ("CPU: train reward per 100 steps", lambda: reward_per_100(bcpu, cpu_runs)),
        ("CPU: held-out pass@1, rollout model / BF16 trainer", lambda: eval_table(bcpu, cpu_runs, both=True)),
    ]
    for title, make in sections:
        print(f"## {title}\n\n{make()}\n")

    print("## CPU: late train reward against the mismatch, six rollout precisions\n")
    dose_response(bcpu, ("bf16", "fp8", "rac@1", "quads", "rac", "nvfp4"), (0, 1, 2),
                  "cpu_lr3e-4_600steps_dose_response.png")
    print("\n## CPU: the symmetric recipes beside QUADS, 30 steps, one seed\n")
    print(check_table(bcheck, ["nvfp4", "qat", "quads", "w4a4", "moeresq", "trace"]))
    print("\n## CPU: the symmetric recipes beside QUADS, 600 steps, three seeds\n")
    print(whole_run_table(bsym, sym_runs) + "\n")
    dose_response(bsym, symmetric, (0, 1, 2), "cpu_lr3e-4_600steps_symmetric_dose_response.png")
    print("\n" + per_recipe_table(bsym, symmetric, (0, 1, 2)))

    print("\n## Correlation of log(mean gap) with log(trainer NLL) across steps\n")
    for base, names in ((b200, main_runs), (blr, lr_runs), (bd6, d6_runs)):
        print(f"- {os.path.basename(base)}: " + ", ".join(
            f"{n} {gap_nll_correlation(os.path.join(base, n)):.2f}" for n in names))

    plot(b200, ["bf16", "fp8", "nvfp4", "qat", "rac", "quads"], "h200_study_200steps.png")
    plot(b200, ["nvfp4", "w4a4", "nvfp4+tis2", "quads", "quads+r3"], "h200_variants_200steps.png")
    plot(b200, ["nvfp4", "rac@0.125", "rac@0.25", "rac", "rac@0.75", "rac@1"], "h200_rac_sweep_200steps.png")
    plot(blr, lr_runs, "h200_lr1e-4_300steps.png")
    plot(bd6, d6_runs, "h200_d6_300steps.png")
    plot(bcpu, cpu_runs, "cpu_lr3e-4_600steps.png", window=25)
    plot(bsym, [n for n in sym_runs if n.startswith("seed0_")], "cpu_lr3e-4_600steps_symmetric.png", window=25)
    print(f"\nfigures written to {FIGURES}")


if __name__ == "__main__":
    main()
