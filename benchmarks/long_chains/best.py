"""The step a long-CoT user runs: a whole GRPO step of 4 prompts x G with spread completion lengths, each provider at
its own best micro-batching, step time and peak side by side.

Usage (from the repository root):
    .venv/bin/python -m benchmarks.long_chains.best                  # SmolLM2-135M-Instruct, fp32, cap 12 GB (hours)
    .venv/bin/python -m benchmarks.long_chains.best --quick          # the tiny model, short chains (the smoke test)
    .venv/bin/python -m benchmarks.long_chains.best --plot-only      # rebuild the report from the CSV

Points: G = 8 and 16, 4 prompts (32 and 64 completions), lengths seeded per point from two distributions:
    loguniform  log-uniform in [500, 8000] (mean ~2,700 tokens);
    longtail    "reasoning-like": log-normal with median 1,500 and sigma 0.9, clipped to [500, 8000] (mean ~2,200;
                ~3 % at the 8,000 cap, the truncated tail).
The measurement of one (provider, point, micro-batching) is long_chains.py's: a fresh process under the memory cap,
the same synthetic prompt and completions, one warm-up step, then one timed step (forward, loss, backward, AdamW).

Each provider's micro-batching, searched from the whole step in one micro-batch (k = 1) to k = 2, 4, ... micro-batches:
    trl_ckpt          trl.GRPOTrainer.compute_loss with gradient checkpointing, per_device_train_batch_size = n / k and
                      gradient accumulation over the k micro-batches. As in TRL, a micro-batch is a slice of the step's
                      padded batch: every row is padded to the step's longest completion (TRL pads the whole
                      generation batch, then splits it), so micro-batching lowers TRL's peak, not its padding.
    trl_rowfold       the same with TRL's LM-head fold run 128 rows at a time (long_chains.py's trl_rowfold): on the
                      CPU TRL folds each 4,096-token head tile with whole-tile fp32 temporaries that its Triton
                      kernel on a GPU does not hold; this is TRL's peak where that kernel runs.
    fused_trl_packed  FusedGRPOTrainer(packed=True, shared_prefix=True), the same micro-batches: each packed without
                      its pads.
    gk_blocks         grpo-kernels' grpo_step, block checkpointing, shared prompts: packing.token_budget = 1/k of
                      the step's tokens as the planner counts them (a prompt with each completion); with shared
                      prompts the planner keeps a group whole, so k goes up to one group per micro-batch.
    gk_auto           the same with model.activation_checkpointing = "auto" (long_chains.py's gk_auto: the trainer's
                      choice for each micro-batch size, its budget 90 % of the room under the cap).
    gk_sp             gk_blocks on N ranks (sequence parallel N, long_chains.py's gk_sp), each rank's budget 1/N of
                      that.
The search stops at the first k that fits under the cap: on CPU the step's arithmetic does not shrink with smaller
micro-batches (TRL pads every micro-batch to the step's longest completion; ours hold the same tokens in more
rows), so more micro-batches only add per-call overhead. --confirm measures on (2k, 4k,
...) while each is faster than the one before, to show that on a given machine; the best is the fastest measured.
Every measured k is a CSV row; the report shows each provider's best per point and its ratio to TRL's best (time and
peak), with the 1-minute load before each measurement (a row measured beside other work: rerun).
"""

import argparse
import functools
import math
import random
import sys
from pathlib import Path

from benchmarks.long_chains import sweep as lc

OUT = lc.OUT
PROVIDERS = ("trl_ckpt", "trl_rowfold", "fused_trl_packed", "gk_blocks", "gk_auto", "gk_sp")
DISTRIBUTIONS = ("loguniform", "longtail")
COLUMNS = ["timestamp", "device", "torch", "git_sha", "model", "provider", "dist", "group_size", "prompts", "min_len",
           "max_len", "k", "micro_rows", "token_budget", "micro_batches", "sp", "status", "step_s", "peak_rss_mb",
           "base_rss_mb", "real_tokens", "computed_tokens", "pad_tokens", "cap_mb", "load_before"]  # fmt: skip


def points(quick: bool, *, prompts: int = 4, min_len: int = 500, max_len: int = 8000) -> list[dict]:
    if quick:
        return [dict(dist="loguniform", group_size=2, prompts=2, min_len=16, max_len=128)]
    return [dict(dist=dist, group_size=g, prompts=prompts, min_len=min_len, max_len=max_len) for g in (8, 16)
            for dist in DISTRIBUTIONS]  # fmt: skip


def lengths(point: dict, seed: int = 0) -> list[int]:
    """The point's completion lengths, seeded by the point (the same for every provider)."""
    n = point["group_size"] * point["prompts"]
    rng = random.Random(f"{seed}-{point['dist']}-{n}-{point['min_len']}-{point['max_len']}")
    lo, hi = point["min_len"], point["max_len"]
    if point["dist"] == "loguniform":
        return [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    if point["dist"] == "longtail":
        median = math.sqrt(lo * hi) if hi < 8 * lo else 3 * lo  # 1,500 for [500, 8000]
        return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), 0.9)))) for _ in range(n)]
    raise ValueError(f"unknown length distribution {point['dist']!r}: one of {', '.join(DISTRIBUTIONS)}")


