"""Group size on a real model: the base model's per-prompt pass rate p, and the invalid-group rate at G = 2 .. 32
measured against the mean of p^G + (1 - p)^G over the prompts.

    .venv/bin/grpo-kernels group-size-study --model smollm2-135m [--prompts 256] [--sampler vllm|hf] [--out DIR]

The model and task are the trainer's (`--task arith --difficulty 1 --temperature 0.7 --max-new-tokens 24`, the
settings of examples/train_smollm2_cpu.toml, prompts through the chat template); pass means `Rewards.correct` (the
format bonus is not part of it). Every prompt gets two independent sets of completions, each of max(G) = 32
completions unless --samples says otherwise:
- set A estimates the prompt's p (its histogram is the seed's p on a real model) and predicts, per prompt, the
  invalid rate at G without bias: with s successes out of K, [C(s, G) + C(K - s, G)] / C(K, G) is the unbiased
  estimate of p^G + (1 - p)^G (the chance that G draws without replacement from set A agree);
- set B is cut into K / G disjoint groups of G for every G, whose all-pass or all-fail share is the measured rate.
The two are compared per prompt: SE = sd(measured_i - predicted_i) / sqrt(N), "within" means |difference| <= 3 SE.
The naive p_bar^G + (1 - p_bar)^G at the mean pass rate (homogeneous prompts; too low by Jensen) is shown for contrast.
Writes DIR/<model>/ (DIR/<model>_<task>_d<difficulty>/ for another task or difficulty): pass_rates.csv (per
prompt), summary.md and pass_rates.png.
"""

import math
import time
from pathlib import Path

from benchmarks.common import write_csv

GROUP_SIZES = (2, 4, 8, 16, 32)
BINS = (0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)


def unbiased_invalid(successes: int, k: int, g: int) -> float:
    """[C(s, G) + C(K - s, G)] / C(K, G): unbiased for p^G + (1 - p)^G from s successes in K Bernoulli(p) draws."""
    return (math.comb(successes, g) + math.comb(k - successes, g)) / math.comb(k, g)


def measured_invalid(outcomes: list[bool], g: int) -> float:
    """Share of the len // G disjoint groups of G consecutive outcomes that are all equal."""
    groups = [outcomes[i : i + g] for i in range(0, len(outcomes) - g + 1, g)]
    return sum(len(set(x)) == 1 for x in groups) / len(groups)


def histogram(rates: list[float]) -> list[tuple[str, int]]:
    """Counts of p in [0], (0, .05), [.05, .2), ..., [.95, 1), [1]."""
    rows = [("p = 0", sum(r == 0 for r in rates))]
    for lo, hi in zip(BINS[:-1], BINS[1:], strict=True):
        label = f"{lo:g} < p < {hi:g}" if lo == 0 else (f"{lo:g} <= p < {hi:g}")
        rows.append((label, sum(lo < r < hi if lo == 0 else lo <= r < hi for r in rates)))
    rows.append(("p = 1", sum(r == 1 for r in rates)))
    return rows


