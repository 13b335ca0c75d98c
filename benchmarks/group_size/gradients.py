"""Gradient agreement vs group size on a real model, at fixed parameters (no training).

    .venv/bin/grpo-kernels group-size-study --model smollm2-135m --gradients [--repeats 5] [--prompts-per-step 8]

For every G in --group-sizes (default 2, 4, 8, 16, 32) and the same number of prompts per step P, R = --repeats
times: draw two independent batches (P prompts drawn from a pool of held-out prompts, G completions each from the
trainer's sampler, scored with the task's training reward), and compute the policy gradient of each with the
trainer's own step (`grpo_step`: packed micro-batches, the configured loss, group-normalized advantages with
invalid groups masked) with an optimizer that records the gradient instead of stepping, so the parameters never
move. Per G it reports:
- cosine: the cosine similarity of the two batches' gradients, mean over the R pairs with a 95% t-interval (0
  where a batch has no gradient at all, every group invalid: an empty update agrees with nothing);
- snr: the gradient's signal-to-noise ||E g|| / sqrt(tr Var g) of one batch, from the 2R gradients (the squared
  mean norm corrected for its noise, ||mean||^2 - tr Var / 2R), with a 95% delete-one-repeat jackknife interval
  (a bootstrap over the repeats would not do: a repeat drawn twice is a perfectly agreeing pair, read as signal);
- valid: the share of sampled completions carrying a gradient (in a group whose rewards are not all equal), and
  the batch reward.
The gradients are kept in bf16 (cosines and norms are accumulated in fp32), two per repeat.
Writes DIR/<model>/gradients.csv (one row per batch pair), gradients_gram.json (per G, the Gram matrix of its 2R
gradients, in the order a_1, b_1, a_2, ...), gradients.md and gradients.png; with --plot-only the report is rebuilt
from those two files alone.
"""

import csv
import json
import math
import random
import time
from pathlib import Path

import torch

from benchmarks.common import t975, write_csv
from benchmarks.group_size import model as group_size_model  # the results directory of a (model, task, difficulty)

GROUP_SIZES = (2, 4, 8, 16, 32)
COLUMNS = ["G", "repeat", "prompts", "cosine", "norm_a", "norm_b", "valid_a", "valid_b", "reward_a", "reward_b",
           "sample_s", "grad_s"]  # fmt: skip


