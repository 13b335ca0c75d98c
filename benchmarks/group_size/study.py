"""Group-size study (issue 8, item 3): how G trades invalid groups, gradient noise and reward per sample.

    .venv/bin/grpo-kernels group-size-study [--quick] [--out DIR]
    .venv/bin/python benchmarks/group_size/study.py [--quick] [--out DIR]    # the same
    .venv/bin/grpo-kernels group-size-study --model smollm2-135m             # on a real model: model.py
    .venv/bin/grpo-kernels group-size-study --model smollm2-135m --gradients # gradients: gradients.py

Writes into DIR (default benchmarks/results/group_size_study/): summary.md, runs.csv and the PNGs below; the
training runs themselves go to a temporary directory that is deleted afterwards.

1. Theory. The invalid-group rate p^G + (1 - p)^G (grpo_kernels.theory) for p x G, with the paper's four figures
   printed. Monte Carlo (montecarlo.png) on a synthetic policy-gradient model: N prompts with pass rates
   p_i ~ Beta(a, b) and fixed random feature vectors phi_i ~ N(0, I_d); the policy's outcome on prompt i is
   Bernoulli(p_i) with logit w . phi_i, so the score of an outcome r is (r - p_i) phi_i. With G completions per
   prompt and the group-normalized advantages A_ij of `group_advantages` (invalid groups get A = 0) the gradient
   estimate is g_G = 1/(N G) sum_ij A_ij (r_ij - p_i) phi_i. Over R independent batches we measure
   (a) its total variance E||g_G - E g_G||^2, its noise-to-signal ratio E||g_G - E g_G||^2 / ||E g_G||^2 (the
   raw variance is not monotone in G: at small G most groups are invalid and the estimate shrinks towards 0) and
   the variance times G (proportional to the variance at a fixed number N G of sampled completions) and (b) the
   mean cosine between g_G and the G -> infinity limit
   g_inf = 1/N sum_i sqrt(p_i (1 - p_i)) phi_i (where A_ij -> (r_ij - p_i) / sqrt(p_i (1 - p_i))).
2. Empirical. The built-in demo (examples/train_tiny_cpu.toml: task "add", tiny model, SFT warm start computed once
   and reused by every run; 64 held-out prompts), shortened:
   G in {2, 4, 8, 16, 32} at a fixed budget of sampled completions (prompts_per_step x G x steps = budget, the
   steps adjusted per G) plus the adaptive schedule (start 8, max 16, invalid-rate threshold 0.1: the default 0.5 is
   never reached at G=8 here; its steps are budget / (prompts_per_step x 8), its completions as sampled).
   Default: 16 prompts per step, budget 5120 completions (G=2: 160 steps ... G=32:
   10 steps); --quick: 8 prompts per step, budget 256, G in {2, 8} + adaptive, a 40-step SFT warm start.
   Plots reward vs sampled completions and vs wall time (empirical.png).
   Invalid rate vs theory (invalid_vs_theory.png): the per-group rewards of every step are recorded; the prediction
   for step t is NOT taken from step t's own samples (a group with empirical pass rate 0 or 1 is invalid by
   definition) but from the W previous steps with the same G: a beta-binomial fit (moments of their per-group
   success counts) gives the pass-rate distribution Beta(a, b) of the prompts, and the prediction is
   E[p^G + (1-p)^G] = B(a+G, b)/B(a, b) + B(a, b+G)/B(a, b). Measured and predicted rates are averaged over the
   predicted steps; SE = sqrt(sum_t n_t q_t (1 - q_t)) / sum_t n_t (n_t groups at predicted rate q_t), the binomial
   error of the measurement alone; "within" means |measured - predicted| <= 3 SE. For contrast the naive prediction
   p^G + (1-p)^G at the previous step's batch pass rate (homogeneous prompts; by Jensen it is too low) is reported.
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = str(REPO / "benchmarks" / "results" / "group_size_study")
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.common import write_csv  # noqa: E402
from benchmarks.group_size import gradients as group_size_gradients  # noqa: E402
from benchmarks.group_size import learning as group_size_learning  # noqa: E402
from benchmarks.group_size import model as group_size_model  # noqa: E402
from grpo_kernels.advantages import group_advantages  # noqa: E402
from grpo_kernels.theory import invalid_group_rate  # noqa: E402

PASS_RATES = (0.05, 0.1, 0.2, 0.5, 0.8)
GROUP_SIZES = (2, 4, 8, 16, 32, 64)
PAPER = ((0.2, 4, "41.1%"), (0.2, 16, "2.8%"), (0.5, 4, "12.5%"), (0.5, 8, "0.78%"))
WINDOW = 5


def theory_table() -> str:
    """Markdown table of p^G + (1 - p)^G."""
    lines = ["| p \\ G | " + " | ".join(str(g) for g in GROUP_SIZES) + " |", "|---" * (len(GROUP_SIZES) + 1) + "|"]
    for p in PASS_RATES:
        lines.append(f"| {p} | " + " | ".join(f"{invalid_group_rate(g, p):.2%}" for g in GROUP_SIZES) + " |")
    return "\n".join(lines)


def paper_figures() -> list[tuple[float, int, str, str]]:
    """(p, G, the paper's figure, ours at the paper's precision)."""
    out = []
    for p, g, fig in PAPER:
        decimals = len(fig.rstrip("%").partition(".")[2])
        out.append((p, g, fig, f"{100 * invalid_group_rate(g, p):.{decimals}f}%"))
    return out


def monte_carlo(*, group_sizes=GROUP_SIZES, prompts: int = 32, dim: int = 64, reps: int = 2000,
                beta: tuple[float, float] = (0.7, 1.3), seed: int = 0) -> list[dict]:  # fmt: skip
    """Per G: variance of the estimate (raw, relative to ||E g_G||^2, times G), cosine to g_inf, invalid fraction."""
    gen = torch.Generator().manual_seed(seed)
    dist = torch.distributions.Beta(*(torch.tensor(float(x)) for x in beta))
    torch.manual_seed(seed)
    p = dist.sample((prompts,)).double().clamp(1e-3, 1 - 1e-3)
    phi = torch.randn(prompts, dim, generator=gen, dtype=torch.float64)
    limit = (p * (1 - p)).sqrt() @ phi / prompts
    rows = []
    for g in group_sizes:
        r = torch.bernoulli(p[None, :, None].expand(reps, prompts, g), generator=gen)
        out = group_advantages(r.float().flatten(), group_size=g)
        adv = out.advantages.double().view(reps, prompts, g)
        weight = (adv * (r - p[None, :, None])).sum(-1)  # [reps, prompts]
        est = weight @ phi / (prompts * g)  # [reps, dim]
        var = float(((est - est.mean(0)) ** 2).sum(-1).mean())
        rel = var / float((est.mean(0) ** 2).sum())
        cos = float(torch.nn.functional.cosine_similarity(est, limit[None], dim=-1).mean())
        rows.append({"G": g, "variance": var, "relative_variance": rel, "variance_x_G": var * g, "cosine": cos,
                     "invalid": float(out.invalid_fraction)})  # fmt: skip
    return rows


def betabinom_all_equal(counts: list[int], n: int, g: int) -> float:
    """E[p^g + (1-p)^g] under the Beta fitted (method of moments) to success counts out of n per group."""
    k = len(counts)
    mu = sum(counts) / (k * n)
    if mu <= 0.0 or mu >= 1.0:
        return 1.0
    var = sum((c / n - mu) ** 2 for c in counts) / k
    rho = 1e-6 if n == 1 else min(max((var * n / (mu * (1 - mu)) - 1) / (n - 1), 1e-6), 1 - 1e-6)
    a, b = mu * (1 / rho - 1), (1 - mu) * (1 / rho - 1)
    lb = lambda x, y: math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)  # noqa: E731
    return math.exp(lb(a + g, b) - lb(a, b)) + math.exp(lb(a, b + g) - lb(a, b))


def _recording_collect(collect, steps: list):
    def wrapped(config, sampler, tok, rewards, next_prompts, step, g, d):
        result = collect(config, sampler, tok, rewards, next_prompts, step, g, d)
        rollout = result[0]  # correct answers per group, from the rollout's [groups, G] rewards
        steps.append((g, [] if rollout is None else [round(sum(row)) for row in rollout.rewards.tolist()]))
        return result

    return wrapped


def _cached_sft(sft, cache: dict):
    """sft_warmup is deterministic in (model init, steps, seed): run it once, then load the cached weights."""

    def wrapped(model, tokenizer, task, *, steps, seed, **kw):
        if (steps, seed) not in cache:
            losses = sft(model, tokenizer, task, steps=steps, seed=seed, **kw)
            cache[steps, seed] = ({k: v.clone() for k, v in model.state_dict().items()}, losses)
        model.load_state_dict(cache[steps, seed][0])
        return cache[steps, seed][1]

    return wrapped


def run_one(label: str, overrides: dict, run_dir: Path, *, sft_cache: dict) -> dict:
    """Train the demo with overrides; per-step metrics, per-step (G, success counts per group) and the summary."""
    import json

    from grpo_kernels.train import build, trainer
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.rollout import colocated

    config = load_config(REPO / "examples" / "train_tiny_cpu.toml",
                         {**overrides, "logging.run_dir": str(run_dir), "logging.log_every": 10**6})  # fmt: skip
    groups: list = []
    with mock.patch.object(colocated, "collect", _recording_collect(colocated.collect, groups)), \
            mock.patch.object(build, "sft_warmup", _cached_sft(build.sft_warmup, sft_cache)):  # fmt: skip
        summary = trainer.train(config, log=lambda *a, **k: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not r.get("no_update")]
    return {"label": label, "rows": rows, "groups": groups, "summary": summary,
            "prompts_per_step": config.sampling.prompts_per_step}  # fmt: skip


def invalid_check(groups: list) -> dict:
    """Measured vs predicted (beta-binomial fit on the previous WINDOW steps of the same G) invalid-group rate."""
    measured = predicted = naive = var = n_total = 0.0
    for t, (g, counts) in enumerate(groups):
        past = [c for gp, cs in groups[max(0, t - WINDOW) : t] if gp == g for c in cs]
        if len(past) < 2:
            continue
        q = betabinom_all_equal(past, g, g)
        prev = groups[t - 1][1]
        p_prev = sum(prev) / (len(prev) * groups[t - 1][0])
        n = len(counts)
        measured += sum(c in (0, g) for c in counts)
        predicted, naive = predicted + n * q, naive + n * invalid_group_rate(g, p_prev)
        var, n_total = var + n * q * (1 - q), n_total + n
    if not n_total:
        return {"measured": math.nan, "predicted": math.nan, "naive": math.nan, "se": math.nan, "within": False}
    m, pr, se = measured / n_total, predicted / n_total, math.sqrt(var) / n_total
    return {"measured": m, "predicted": pr, "naive": naive / n_total, "se": se,
            "within": abs(m - pr) <= 3 * se}  # fmt: skip


def empirical(*, quick: bool, workdir: Path) -> list[dict]:
    """The fixed-budget runs (one per G, then adaptive); per run a dict of the numbers and the curves."""
    ppst = 8 if quick else 16
    sizes = (2, 8) if quick else (2, 4, 8, 16, 32)
    budget = ppst * 8 * (4 if quick else 40)
    base = {"sampling.prompts_per_step": ppst, "task.num_eval_prompts": 16 if quick else 64}
    if quick:
        base["task.sft_warmup_steps"] = 40
    plans = [(f"G={g}", {"sampling.group_size": g, "optim.steps": budget // (ppst * g)}) for g in sizes]
    plans.append(("adaptive 8->16", {"sampling.group_size": 8, "optim.steps": budget // (ppst * 8),
                                     "group_size.adaptive": True, "group_size.max_group_size": 16,
                                     "group_size.invalid_rate_threshold": 0.1}))  # fmt: skip
    results, sft_cache = [], {}
    for label, over in plans:
        start = time.perf_counter()
        print(f"  {label}: {over['optim.steps']} steps ...", flush=True)
        run = run_one(label, {**base, **over}, workdir / label.split()[0].replace("=", ""), sft_cache=sft_cache)
        rows = run["rows"]
        done, reward = [], []
        for r in rows:
            done.append((done[-1] if done else 0) + r["group_size"] * run["prompts_per_step"])
            reward.append(r["reward"])
        smooth = [sum(reward[max(0, i - 9) : i + 1]) / len(reward[max(0, i - 9) : i + 1]) for i in range(len(reward))]
        check = invalid_check(run["groups"])
        results.append({"label": label, "steps": len(rows), "completions": done[-1], "final_reward": smooth[-1],
                        "peak_reward": max(smooth), "eval_start": run["summary"]["eval_success_start"],
                        "eval_end": run["summary"]["eval_success_end"], "wall_s": rows[-1]["elapsed_s"],
                        **check, "curve": (done, [r["elapsed_s"] for r in rows], smooth)})  # fmt: skip
        print(f"    {time.perf_counter() - start:.0f} s, held-out {results[-1]['eval_end']:.3f}, invalid measured "
              f"{check['measured']:.3f} vs predicted {check['predicted']:.3f} +- {check['se']:.3f}", flush=True)
    return results


def _plots(out: Path, mc: list[dict], emp: list[dict] | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    gs = [r["G"] for r in mc]
    a1.loglog(gs, [r["relative_variance"] for r in mc], "o-", label="/ ||E g_G||^2 (noise-to-signal)")
    a1.loglog(gs, [r["variance"] for r in mc], "^:", label="raw, fixed prompts N")
    a1.loglog(gs, [r["variance_x_G"] for r in mc], "s--", label="raw x G (fixed completions N G)")
    a1.set(xlabel="G", ylabel="E||g_G - E g_G||^2", title="(a) gradient-estimate variance")
    a1.legend(fontsize=8)
    a2.semilogx(gs, [r["cosine"] for r in mc], "o-")
    a2.set(xlabel="G", ylabel="mean cos(g_G, g_inf)", title="(b) alignment with the large-G direction", ylim=(0, 1))
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gs, [str(g) for g in gs])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(out / "montecarlo.png", dpi=110)
    written.append(out / "montecarlo.png")
    plt.close(fig)
    if emp:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in emp:
            done, wall, smooth = r["curve"]
            a1.plot(done, smooth, label=r["label"])
            a2.plot(wall, smooth, label=r["label"])
        a1.set(xlabel="sampled completions", ylabel="batch reward (10-step mean)", title="reward vs samples")
        a2.set(xlabel="wall time (s)", ylabel="batch reward (10-step mean)", title="reward vs wall time")
        a1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "empirical.png", dpi=110)
        written.append(out / "empirical.png")
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 3.8))
        x = range(len(emp))
        ax.errorbar(x, [r["measured"] for r in emp], yerr=[3 * r["se"] for r in emp], fmt="o", capsize=4,
                    label="measured (+- 3 SE)")  # fmt: skip
        ax.plot(x, [r["predicted"] for r in emp], "x", ms=9, label="beta-binomial prediction")
        ax.plot(x, [r["naive"] for r in emp], "+", ms=9, label="p^G+(1-p)^G at previous batch p")
        ax.set_xticks(list(x), [r["label"] for r in emp], fontsize=8)
        ax.set(ylabel="invalid-group rate", title="measured vs predicted invalid groups")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "invalid_vs_theory.png", dpi=110)
        written.append(out / "invalid_vs_theory.png")
        plt.close(fig)
    return written


COLUMNS = ("label", "steps", "completions", "final_reward", "peak_reward", "eval_start", "eval_end", "wall_s",
           "measured", "predicted", "se", "within", "naive")  # fmt: skip


def write_summary(out: Path, mc: list[dict], emp: list[dict] | None, *, command: str, seconds: float) -> None:
    text = [f"# Group-size study\n\n`{command}` ({seconds:.0f} s). Design: see benchmarks/group_size/study.py.\n",
            "## Invalid-group rate p^G + (1-p)^G\n", theory_table(), "\nThe paper's figures:\n"]  # fmt: skip
    text += [f"- p={p}, G={g}: paper {fig}, here {ours}" for p, g, fig, ours in paper_figures()]
    text += ["\n## Monte Carlo (synthetic score-function model)\n",
             "| G | variance | relative variance | variance x G | cos to g_inf | invalid |",
             "|---" * 6 + "|"]  # fmt: skip
    text += [f"| {r['G']} | {r['variance']:.3e} | {r['relative_variance']:.3e} | {r['variance_x_G']:.3e} | "
             f"{r['cosine']:.3f} | {r['invalid']:.3f} |"
             for r in mc]  # fmt: skip
    if emp:
        text += ["\n## Empirical (tiny demo, fixed completions budget)\n",
                 "| run | steps | completions | final reward | peak reward | held-out start -> end | wall s "
                 "| invalid measured | predicted | SE | within 3 SE | naive |", "|---" * 12 + "|"]  # fmt: skip
        text += [f"| {r['label']} | {r['steps']} | {r['completions']} | {r['final_reward']:.3f} | "
                 f"{r['peak_reward']:.3f} | {r['eval_start']:.3f} -> {r['eval_end']:.3f} | {r['wall_s']:.0f} | "
                 f"{r['measured']:.3f} | {r['predicted']:.3f} | {r['se']:.3f} | {'yes' if r['within'] else 'no'} | "
                 f"{r['naive']:.3f} |" for r in emp]  # fmt: skip
        write_csv(emp, out / "runs.csv", COLUMNS, extra="ignore")
    (out / "summary.md").write_text("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-kernels group-size-study", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget, G in {2, 8} + adaptive (about a minute)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="results directory (--learning: default benchmarks/results/group_size_learning)")
    parser.add_argument("--theory-only", action="store_true", help="skip the training runs")
    group_size_model.add_arguments(parser)
    group_size_gradients.add_arguments(parser)
    group_size_learning.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.learning:  # time to target vs G (learning.py)
        if args.gradients:
            parser.error("--learning and --gradients are separate studies: run one at a time")
        if args.quick:
            vars(args).update(group_size_learning.QUICK)
        elif args.model is None:
            parser.error("--learning needs --model (or --quick)")
        elif not args.plot_only and (args.target is None or not 0 < args.target <= 1):
            parser.error(f"--learning needs --target in (0, 1], got {args.target}")
        for name in ("max_steps", "eval_every", "eval_prompts", "prompts_per_step"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        return group_size_learning.run(args, Path(args.out) if args.out != DEFAULT_OUT else None)
    if (args.gradients or args.plot_only) and args.model is None:
        parser.error("--gradients and --plot-only need --model")
    if args.gradients or args.plot_only:  # gradient agreement vs G at fixed parameters (gradients.py)
        return group_size_gradients.run(args, Path(args.out))
    if args.model is not None:  # a real model: pass rates and invalid groups, no training (model.py)
        return group_size_model.run(args, Path(args.out))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print("invalid-group rate p^G + (1-p)^G:\n" + theory_table())
    for p, g, fig, ours in paper_figures():
        print(f"  paper p={p} G={g}: {fig}; here {ours}")
    mc = monte_carlo(reps=500 if args.quick else 2000)
    for r in mc:
        print(f"  MC G={r['G']:2d}: variance {r['variance']:.3e} (relative {r['relative_variance']:.3f}, "
              f"x G {r['variance_x_G']:.3e}), cos {r['cosine']:.3f}")
    emp = None
    if not args.theory_only:
        with tempfile.TemporaryDirectory(prefix="group-size-study-") as workdir:
            emp = empirical(quick=args.quick, workdir=Path(workdir))
    command = "grpo-kernels group-size-study" + (" --quick" if args.quick else "") + (
        " --theory-only" if args.theory_only else "")  # fmt: skip
    write_summary(out, mc, emp, command=command, seconds=time.perf_counter() - start)
    for path in [*_plots(out, mc, emp), out / "summary.md"]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
