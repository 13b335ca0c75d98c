"""Does our HF sampler draw from the same distribution as HF's own sampling (what TRL's GRPOTrainer uses)?

    python -m benchmarks.learning.sampler_distribution [--model smollm2-135m] [--task arith --difficulty 2]
        [--temperature 0.7] [--max-new-tokens 24] [--prompts 96] [--group-size 8] [--rounds 1] [--contexts 24]
        [--draws 2000]

Two checks on the learning-vs-TRL run's own model, prompts and settings:

1. Tokens. At --contexts next-token distributions of the model (positions of completions it sampled), each token
   drawn --draws times by our draw (`SeededSampling`: a generator per row, Gumbel-max in float32, exactly the code
   that samples) and by `torch.multinomial` (HF's do_sample), each compared with the exact softmax(logits / T) by a
   chi-square test (bins: the tokens expected >= 5 times, the rest pooled), summed over the contexts.
2. Rollouts. G completions of each of --prompts training prompts by `HFSampler` and by `generate(do_sample=True,
   top_k=0, temperature=T)` (TRL's generation settings), compared per prompt (paired over prompts, mean difference
   and its 95 % t-interval): completion length, truncated fraction, reward, correct, and the asked-for bare form;
   and, within each group of G, what GRPO's advantage depends on: whether all G rewards are equal (an invalid
   group), the rewards' standard deviation, and the fraction of distinct completions. With --rounds R > 1 every
   prompt gets R groups, group r with the seed the trainer gives that prompt at step r (ours) or the next draws of
   the global RNG (HF), and the standard deviation of the R group-mean rewards is compared too: rows or steps whose
   draws were correlated would show in these as fewer distinct completions, more invalid groups, or a spread of
   group means unlike HF's. --contexts 0 leaves the first check out (results then in <model>_rollouts.md).

A draw that is right passes the first check at any --draws (its p-value is uniform); a difference in the second
that is outside its interval on a run with enough prompts is a difference in what the two trainers train on.
Results: benchmarks/results/sampler_distribution/<model>.md (<model>_rollouts.md with --contexts 0).
"""

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import ARITH_FORMAT_WEIGHT_COMMITTED, ROOT, device_name, t975

OUT = ROOT / "benchmarks" / "results" / "sampler_distribution"


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against probabilities: the tokens expected at least
    min_expected times are bins of their own, the rest one pooled bin."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item() + (obs[~keep].sum().item() and math.inf)
    return stat, int(keep.sum().item()) - 1


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2(dof) >= stat)."""
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()  # fmt: skip


def ours_counts(logits: torch.Tensor, draws: int, temperature: float, seed: int, chunk: int = 250) -> torch.Tensor:
    """Token counts of `draws` draws by the sampler's own draw (one seeded generator per row, as it samples)."""
    from grpo_kernels.train.rollout.hf_sampler import SeededSampling, row_seed

    counts = torch.zeros(logits.numel(), dtype=torch.long)
    for start in range(0, draws, chunk):
        rows = range(start, min(draws, start + chunk))
        gens = [torch.Generator().manual_seed(row_seed(seed, j)) for j in rows]
        out = SeededSampling(gens, temperature, 1.0)(None, logits.expand(len(rows), -1).clone())
        counts += torch.bincount(out.argmax(-1), minlength=logits.numel())
    return counts


def multinomial_counts(logits: torch.Tensor, draws: int, temperature: float, seed: int) -> torch.Tensor:
    """Token counts of `draws` draws by torch.multinomial, one row at a time as HF's do_sample draws them."""
    probs = torch.softmax(logits.float() / temperature, -1).expand(draws, -1)
    picks = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    return torch.bincount(picks, minlength=logits.numel())