def compare(rows: list[dict], *, k: int) -> list[dict]:
    """Per G: measured (set B), predicted (unbiased, set A), naive, SE of the paired difference, within 3 SE."""
    out = []
    p_bar = sum(r["successes_a"] for r in rows) / (k * len(rows))
    for g in GROUP_SIZES:
        if g > k:
            continue
        measured = [measured_invalid(r["outcomes_b"], g) for r in rows]
        predicted = [unbiased_invalid(r["successes_a"], k, g) for r in rows]
        diff = [m - p for m, p in zip(measured, predicted, strict=True)]
        n = len(rows)
        mean_diff = sum(diff) / n
        se = math.sqrt(sum((d - mean_diff) ** 2 for d in diff) / (n - 1) / n) if n > 1 else float("nan")
        out.append({"G": g, "measured": sum(measured) / n, "predicted": sum(predicted) / n,
                    "naive": p_bar**g + (1 - p_bar) ** g, "se": se,
                    "within_3se": abs(mean_diff) <= 3 * se, "groups": n * (k // g)})  # fmt: skip
    return out


def sample_pass_rates(model: str, *, prompts: int, samples: int, sampler: str, task: str, difficulty: int,
                      temperature: float, max_new_tokens: int, seed: int) -> list[dict]:  # fmt: skip
    """Per prompt: the prompt, its answer, set A's successes and set B's outcomes (samples each)."""
    from grpo_kernels.train.build import load
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.model.fsdp import SINGLE
    from grpo_kernels.train.rollout.colocated import make_sampler
    from grpo_kernels.train.rollout.sampling import seed_for

    config = load_config(None, {"seed": seed, "model": {"name": model},
                                "task": {"name": task, "difficulty": difficulty, "num_train_prompts": 1,
                                         "num_eval_prompts": prompts, "seed": seed},
                                "sampling": {"sampler": sampler, "temperature": temperature,
                                             "max_new_tokens": max_new_tokens, "group_size": 2}})  # fmt: skip
    inputs = load(config)
    tok, examples = inputs.tok, inputs.eval_set
    engine = make_sampler(config, inputs.model, tok, SINGLE)
    encoded = [tok.encode_prompt(e.prompt) for e in examples]
    sets = []
    for part in range(2):  # A, B: independent seeds
        rollout = engine.sample(encoded, samples, seeds=[seed_for(seed, 99, part, i) for i in range(len(examples))])
        sets.append([inputs.rewards.correct(tok.decode(c), examples[i // samples]) == 1.0
                     for i, c in enumerate(rollout.completion_ids)])  # fmt: skip
    if sampler == "vllm":
        engine.close()
    return [{"prompt": e.prompt, "answer": e.answer,
             "successes_a": sum(sets[0][i * samples : (i + 1) * samples]),
             "outcomes_b": sets[1][i * samples : (i + 1) * samples]} for i, e in enumerate(examples)]  # fmt: skip


def write(out: Path, rows: list[dict], table: list[dict], *, k: int, command: str, seconds: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv([{"prompt": r["prompt"], "answer": r["answer"], "successes_a": r["successes_a"], "samples_a": k,
                "successes_b": sum(r["outcomes_b"]), "samples_b": k} for r in rows], out / "pass_rates.csv",
              ["prompt", "answer", "successes_a", "samples_a", "successes_b", "samples_b"])  # fmt: skip
    rates = sorted(r["successes_a"] / k for r in rows)
    n = len(rates)
    quantile = lambda q: rates[min(n - 1, int(q * n))]  # noqa: E731
    lines = [f"# Group size on a real model ({n} prompts, {k} + {k} completions each)", "",
             f"Command: `{command}` ({seconds:.0f} s).", "",
             f"Per-prompt pass rate p (set A): mean {sum(rates) / n:.3f}, quartiles {quantile(0.25):.3f} / "
             f"{quantile(0.5):.3f} / {quantile(0.75):.3f}, "
             f"{sum(0.05 <= r <= 0.6 for r in rates) / n:.0%} of the prompts in [0.05, 0.6].", "",
             "| p | prompts |", "|---|---|", *[f"| {label} | {count} |" for label, count in histogram(rates)], "",
             "Invalid-group rate (all pass or all fail), measured on set B against the mean of p^G + (1-p)^G "
             "estimated without bias from set A:", "",
             "| G | groups | measured | predicted | SE | within 3 SE | naive at mean p |",
             "|---|---|---|---|---|---|---|",
             *[f"| {r['G']} | {r['groups']} | {r['measured']:.3f} | {r['predicted']:.3f} | {r['se']:.3f} | "
               f"{'yes' if r['within_3se'] else 'NO'} | {r['naive']:.3f} |" for r in table]]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    paths = [out / "pass_rates.csv", out / "summary.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist(rates, bins=[i / k for i in range(k + 2)], color="tab:blue")
    a.set(xlabel="per-prompt pass rate p (set A)", ylabel="prompts", title="base model")
    gs = [r["G"] for r in table]
    b.errorbar(gs, [r["measured"] for r in table], yerr=[3 * r["se"] for r in table], fmt="o", label="measured ± 3 SE")
    b.plot(gs, [r["predicted"] for r in table], "-", label="mean of p^G + (1-p)^G")
    b.plot(gs, [r["naive"] for r in table], ":", label="at the mean p")
    b.set(xscale="log", xticks=gs, xticklabels=[str(g) for g in gs], xlabel="G", ylabel="invalid-group rate")
    b.minorticks_off()
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "pass_rates.png", dpi=100)
    plt.close(fig)
    return [*paths, out / "pass_rates.png"]


def run(args, out_root: Path) -> int:
    start = time.perf_counter()
    k = args.samples
    rows = sample_pass_rates(args.model, prompts=args.prompts, samples=k, sampler=args.sampler, task=args.task,
                             difficulty=args.difficulty, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, seed=args.seed)  # fmt: skip
    table = compare(rows, k=k)
    command = (f"grpo-kernels group-size-study --model {args.model} --prompts {args.prompts} --samples {k} "
               f"--sampler {args.sampler} --task {args.task} --difficulty {args.difficulty} "
               f"--temperature {args.temperature} --max-new-tokens {args.max_new_tokens}")  # fmt: skip
    name = results_name(args)
    for path in write(out_root / name, rows, table, k=k, command=command, seconds=time.perf_counter() - start):
        print(f"wrote {path}")
    print((out_root / name / "summary.md").read_text())
    return 0


def results_name(args) -> str:
    """<model> for the default task (arith, difficulty 1), <model>_<task>_d<difficulty> for another."""
    name = Path(args.model).name
    return name if (args.task, args.difficulty) == ("arith", 1) else f"{name}_{args.task}_d{args.difficulty}"


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="a known model (smollm2-135m) or an HF directory: measure on it")
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts (--model)")
    parser.add_argument("--samples", type=int, default=max(GROUP_SIZES),
                        help="completions per prompt in each of the two sets (--model)")  # fmt: skip
    parser.add_argument("--sampler", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--difficulty", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