def search(measure_k, n_rows: int, *, confirm: bool = False) -> list[dict]:
    """Rows of k = 1, 2, 4, ... (k <= n_rows) up to the first k that fits; confirm: on from there while each k is
    faster than the one before (stopping at the first slower or failing k). measure_k(k) -> a row with "status"
    (and "step_s" when "ok")."""
    rows, k, best = [], 1, None
    while k <= n_rows:
        row = measure_k(k)
        rows.append(row)
        if row["status"] == "ok":
            if best is not None and float(row["step_s"]) >= float(best["step_s"]):  # a resumed row: str
                break
            best = row
            if not confirm:
                break
        elif best is not None:  # fitted with fewer micro-batches; this one failed: stop
            break
        k *= 2
    return rows


def best_rows(rows: list[dict]) -> dict:
    """(provider, point key) -> the fastest ok row."""
    out = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        key = (r["provider"], r["dist"], str(r["group_size"]), str(r["prompts"]), str(r["min_len"]), str(r["max_len"]))
        if key not in out or float(r["step_s"]) < float(out[key]["step_s"]):
            out[key] = r
    return out


def _ratio(row: dict, trl: dict | None, key: str) -> str:
    return f"{float(row[key]) / float(trl[key]):.2f}x" if trl else "-"


def report(csv_path: Path) -> Path:
    rows = lc._csv_rows(csv_path)
    best = best_rows(rows)
    lines = ["# The realistic long-chain step: each provider at its best micro-batching", "",
             "Command: `python -m benchmarks.long_chains.best` (the module's docstring says what is measured). Step "
             "time and peak RSS of each provider's fastest micro-batching that fits; the ratios are to TRL's best "
             "(trl_ckpt) at the same point, and to TRL's best without its CPU fold's temporaries (trl_rowfold: "
             "TRL's memory where its Triton head kernel runs) where that was measured; load: the 1-minute load "
             "average before the measurement (above 1: other work shared the cores, rerun the row); measured: when "
             "the row's run started. This machine's speed drifts by up to 30 % between hours, so a time ratio "
             "between rows of different runs is not a same-run result.",
             "",
             "| dist | lengths | G x prompts | provider | k | micro-batches | step s | peak MB | time vs TRL | "
             "peak vs TRL | time vs rowfold | peak vs rowfold | pad share | load | measured |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    point_keys = {(r["dist"], r["group_size"], r["prompts"], r["min_len"], r["max_len"]) for r in rows}
    for point in sorted(point_keys, key=lambda p: (int(p[4]), int(p[1]), p[0])):
        trl, rowfold = best.get(("trl_ckpt", *point)), best.get(("trl_rowfold", *point))
        lead = f"| {point[0]} | {point[3]}-{point[4]} | {point[1]} x {point[2]} | "
        for provider in PROVIDERS:
            r = best.get((provider, *point))
            if r is None:
                tried = [x["status"] for x in rows if (x["provider"], x["dist"], x["group_size"], x["prompts"],
                                                       x["min_len"], x["max_len"]) == (provider, *point)]  # fmt: skip
                if tried:
                    lines.append(f"{lead}{provider} | - | - | - | - | - | - | - | - | - | "
                                 f"{'; '.join(sorted(set(tried)))} | |")  # fmt: skip
                continue
            ratios = " | ".join(_ratio(r, base, key) for base in (trl, rowfold) for key in ("step_s", "peak_rss_mb"))
            pad = float(r["pad_tokens"]) / float(r["computed_tokens"]) if float(r["computed_tokens"]) else 0.0
            lines.append(f"{lead}{provider} | {r['k']} | {r['micro_batches']} | "
                         f"{float(r['step_s']):.1f} | {float(r['peak_rss_mb']):.0f} | {ratios} | "
                         f"{pad:.0%} | {r['load_before']} | {r['timestamp'][:16].replace('T', ' ')} |")  # fmt: skip
    lines += ["", "Every measured micro-batching (the search): the CSV beside this file.", ""]
    path = csv_path.with_suffix(".md")
    path.write_text("\n".join(lines))
    return path


def run(args) -> Path:
    from benchmarks.common import run_meta

    model_dir, model_name, scratch = lc.model_and_scratch(args.quick, args.model)
    csv_path = args.csv or OUT / f"long_chains_best_{model_name}.csv"
    done = {_key(r): r for r in lc._csv_rows(csv_path)}
    meta = run_meta("cpu")
    meta.pop("triton")
    sp = lc.sp_size(model_dir)
    prompt, _ = lc.prompt_ids(model_dir)
    providers = [p for p in PROVIDERS if p in args.providers.split(",")]
    for point in points(args.quick, prompts=args.prompts, min_len=args.min_len, max_len=args.max_len):
        if args.group_size and point["group_size"] != args.group_size or args.dist and point["dist"] != args.dist:
            continue
        drawn = lengths(point)
        ctx = dict(args=args, meta=meta, model_name=model_name, model_dir=model_dir, scratch=scratch, point=point,
                   lengths=drawn, prompt_len=len(prompt), done=done, csv_path=csv_path)  # fmt: skip
        for provider in providers:
            ranks = sp if provider == "gk_sp" else 1
            limit = len(drawn) if provider.startswith(("trl", "fused")) else point["prompts"]  # whole groups
            search(functools.partial(measure_k, ctx, provider, ranks), limit, confirm=args.confirm)
    if args.quick:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    report(csv_path)
    return csv_path


def measure_k(ctx: dict, provider: str, ranks: int, k: int) -> dict:
    """The row of (provider, point, k micro-batches): from the CSV when it is there, else measured and appended."""
    args, point, drawn = ctx["args"], ctx["point"], ctx["lengths"]
    cap_mb = min(args.cap_gb, args.machine_gb / ranks) * 1024  # gk_sp's ranks share the machine
    row = {**ctx["meta"], "model": ctx["model_name"], "provider": provider, **point, "k": k, "sp": ranks,
           "cap_mb": round(cap_mb)}  # fmt: skip
    if provider.startswith("gk"):  # each rank's token budget: 1/k of the step, at least the longest sequence (the
        # planner counts a sequence's prompt with each completion, also when the packed row holds it once)
        planned = len(drawn) * ctx["prompt_len"] + sum(drawn)
        row["token_budget"] = -(-max(-(-planned // k), ctx["prompt_len"] + max(drawn)) // ranks)
    else:
        row["micro_rows"] = len(drawn) // k
    if _key(row) in ctx["done"]:
        return ctx["done"][_key(row)]
    print(f"{provider:16s} {point} k={k}", flush=True)
    row["load_before"] = round(lc.settled_load(), 2)  # other work on the cores skews step_s
    extra = {"micro_rows": row.get("micro_rows"), "token_budget": row.get("token_budget"), "lengths": drawn}
    row.update(lc.measure(provider, dict(point, sweep="best"), model_dir=ctx["model_dir"], cap_mb=cap_mb,
                          scratch=ctx["scratch"], timeout=args.timeout, mmap_threshold=args.mmap_threshold,
                          extra=extra))  # fmt: skip
    shown = f", {row['peak_rss_mb']:.0f} MB peak, {row['step_s']:.1f} s" if row["status"] == "ok" else ""
    print(f"                 -> {row['status']}{shown}", flush=True)
    if row["status"] == "ok":
        row["step_s"], row["peak_rss_mb"], row["base_rss_mb"] = (round(row["step_s"], 2), round(row["peak_rss_mb"]),
                                                                 round(row["base_rss_mb"]))  # fmt: skip
    lc._append(ctx["csv_path"], row, COLUMNS)
    ctx["done"][_key(row)] = row
    return row


def _key(row) -> tuple:
    return tuple(str(row[k]) for k in ("provider", "dist", "group_size", "prompts", "min_len", "max_len", "k"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, short chains (the smoke test)")
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or an HF directory")
    parser.add_argument("--cap-gb", type=float, default=12.0, help="memory cap per process (GB)")
    parser.add_argument("--machine-gb", type=float, default=20.0, help="memory gk_sp's N ranks may take together")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="a subset of " + ", ".join(PROVIDERS))
    parser.add_argument("--group-size", type=int, default=0, help="only the points with this G (0: all)")
    parser.add_argument("--dist", choices=DISTRIBUTIONS, help="only the points with this length distribution")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (groups of G completions)")
    parser.add_argument("--min-len", type=int, default=500, help="the shortest completion length drawn")
    parser.add_argument("--max-len", type=int, default=8000, help="the longest completion length drawn")
    parser.add_argument("--confirm", action="store_true",
                        help="measure more micro-batches past the first fit while each is faster (hours more)")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds one measurement may take")
    parser.add_argument("--mmap-threshold", type=int, default=2**20, help="as long_chains.py's")
    parser.add_argument("--csv", type=Path, help="rows go here instead of benchmarks/results/long_chains/")
    parser.add_argument("--plot-only", action="store_true", help="rebuild the report from the CSV")
    args = parser.parse_args(argv)
    if args.prompts < 1 or not 1 <= args.min_len <= args.max_len:
        parser.error(f"need --prompts >= 1 and 1 <= --min-len <= --max-len, got {args.prompts}, {args.min_len}, "
                     f"{args.max_len}")  # fmt: skip
    unknown = set(args.providers.split(",")) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown provider: {', '.join(sorted(unknown))} (known: {', '.join(PROVIDERS)})")
    if args.plot_only:
        path = args.csv or OUT / f"long_chains_best_{Path(args.model).name}.csv"
        if not path.exists():
            parser.error(f"no CSV at {path}: run the measurement first")
        print(f"wrote {report(path)}")
        return 0
    print(f"wrote {run(args).with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