def pair_draws(kind: str, logits: torch.Tensor, pairs: int, temperature: float, seed: int) -> torch.Tensor:
    """[pairs, 2] tokens drawn by the sampler's own draw from one distribution, two per pair, from the draws that a
    wrong seeding would correlate: "rows" members j and j + 1 of a group (prompt k's seed at one step), "steps"
    member j of prompt k at steps s and s + 1, "positions" one row's two successive tokens (one generator)."""
    from grpo_kernels.train.rollout.hf_sampler import SeededSampling, row_seed
    from grpo_kernels.train.rollout.sampling import seed_for

    def draw(generators):
        scores = logits.expand(len(generators), -1).clone()
        return SeededSampling(generators, temperature, 1.0)(None, scores).argmax(-1)

    gen = torch.Generator
    idx = [(k // 7, k % 7) for k in range(pairs)]  # (prompt or step, member) over several of each
    if kind == "rows":
        a = draw([gen().manual_seed(row_seed(seed_for(seed, 0, 0, k), j)) for k, j in idx])
        b = draw([gen().manual_seed(row_seed(seed_for(seed, 0, 0, k), j + 1)) for k, j in idx])
    elif kind == "steps":
        a = draw([gen().manual_seed(row_seed(seed_for(seed, s, 0, 3), j)) for s, j in idx])
        b = draw([gen().manual_seed(row_seed(seed_for(seed, s + 1, 0, 3), j)) for s, j in idx])
    elif kind == "positions":
        gens = [gen().manual_seed(row_seed(seed_for(seed, 0, 0, k), j)) for k, j in idx]
        a, b = draw(gens), draw(gens)
    else:
        raise ValueError(f"kind is rows, steps or positions, got {kind!r}")
    return torch.stack([a, b], 1)


def independence(pairs: torch.Tensor, probs: torch.Tensor, min_prob: float = 0.02) -> tuple[float, int]:
    """Chi-square test of independence of the two tokens of each pair: (statistic, degrees of freedom) of their
    contingency table over bins (each token of probability >= min_prob its own bin, the rest one bin)."""
    big = (probs >= min_prob).nonzero()[:, 0]
    bin_of = torch.full_like(probs, len(big), dtype=torch.long)
    bin_of[big] = torch.arange(len(big))
    n_bins = len(big) + 1
    table = torch.bincount(bin_of[pairs[:, 0]] * n_bins + bin_of[pairs[:, 1]], minlength=n_bins**2)
    table = table.view(n_bins, n_bins).double()
    table = table[table.sum(1) > 0][:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return ((table - expected) ** 2 / expected).sum().item(), (table.shape[0] - 1) * (table.shape[1] - 1)


def paired(diffs: list[float]) -> str:
    m = statistics.mean(diffs)
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return f"{m:+.4f} ± {half:.4f}" + (" (outside)" if abs(m) > half else "")


def rollout_stats(rewards, tok, examples, completions: list, truncated: list, g: int, rounds: int = 1) -> dict:
    """Per prompt: the mean over its R groups of G completions (group r of prompt k in rows
    (r * len(examples) + k) * g ... + g) of each quantity, and the standard deviation of the R group means."""
    keys = ("length", "truncated", "reward", "correct", "bare", "invalid", "reward_sd", "distinct")
    out = {k: [] for k in keys + (("group_mean_sd",) if rounds > 1 else ())}
    for k, e in enumerate(examples):
        per_group = {key: [] for key in keys}
        for r in range(rounds):
            rows = range((r * len(examples) + k) * g, (r * len(examples) + k + 1) * g)
            texts = [tok.decode(completions[i]) for i in rows]
            values = [rewards.reward(t, e) for t in texts]
            per_group["length"].append(statistics.mean(len(completions[i]) for i in rows))
            per_group["truncated"].append(statistics.mean(float(truncated[i]) for i in rows))
            per_group["reward"].append(statistics.mean(values))
            per_group["correct"].append(statistics.mean(rewards.correct(t, e) for t in texts))
            per_group["bare"].append(statistics.mean(float(re.fullmatch(r"\s*-?\d+\s*", t) is not None) for t in texts))
            per_group["invalid"].append(float(max(values) == min(values)))
            per_group["reward_sd"].append(statistics.pstdev(values))
            per_group["distinct"].append(len({tuple(completions[i].tolist()) for i in rows}) / g)
        for key in keys:
            out[key].append(statistics.mean(per_group[key]))
        if rounds > 1:
            out["group_mean_sd"].append(statistics.stdev(per_group["reward"]))
    return out


def hf_sample(model, tok, prompts: list, g: int, args, seed: int, rounds: int = 1) -> tuple[list, list]:
    """G completions per prompt by HF's own sampling with TRL's settings (top_k 0, no other processor), R rounds
    over the prompts (row order as in `rollout_stats`), the global RNG seeded once."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                              top_k=0, top_p=1.0, pad_token_id=tok.pad_id, eos_token_id=list(tok.stop_ids))  # fmt: skip
    completions, truncated = [], []
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in [p for _ in range(rounds) for p in prompts]:
            ids = torch.tensor([p] * g)
            new = model.generate(ids, generation_config=config)[:, ids.shape[1] :]
            for row in new:
                ends = torch.isin(row, torch.tensor(tok.stop_ids)).nonzero()
                completions.append(row[: int(ends[0]) + 1] if ends.numel() else row)
                truncated.append(not ends.numel())
    return completions, truncated


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--difficulty", type=int, default=2)
    parser.add_argument("--format-weight", type=float, help="arith's bare-integer bonus in the rewards compared "
                        "(default for arith: 0.2, the weight of the committed tables; the task's own default is 0)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--contexts", type=int, default=24)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.format_weight is None and args.task == "arith":
        args.format_weight = ARITH_FORMAT_WEIGHT_COMMITTED
    if min(args.prompts, args.group_size, args.draws) < 2 or args.contexts == 1 or args.contexts < 0:
        raise SystemExit("sampler-distribution: --prompts, --group-size and --draws must be >= 2, --contexts 0 "
                         "(no token check) or >= 2")
    if args.rounds < 1:
        raise SystemExit(f"sampler-distribution: --rounds must be >= 1, got {args.rounds}")
    from grpo_kernels.train.build import load_model, task_examples, task_rewards
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.data.tasks import PromptStream
    from grpo_kernels.train.rollout.hf_sampler import HFSampler
    from grpo_kernels.train.rollout.sampling import seed_for

    config = load_config(None, [f"--model.name={args.model}", f"--task.name={args.task}",
                                f"--task.difficulty={args.difficulty}", f"--seed={args.seed}",
                                *([f"--task.format_weight={args.format_weight}"] if args.format_weight is not None
                                  else [])])  # fmt: skip
    model, tok = load_model(config, attn_implementation="sdpa")  # the trainer's loading and prompt format
    task, train_set, _ = task_examples(config)
    rewards = task_rewards(task, config.task)
    examples = PromptStream(train_set, args.seed).take(args.prompts)
    prompts = [tok.encode_prompt(e.prompt) for e in examples]
    g, start = args.group_size, time.perf_counter()
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature)  # fmt: skip
    R = args.rounds
    if R == 1:  # the seeds of the first committed run of this check
        ours = sampler.sample(prompts, g, seeds=[seed_for(args.seed, k) for k in range(len(prompts))])
    else:  # round r: the seeds the trainer gives these prompts at step r
        ours = sampler.sample(prompts * R, g, seeds=[seed_for(args.seed, r, 0, k) for r in range(R)
                                                     for k in range(len(prompts))])  # fmt: skip
    theirs = hf_sample(model, tok, prompts, g, args, args.seed, R)
    a = rollout_stats(rewards, tok, examples, ours.completion_ids, ours.truncated, g, R)
    b = rollout_stats(rewards, tok, examples, *theirs, g, R)

    # token level: contexts along our completions (the first token and one further in, over the first prompts)
    contexts = []
    for r in range(0, len(prompts) * g, g) if args.contexts else ():
        c = ours.completion_ids[r]
        for j in (0, len(c) // 2):
            if len(contexts) < args.contexts:
                contexts.append(torch.cat([torch.as_tensor(prompts[r // g]), c[:j]]))
    totals = {"ours": [0.0, 0], "multinomial": [0.0, 0]}
    with torch.no_grad():
        for i, ctx in enumerate(contexts):
            logits = model(ctx.view(1, -1)).logits[0, -1].float()
            probs = torch.softmax(logits / args.temperature, -1)
            for name, counts in (("ours", ours_counts(logits, args.draws, args.temperature, 1000 + i)),
                                 ("multinomial", multinomial_counts(logits, args.draws, args.temperature, 1000 + i))):
                stat, dof = chi_square(counts, probs)
                totals[name][0] += stat
                totals[name][1] += dof
    seconds = time.perf_counter() - start

    lines = ["# Sampler distribution: our HF sampler against HF's own sampling", "",
             f"Command: `python -m benchmarks.learning.sampler_distribution --model {args.model} --task {args.task} "
             f"--difficulty {args.difficulty}"
             + (f" --format-weight {args.format_weight:g}" if args.format_weight is not None else "")
             + f" --temperature {args.temperature} --max-new-tokens {args.max_new_tokens} "
             f"--prompts {args.prompts} --group-size {g} --rounds {R} --contexts {args.contexts} --draws {args.draws} "
             f"--seed {args.seed}` ({seconds:.0f} s on {device_name('cpu')})", ""]  # fmt: skip
    if args.contexts:
        lines += [f"## Tokens: {len(contexts)} next-token distributions x {args.draws} draws, chi-square against "
                  "softmax(logits / T)", "", "| draw | chi-square | dof | p |", "|---|---:|---:|---:|"]  # fmt: skip
        for name, (stat, dof) in totals.items():
            lines.append(f"| {name} | {stat:.1f} | {dof} | {chi2_sf(stat, dof):.3f} |")
        lines.append("")
    lines += [f"## Rollouts: {args.prompts} prompts x {R} group(s) of G = {g}, per-prompt means over the groups, "
              "paired over the prompts", "",
              "invalid: all G rewards equal; reward_sd: the rewards' standard deviation within a group; distinct: "
              "distinct completions / G" + ("; group_mean_sd: the standard deviation of a prompt's R group-mean "
              "rewards" if R > 1 else "") + ".", "",
              "| quantity | ours | HF do_sample | ours - HF (95 % t-interval) |", "|---|---:|---:|---:|"]  # fmt: skip
    for k in a:
        lines.append(f"| {k} | {statistics.mean(a[k]):.4f} | {statistics.mean(b[k]):.4f} | "
                     f"{paired([x - y for x, y in zip(a[k], b[k], strict=True)])} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    out = args.out or OUT / f"{Path(args.model).name}{'' if args.contexts else '_rollouts'}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
