"""Rebuild the tables and figures of RESULTS.md from the metrics in this directory.

    python results/study_tables.py          # from the repository root; prints markdown, writes figures/

Every number in RESULTS.md's H200 sections comes out of this script (or train.summarize, which it
calls), so a reader can check them and a fork can rerun them on its own metrics.
"""
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = os.path.join(os.path.dirname(HERE), "figures")
# QUADS paper (arXiv 2607.15810): per-step maximum |delta logp| against the RAC ratio; naive "about 1.3"
PAPER_MAX_GAP = {0.0: 1.3, 0.125: 0.923, 0.25: 0.901, 0.5: 0.854, 0.75: 0.812, 1.0: 0.759}
# `python bench.py racsweep` (h200_200steps/bench_racsweep.md): decode tokens/s at batch 64 / 256
BENCH = {0.0: (20026, 56714), 0.125: (19682, 58483), 0.25: (20210, 56340), 0.5: (19848, 56395),
         0.75: (19869, 56380), 1.0: (19887, 56411)}


def steps_of(run_dir):
    return [r for r in train._read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > 0]


def evals_of(run_dir):
    return [r for r in train._read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "pass@1" in r]


def mean(records, key, lo=0, hi=10**9):
    values = [r[key] for r in records if lo < r["step"] <= hi and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def nll(records, lo=0, hi=10**9):
    """The trainer's mean per-token NLL of the sampled completions (log of its perplexity)."""
    return math.log(mean(records, "mismatch/trainer_ppl", lo, hi))


def gap_nll_correlation(run_dir):
    """Pearson correlation across steps of log(mean |delta logp|) and log(trainer NLL)."""
    s = [r for r in steps_of(run_dir) if r["mismatch/abs_diff_mean"] > 0]
    a = [math.log(r["mismatch/abs_diff_mean"]) for r in s]
    b = [math.log(math.log(r["mismatch/trainer_ppl"])) for r in s]
    return statistics.correlation(a, b)


def whole_run_table(base, names):
    """Averages over the whole run and over its first and last 50 steps."""
    print("| run | steps | mean abs dlogp: all / 1-50 / last 50 | per-step max abs dlogp: mean / largest | "
          "routing disagr. | trainer NLL 1-50 / last 50 | train reward, last 50 | "
          "pass@1 rollout: mean of evals after step 0 |")
    print("| --- | ---: | --- | --- | ---: | --- | ---: | ---: |")
    for name in names:
        s = steps_of(os.path.join(base, name))
        n = s[-1]["step"]
        e = [r["pass@1"] for r in evals_of(os.path.join(base, name)) if r["step"] > 0]
        print(f"| {name} | {n} | {mean(s, 'mismatch/abs_diff_mean'):.2e} / "
              f"{mean(s, 'mismatch/abs_diff_mean', 0, 50):.2e}"
              f" / {mean(s, 'mismatch/abs_diff_mean', n - 50):.2e} | "
              f"{mean(s, 'mismatch/abs_diff_max'):.3f} / "
              f"{max(r['mismatch/abs_diff_max'] for r in s):.2f} | {mean(s, 'routing_disagreement'):.2%} | "
              f"{nll(s, 0, 50):.4f} / {nll(s, n - 50):.4f} | {mean(s, 'reward', n - 50):.3f} | "
              f"{statistics.mean(e):.3f} |")


def sweep_table(base):
    runs = {0.0: "nvfp4", 0.125: "rac@0.125", 0.25: "rac@0.25", 0.5: "rac", 0.75: "rac@0.75", 1.0: "rac@1"}
    naive = steps_of(os.path.join(base, "nvfp4"))
    n, n_evals = naive[-1]["step"], len([r for r in evals_of(os.path.join(base, "nvfp4")) if r["step"] > 0])
    print(f"| RAC ratio | per-step max abs dlogp (mean over {n} steps) | vs naive | paper: per-step max "
          f"| paper vs naive | mean abs dlogp | routing disagr. | pass@1 step {n} / mean of {n_evals} evals "
          "| decode tok/s, batch 64 / 256 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for ratio, name in runs.items():
        s = steps_of(os.path.join(base, name))
        e = [r["pass@1"] for r in evals_of(os.path.join(base, name)) if r["step"] > 0]
        m = mean(s, "mismatch/abs_diff_max")
        print(f"| {ratio:g} | {m:.3f} | {m / mean(naive, 'mismatch/abs_diff_max'):.2f}x | "
              f"{PAPER_MAX_GAP[ratio]:.3f} | "
              f"{PAPER_MAX_GAP[ratio] / PAPER_MAX_GAP[0.0]:.2f}x | {mean(s, 'mismatch/abs_diff_mean'):.2e} | "
              f"{mean(s, 'routing_disagreement'):.2%} | {e[-1]:.3f} / {statistics.mean(e):.3f} | "
              f"{BENCH[ratio][0]:,} / {BENCH[ratio][1]:,} |")


def eval_table(base, names):
    print("| run | " + " | ".join(f"step {r['step']}" for r in evals_of(os.path.join(base, names[0]))) + " |")
    print("| --- |" + " ---: |" * len(evals_of(os.path.join(base, names[0]))))
    for name in names:
        print(f"| {name} | "
              + " | ".join(f"{r['pass@1']:.3f}" for r in evals_of(os.path.join(base, name))) + " |")


def ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def dose_response(base, recipes=("bf16", "fp8", "rac@1", "quads", "rac", "nvfp4"), seeds=(0, 1, 2),
                  figure="cpu_lr3e-4_600steps_dose_response.png"):
    """Each run's mean |delta logp| over all steps against its train reward over the second half; the
    Spearman rank correlation across runs; and a scatter plot of the two (figures/`figure`)."""
    points = []
    print("| recipe | " + " | ".join(f"seed {s}: mean abs dlogp / reward, second half" for s in seeds) + " |")
    print("| --- |" + " --- |" * len(seeds))
    for recipe in recipes:
        cells = []
        for seed in seeds:
            s = steps_of(os.path.join(base, f"seed{seed}_{recipe}"))
            half = s[-1]["step"] // 2
            gap, reward = mean(s, "mismatch/abs_diff_mean"), mean(s, "reward", half)
            points.append((recipe, seed, gap, reward))
            cells.append(f"{gap:.4f} / {reward:.3f}")
        print(f"| {recipe} | " + " | ".join(cells) + " |")
    rho = statistics.correlation(ranks([p[2] for p in points]), ranks([p[3] for p in points]))
    print(f"\nSpearman rank correlation of mean gap and second-half reward over the {len(points)} runs: "
          f"{rho:.2f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


def symmetric_study(base, earlier, recipes=("bf16", "nvfp4", "quads", "moeresq", "trace"), seeds=(0, 1, 2)):
    """QUADS beside the two symmetric recipes (moeresq, trace) on the CPU setting, all five run on one
    machine: the whole-run table, late reward against the gap, a figure, and whether the recipes that
    `earlier` (another machine's runs) also has reproduce there step for step."""
    names = [f"seed{s}_{r}" for s in seeds for r in recipes]
    if not all(os.path.exists(os.path.join(base, n, "metrics.jsonl")) for n in names):
        print(f"(the runs of {os.path.basename(base)} are not in results/ yet)")
        return
    for name in names:
        if os.path.exists(os.path.join(earlier, name, "metrics.jsonl")):
            a, b = steps_of(os.path.join(base, name)), steps_of(os.path.join(earlier, name))
            same = [r["reward"] for r in a] == [r["reward"] for r in b]
            print(f"- {name}: train rewards {'identical to' if same else 'differ from'} "
                  f"{os.path.basename(earlier)}")
    print()
    whole_run_table(base, names)
    print()
    dose_response(base, recipes, seeds, figure="cpu_lr3e-4_600steps_symmetric_dose_response.png")
    print("\nPer recipe over the three seeds (mean, and the range over seeds): mean |delta logp| over all "
          "steps, routing disagreement, train reward over steps 301-600, final pass@1 of the rollout model\n")
    print("| recipe | mean abs dlogp | routing disagr. | reward 301-600 | final pass@1 |")
    print("| --- | --- | --- | --- | --- |")
    for recipe in recipes:
        runs = [steps_of(os.path.join(base, f"seed{seed}_{recipe}")) for seed in seeds]
        finals = [evals_of(os.path.join(base, f"seed{seed}_{recipe}"))[-1]["pass@1"] for seed in seeds]
        gaps = [mean(s, "mismatch/abs_diff_mean") for s in runs]
        routing = [mean(s, "routing_disagreement") for s in runs]
        late = [mean(s, "reward", s[-1]["step"] // 2) for s in runs]

        def cell(values, fmt):
            return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        print(f"| {recipe} | {cell(gaps, '.2e')} | {cell(routing, '.2%')} | {cell(late, '.3f')} | "
              f"{cell(finals, '.3f')} |")
    train.plot([os.path.join(base, n) for n in names if n.startswith("seed0_")],
               os.path.join(FIGURES, "cpu_lr3e-4_600steps_symmetric.png"), window=25)


def main():
    main_runs = ["bf16", "fp8", "nvfp4", "qat", "rac", "quads", "w4a4", "nvfp4+tis2", "quads+r3",
                 "seed1_bf16", "seed1_nvfp4", "seed1_quads"]
    lr_runs = ["seed0_bf16", "seed0_nvfp4", "seed0_quads", "seed1_bf16", "seed1_nvfp4", "seed1_quads",
               "seed2_nvfp4", "seed2_quads"]
    d6_runs = ["bf16", "nvfp4", "quads"]
    cpu_runs = [f"seed{s}_{r}" for s in (0, 1, 2) for r in ("bf16", "nvfp4", "quads")]
    b200, blr, bd6, bcpu = (os.path.join(HERE, d) for d in ("h200_200steps", "h200_lr1e-4", "h200_d6",
                                                            "cpu_lr3e-4_600steps"))

    print("## 200 steps, lr 2e-5: train.summarize\n")
    print(train.summarize([os.path.join(b200, n) for n in main_runs]))
    print("\n## 200 steps, lr 2e-5: whole run\n")
    whole_run_table(b200, main_runs)
    print("\n## RAC ratio sweep\n")
    sweep_table(b200)
    print("\n## lr 1e-4, 300 steps: train.summarize\n")
    print(train.summarize([os.path.join(blr, n) for n in lr_runs], checkpoints=(50, 100, 200)))
    print("\n## lr 1e-4, 300 steps: whole run\n")
    whole_run_table(blr, lr_runs)
    print("\n## lr 1e-4: held-out pass@1 of the rollout model\n")
    eval_table(blr, lr_runs)
    print("\n## difficulty 6, 70% flawed demonstrations, lr 1e-4, 300 steps: whole run\n")
    whole_run_table(bd6, d6_runs)
    print("\n## difficulty 6: held-out pass@1 of the rollout model\n")
    eval_table(bd6, d6_runs)

    print("\n## CPU, tiny preset, lr 3e-4, 600 steps: whole run\n")
    whole_run_table(bcpu, cpu_runs)
    print("\n## CPU: train reward per 100 steps\n")
    print("| run | " + " | ".join(f"{a + 1}-{a + 100}" for a in range(0, 600, 100)) + " |")
    print("| --- |" + " ---: |" * 6)
    for name in cpu_runs:
        s = steps_of(os.path.join(bcpu, name))
        print(f"| {name} | "
              + " | ".join(f"{mean(s, 'reward', a, a + 100):.3f}" for a in range(0, 600, 100)) + " |")
    print("\n## CPU: held-out pass@1 of the rollout model / of the BF16 trainer\n")
    print("| run | "
          + " | ".join(f"step {r['step']}" for r in evals_of(os.path.join(bcpu, cpu_runs[0]))) + " |")
    print("| --- |" + " ---: |" * len(evals_of(os.path.join(bcpu, cpu_runs[0]))))
    for name in cpu_runs:
        print(f"| {name} | " + " | ".join(f"{r['pass@1']:.2f} / {r['pass@1_bf16_trainer']:.2f}"
                                          for r in evals_of(os.path.join(bcpu, name))) + " |")

    print("\n## CPU: late train reward against the mismatch, every rollout precision (dose-response)\n")
    dose_response(bcpu)

    print("\n## CPU: QUADS beside the symmetric recipes (moeresq, trace)\n")
    symmetric_study(os.path.join(HERE, "cpu_lr3e-4_600steps_symmetric"), bcpu)

    print("\n## correlation of log(mean gap) with log(trainer NLL) across steps\n")
    for base, names in ((b200, main_runs), (blr, lr_runs), (bd6, d6_runs)):
        print(f"- {os.path.basename(base)}: " + ", ".join(
            f"{n} {gap_nll_correlation(os.path.join(base, n)):.2f}" for n in names))

    os.makedirs(FIGURES, exist_ok=True)
    train.plot([os.path.join(b200, n) for n in ["bf16", "fp8", "nvfp4", "qat", "rac", "quads"]],
               os.path.join(FIGURES, "h200_study_200steps.png"))
    train.plot([os.path.join(b200, n) for n in ["nvfp4", "w4a4", "nvfp4+tis2", "quads", "quads+r3"]],
               os.path.join(FIGURES, "h200_variants_200steps.png"))
    train.plot([os.path.join(b200, n)
                for n in ["nvfp4", "rac@0.125", "rac@0.25", "rac", "rac@0.75", "rac@1"]],
               os.path.join(FIGURES, "h200_rac_sweep_200steps.png"))
    train.plot([os.path.join(blr, n) for n in lr_runs], os.path.join(FIGURES, "h200_lr1e-4_300steps.png"))
    train.plot([os.path.join(bd6, n) for n in d6_runs], os.path.join(FIGURES, "h200_d6_300steps.png"))
    train.plot([os.path.join(bcpu, n) for n in cpu_runs], os.path.join(FIGURES, "cpu_lr3e-4_600steps.png"),
               window=25)


if __name__ == "__main__":
    main()