class GradientRecorder:
    """An optimizer stand-in for `grpo_step`: step() records the parameters' gradient (flat, bf16) and changes
    nothing; zero_grad() clears the gradients as torch's optimizers do."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.recorded: list[torch.Tensor] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        flat = [torch.zeros(p.numel(), dtype=torch.bfloat16) if p.grad is None else p.grad.detach().flatten().to(
            torch.bfloat16) for p in self.params]  # fmt: skip
        self.recorded.append(torch.cat(flat))


def dot(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 24) -> float:
    """<a, b> of two bf16 vectors, accumulated in fp64 over fp32 chunks."""
    return sum(float(a[i : i + chunk].float() @ b[i : i + chunk].float()) for i in range(0, a.numel(), chunk))


def snr(gram: list[list[float]]) -> float:
    """||E g|| / sqrt(tr Var g) from the Gram matrix of n gradients (n >= 2): signal ||mean||^2 - tr Var / n."""
    n = len(gram)
    mean_sq = sum(map(sum, gram)) / n**2
    noise = (sum(gram[i][i] for i in range(n)) / n - mean_sq) * n / (n - 1)  # unbiased tr Var of one gradient
    signal = max(mean_sq - noise / n, 0.0)
    return math.sqrt(signal / noise) if noise > 0 else float("nan")


def jackknife_snr(gram: list[list[float]]) -> tuple[float, float]:
    """95% interval of `snr` from a delete-one-repeat jackknife over the R pairs (gradients 2k, 2k + 1 are repeat
    k): estimate +- t(R-1) x sqrt((R-1)/R x sum (snr_-k - mean)^2), the lower end clipped at 0."""
    n = len(gram) // 2
    if n < 3:  # leaving one out of 2 repeats leaves one pair: an SNR of 2 gradients, no spread to speak of
        return math.nan, math.nan
    loo = []
    for k in range(n):
        keep = [i for i in range(2 * n) if i // 2 != k]
        loo.append(snr([[gram[i][j] for j in keep] for i in keep]))
    if any(math.isnan(v) for v in loo):
        return math.nan, math.nan
    mean = sum(loo) / n
    half = t975(n - 1) * math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in loo))
    point = snr(gram)
    return max(point - half, 0.0), point + half


def summarize(rows: list[dict], grams: dict) -> list[dict]:
    """Per G: cosine mean and 95% t-interval, SNR with its 95% jackknife interval over the repeats, the valid share
    and reward of the sampled batches, seconds per batch."""
    out = []
    for g in sorted({int(r["G"]) for r in rows}):
        rs = [r for r in rows if int(r["G"]) == g]
        gram = grams[str(g)]
        cos = [float(r["cosine"]) for r in rs]
        n = len(cos)
        mean = sum(cos) / n
        sd = math.sqrt(sum((c - mean) ** 2 for c in cos) / (n - 1)) if n > 1 else float("nan")
        half = t975(n - 1) * sd / math.sqrt(n)
        lo, hi = jackknife_snr(gram)
        valid = [float(r[k]) for r in rs for k in ("valid_a", "valid_b")]
        reward = [float(r[k]) for r in rs for k in ("reward_a", "reward_b")]
        out.append(dict(G=g, repeats=n, cosine=mean, cosine_ci=half, snr=snr(gram), snr_lo=lo, snr_hi=hi,
                        valid=sum(valid) / len(valid), reward=sum(reward) / len(reward),
                        sample_s=sum(float(r["sample_s"]) for r in rs) / (2 * n),
                        grad_s=sum(float(r["grad_s"]) for r in rs) / (2 * n)))  # fmt: skip
    return out


def measure(model: str, *, group_sizes, prompts_per_step: int, repeats: int, pool: int, sampler: str, task: str,
            difficulty: int, temperature: float, max_new_tokens: int, seed: int, sft_steps: int = 0,
            partial: Path | None = None):  # fmt: skip
    """(rows, grams): per G and repeat, two independent batches' gradients at the model's fixed parameters.

    partial: a file that keeps each finished G's rows and Gram matrix (written after every G), so that a run cut
    short resumes at the first unfinished G with the same results (every batch is drawn from its own seeded stream:
    (seed, G, repeat, side) decides it, whatever ran before); refused if it was written with other arguments."""
    key = dict(model=model, prompts_per_step=prompts_per_step, repeats=repeats, pool=pool, sampler=sampler, task=task,
               difficulty=difficulty, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
               sft_steps=sft_steps)  # fmt: skip
    saved = {"key": key, "done": {}}
    if partial is not None and partial.exists():
        saved = json.loads(partial.read_text())
        if saved.get("key") != key:
            raise SystemExit(f"{partial} was written by a run with other arguments ({saved.get('key')}): remove it "
                             "or run with those")  # fmt: skip
        print(f"resuming: G = {', '.join(saved['done'])} done before ({partial})", flush=True)
    todo = [g for g in group_sizes if str(g) not in saved["done"]]
    if not todo:
        return _from_saved(saved, group_sizes)
    from grpo_kernels.train.build import load
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.model.fsdp import SINGLE
    from grpo_kernels.train.model.policy import Policy
    from grpo_kernels.train.rollout.colocated import make_sampler
    from grpo_kernels.train.rollout.sampling import sample_scored, seed_for
    from grpo_kernels.train.step import grpo_step, sft_warmup

    config = load_config(None, {"seed": seed, "model": {"name": model},
                                "task": {"name": task, "difficulty": difficulty, "num_train_prompts": 1,
                                         "num_eval_prompts": pool, "seed": seed},
                                "sampling": {"sampler": sampler, "temperature": temperature,
                                             "max_new_tokens": max_new_tokens, "group_size": 2}})  # fmt: skip
    inputs = load(config)
    tok, task_, examples, model_ = inputs.tok, inputs.task, inputs.eval_set, inputs.model
    if sft_steps:  # a policy that is sometimes right (the tiny model starts at 0)
        sft_warmup(model_, tok, task_, steps=sft_steps, seed=seed)
    policy = Policy(model_)
    engine = make_sampler(config, model_, tok, SINGLE)
    recorder = GradientRecorder(policy.parameters())
    try:
        for g in todo:
            grads, rows = [], []
            for r in range(repeats):
                row = {"G": g, "repeat": r, "prompts": prompts_per_step, "sample_s": 0.0, "grad_s": 0.0}
                for side in ("a", "b"):
                    batch = random.Random(f"{seed}-{g}-{r}-{side}").sample(examples, prompts_per_step)
                    start = time.perf_counter()
                    seeds = [seed_for(seed, 7, g, r, side == "b", k) for k in range(len(batch))]
                    rollout = sample_scored(engine, tok, inputs.rewards, batch, g, seeds, SINGLE)
                    row["sample_s"] += time.perf_counter() - start
                    start = time.perf_counter()
                    metrics = grpo_step(policy, recorder, rollout, loss_options=config.loss.kwargs(),
                                        temperature=temperature, token_budget=config.packing.token_budget,
                                        shared_prefix=config.packing.shared_prefix, grad_clip=None,
                                        algorithm=config.packing.algorithm)  # fmt: skip
                    row["grad_s"] += time.perf_counter() - start
                    grads.append(recorder.recorded.pop())
                    row[f"valid_{side}"] = 1.0 - metrics["invalid_group_rate"]
                    row[f"reward_{side}"] = metrics["reward"]
                a, b = grads[-2], grads[-1]
                aa, ab, bb = dot(a, a), dot(a, b), dot(b, b)
                row.update(norm_a=math.sqrt(aa), norm_b=math.sqrt(bb),
                           cosine=ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0)  # fmt: skip
                rows.append(row)
                print(f"G={g:2d} repeat {r}: cosine {row['cosine']:.3f}, valid {row['valid_a']:.2f} / "
                      f"{row['valid_b']:.2f}, {row['sample_s']:.0f} s sampling, {row['grad_s']:.0f} s gradients",
                      flush=True)  # fmt: skip
            saved["done"][str(g)] = {"rows": rows, "gram": [[dot(x, y) for y in grads] for x in grads]}
            grads.clear()
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                tmp = partial.with_suffix(".tmp")
                tmp.write_text(json.dumps(saved))
                tmp.replace(partial)
    finally:
        if sampler == "vllm":
            engine.close()
    return _from_saved(saved, group_sizes)


def _from_saved(saved: dict, group_sizes) -> tuple[list[dict], dict]:
    """(rows, grams) in --group-sizes order from the per-G results."""
    done = saved["done"]
    return [r for g in group_sizes for r in done[str(g)]["rows"]], {str(g): done[str(g)]["gram"] for g in group_sizes}


def write(out: Path, rows: list[dict], grams: dict, *, command: str, seconds: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "gradients.csv", COLUMNS, extra="ignore")
    (out / "gradients_gram.json").write_text(json.dumps({"command": command, "seconds": round(seconds),
                                                         "gram": grams}))  # fmt: skip
    return report(out)


def report(out: Path) -> list[Path]:
    """gradients.md and gradients.png from gradients.csv and gradients_gram.json."""
    with (out / "gradients.csv").open() as f:
        rows = list(csv.DictReader(f))
    saved = json.loads((out / "gradients_gram.json").read_text())
    table = summarize(rows, saved["gram"])
    lines = ["# Gradient agreement vs group size (fixed parameters, no training)", "",
             f"Command: `{saved['command']}` ({saved['seconds']} s sampling and computing gradients). Per G: R pairs "
             "of independent batches of the same number of prompts, G completions each; the policy gradient of each "
             "batch from the trainer's step.",
             "", "| G | repeats | cosine (95% CI) | SNR ‖E g‖ / sqrt(tr Var g) (95% jackknife) | valid samples | "
             "reward | s sampling / batch | s gradient / batch |", "|---|---|---|---|---|---|---|---|",
             *[f"| {t['G']} | {t['repeats']} | {t['cosine']:.3f} ± {t['cosine_ci']:.3f} | {t['snr']:.3f} "
               f"({t['snr_lo']:.3f} - {t['snr_hi']:.3f}) | {t['valid']:.3f} | {t['reward']:.3f} | "
               f"{t['sample_s']:.1f} | {t['grad_s']:.1f} |" for t in table]]  # fmt: skip
    (out / "gradients.md").write_text("\n".join(lines) + "\n")
    paths = [out / "gradients.csv", out / "gradients_gram.json", out / "gradients.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    gs = [t["G"] for t in table]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].errorbar(gs, [t["cosine"] for t in table], yerr=[t["cosine_ci"] for t in table], fmt="o-", capsize=3)
    axes[0].set(ylabel="cosine(g_a, g_b)", title="gradient agreement")
    axes[1].errorbar(gs, [t["snr"] for t in table], yerr=[[t["snr"] - t["snr_lo"] for t in table],
                     [t["snr_hi"] - t["snr"] for t in table]], fmt="o-", capsize=3)  # fmt: skip
    axes[1].set(ylabel="||E g|| / sqrt(tr Var g)", title="signal-to-noise")
    axes[2].plot(gs, [t["valid"] for t in table], "o-")
    axes[2].set(ylabel="share of samples with a gradient", title="valid samples", ylim=(0, 1.05))
    for ax in axes:
        ax.set(xscale="log", xlabel="G (same prompts per batch)")
        ax.set_xticks(gs, [str(g) for g in gs])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(out / "gradients.png", dpi=100)
    plt.close(fig)
    return [*paths, out / "gradients.png"]


def run(args, out_root: Path) -> int:
    out = out_root / group_size_model.results_name(args)
    if args.plot_only:
        for path in report(out):
            print(f"wrote {path}")
        return 0
    try:
        group_sizes = tuple(int(g) for g in args.group_sizes.split(","))
    except ValueError:
        raise SystemExit(f"--group-sizes: comma-separated integers, got {args.group_sizes!r}") from None
    if not group_sizes or min(group_sizes) < 2:
        raise SystemExit(f"--group-sizes: every G must be >= 2 (a group of one has no advantage), got {group_sizes}")
    if args.repeats < 2:
        raise SystemExit(f"--repeats must be >= 2 (a confidence interval needs two pairs), got {args.repeats}")
    if not 1 <= args.prompts_per_step <= args.prompts:
        raise SystemExit(f"--prompts-per-step must be in 1 .. --prompts ({args.prompts}), got {args.prompts_per_step}")
    partial = out / "gradients_partial.json"  # each finished G: a run cut short resumes after it
    rows, grams = measure(args.model, group_sizes=group_sizes, prompts_per_step=args.prompts_per_step,
                          repeats=args.repeats, pool=args.prompts, sampler=args.sampler, task=args.task,
                          difficulty=args.difficulty, temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, sft_steps=args.sft_steps,
                          partial=partial)  # fmt: skip
    command = (f"grpo-kernels group-size-study --model {args.model} --gradients --group-sizes {args.group_sizes} "
               f"--prompts-per-step {args.prompts_per_step} --repeats {args.repeats} --prompts {args.prompts} "
               f"--sampler {args.sampler} --task {args.task} --difficulty {args.difficulty} "
               f"--temperature {args.temperature} --max-new-tokens {args.max_new_tokens} --seed {args.seed}"
               + (f" --sft-steps {args.sft_steps}" if args.sft_steps else ""))  # fmt: skip
    seconds = sum(r["sample_s"] + r["grad_s"] for r in rows)  # (a resumed run's earlier G's included)
    for path in write(out, rows, grams, command=command, seconds=seconds):
        print(f"wrote {path}")
    partial.unlink(missing_ok=True)
    print((out / "gradients.md").read_text())
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--gradients", action="store_true",
                        help="with --model: gradient agreement and signal-to-noise vs G (gradients.py)")
    parser.add_argument("--group-sizes", default=",".join(map(str, GROUP_SIZES)), help="--gradients: G values")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="--gradients: prompts per batch")
    parser.add_argument("--repeats", type=int, default=5, help="--gradients: independent batch pairs per G")
    parser.add_argument("--sft-steps", type=int, default=0,
                        help="--gradients: a supervised warm start first (the tiny model starts at reward 0)")
    parser.add_argument("--plot-only", action="store_true", help="--gradients: rebuild the report from its files")
