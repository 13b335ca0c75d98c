"""Long chains of thought: who runs out of memory first. One GRPO training step (forward, loss, backward, optimizer;
no generation) on completions of 500-8,000 tokens, per provider, each in a fresh process under a memory cap.

Usage (from the repository root):
    .venv/bin/python benchmarks/long_chains/sweep.py              # SmolLM2-135M-Instruct, fp32, cap 12 GB (hours, CPU)
    .venv/bin/python benchmarks/long_chains/sweep.py --quick      # the tiny model, short chains (the smoke test)
    .venv/bin/python benchmarks/long_chains/sweep.py --plot-only  # rebuild the plot and the memory model from the CSV

The step: P prompts (a ~100-token chat prompt asking for worked reasoning) with G completions each; completions
are synthetic token sequences (random ids of the model's vocabulary, no special tokens), seeded. Sweeps:
    spread   G = 8 and 16, one prompt, lengths drawn log-uniformly from 500 to 8,000 (the headline rows);
    length   G = 8, every completion L tokens, L = 250, 500, 1k, 2k, 4k, 8k (stops for a provider past the cap);
    step     L = 8k, the completions of one step doubled: G = 16, 32 (the largest step that fits);
    longest  (--sweeps longest, not in the default) the longest single chain per provider: a group of two
             completions, one of L tokens and one of 250 (a group needs two; the short one keeps each probe to one
             long chain), each its own micro-batch (TRL: compute_loss and backward per row, the short row padded to
             L as TRL pads; ours: a token budget of one completion), L doubling from --longest-start (2,000) up to
             --longest-limit, then bisected to 5 %. Its result is a peak, not a time: its probes do not wait for an
             idle machine.
They run cheapest first (length up to 2k, spread G = 8, length 4k, spread G = 16, length 8k, step).
Providers (one micro-batch holds the whole step in all of them, so memory grows with the step):
    trl_ckpt / trl_nockpt   trl.GRPOTrainer.compute_loss + backward + AdamW step on TRL's padded batch (prompts
                            left-padded, completions right-padded to the longest), gradient checkpointing on (TRL's
                            default) / off; SDPA attention; TRL scores through its own chunked LM head (no logits);
    trl_rowfold             trl_ckpt with that head's CPU fold run ROWFOLD_ROWS (128) rows at a time: on the CPU the
                            fold holds several 4,096 x 32,768 fp32 temporaries per tile (about 0.5 GB each) that
                            TRL's Triton kernels on a GPU do not; the same values, TRL's memory where they run;
    fused_trl               FusedGRPOTrainer (the drop-in), same inputs, TRL's gradient checkpointing on;
    fused_trl_packed        the same with packed=True, shared_prefix=True: the drop-in's padding-free loss forward
                            from TRL's padded inputs (each prompt stored once);
    gk_none / gk_blocks     grpo_kernels' grpo_step (packed, shared prompt, fused LM-head loss) without / with
                            model.activation_checkpointing = "blocks";
    gk_auto                 model.activation_checkpointing = "auto" (the trainer's default) with 90 % of the room
                            between the cap and the process (after a warm-up step) as its budget: none, selective,
                            blocks on the first n blocks only, or blocks, whichever is fastest and fits (the choice
                            is printed with the row);
    gk_selective            model.activation_checkpointing = "selective": the matmuls' and attention's outputs kept,
                            the ops between them recomputed;
    gk_tiled                gk_blocks with the sequence-tiled MLP (model.mlp_tile_tokens = MLP_TILE, 512): one
                            block's MLP intermediates exist for a tile of the row, not the whole row;
    gk_sp                   gk_blocks on N ranks (torchrun, gloo) with distributed.sequence_parallel = N, the
                            smallest N >= 2 that divides the model's query heads (Ulysses splits heads): 2 for the
                            tiny model, 3 for SmolLM2-135M (9 heads, 3 KV heads); FSDP2 over the N ranks too, so the
                            static memory per rank drops as well; per-rank peak, each rank capped at
                            min(--cap-gb, --machine-gb / N).
Loss "dapo", beta 0, on-policy, fp32, 2 CPU threads per process (--threads; 1 per rank for gk_sp).
The constants named above (ROWFOLD_ROWS, MLP_TILE; also AUTO_SHARE, PROMPT) live in worker.py, which runs each
measurement.

Per row: sp (ranks), peak_rss_mb (VmHWM of the process, the largest rank's for gk_sp), base_rss_mb (RSS before the
step: model, optimizer state and inputs), step_s, tokens_per_s (real tokens / step_s), padding_fraction (pad tokens
/ tokens the model computed), mmap_threshold (the allocator setting, below), load_before (the 1-minute load average
when it started: CPU step times are only comparable on an idle machine), status ("ok", "over_cap": the process
passed --cap-gb and was stopped, "failed: ..."). A process watches its own RSS every 20 ms and exits when it passes
the cap, so a provider that cannot fit is recorded, not fatal. A failed measurement also prints its account to
stderr (benchmarks/long_chains/diagnose.py: each rank's phases and stderr, who sent a SIGTERM, torchrun's summary).
Rows are appended to benchmarks/results/long_chains/long_chains_<model>.csv as they finish; a rerun skips the rows
that are there (resumable). At the end (and with --plot-only) it writes the plot (peak memory vs tokens per step,
one line per provider) and memory_model.md: bytes per token per provider fitted on the measured rows, extrapolated
to Qwen2.5-7B in bf16 on 80 GB H100s. That extrapolation is a model, not a measurement.

Allocator. With glibc's default settings the peak RSS of a step measures the allocator as much as the step: the mmap
threshold rises to 32 MiB after the first large free, so activation-sized blocks come from the heap, and a heap
fragmented by blocks that stay alive (checkpointed inputs between freed temporaries) is not returned. Measured on
SmolLM2, gk_blocks, 8 x 500 tokens: peak 5.1 GB with the default, 2.8 GB with MALLOC_MMAP_THRESHOLD_=1 MiB, where
the forward grows by exactly the checkpointed block inputs (4 bytes x hidden per token per block). Every worker
therefore runs with --mmap-threshold (default 1 MiB; 0 = glibc's default): peak RSS then follows the live tensors,
as a GPU's peak allocated memory does; mapping and unmapping large blocks costs step time (about 1.3x on that
step), the same setting for every provider.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.common import append_csv  # noqa: E402
from benchmarks.long_chains import diagnose  # noqa: E402  a failed measurement's account
from benchmarks.long_chains.report import PROVIDERS, _csv_rows, report  # noqa: E402  the table, plot, memory model
from benchmarks.long_chains.worker import EXIT_OVER_CAP, prompt_ids, settled_load  # noqa: E402  one measurement

WORKER = Path(__file__).resolve().parent / "worker.py"

OUT = Path(__file__).resolve().parents[1] / "results" / "long_chains"
COLUMNS = ["timestamp", "device", "torch", "git_sha", "model", "sweep", "provider", "group_size", "prompts",
           "min_len", "max_len", "real_tokens", "computed_tokens", "padding_fraction", "step_s", "tokens_per_s",
           "sp", "base_rss_mb", "peak_rss_mb", "cap_mb", "mmap_threshold", "load_before", "status"]  # fmt: skip


def sweeps(quick: bool) -> list[dict]:
    """The (sweep, G, prompts, length range) points, in the order they run (--quick: two small points)."""
    if quick:
        return [dict(sweep="spread", group_size=4, prompts=1, min_len=16, max_len=128),
                dict(sweep="length", group_size=4, prompts=1, min_len=256, max_len=256)]  # fmt: skip
    spread = [dict(sweep="spread", group_size=g, prompts=1, min_len=500, max_len=8000) for g in (8, 16)]
    length = [dict(sweep="length", group_size=8, prompts=1, min_len=n, max_len=n)
              for n in (250, 500, 1000, 2000, 4000, 8000)]  # fmt: skip
    step = [dict(sweep="step", group_size=g, prompts=1, min_len=8000, max_len=8000) for g in (16, 32)]
    # the cheap points first: a run cut short (hours on CPU; a rerun resumes) still has the memory lines
    return [*length[:4], spread[0], length[4], spread[1], length[5], *step]


LONGEST_SHORT = 250  # the other completion of a "longest" point's group


def longest_point(n: int) -> dict:
    """The "longest" sweep's point: a group of two completions (a GRPO group needs two), n and LONGEST_SHORT
    tokens, trained one per micro-batch, so the peak is that of one chain of n tokens."""
    return dict(sweep="longest", group_size=2, prompts=1, min_len=min(LONGEST_SHORT, n), max_len=n)


def longest_search(fits, start: int, limit: int, tolerance: float = 0.05) -> tuple[int, bool]:
    """(the longest n for which fits(n), whether the search stopped at limit): doubling from start while it fits (up
    to limit), then bisection until the bracket is within tolerance of its lower end; 0 when not even the shortest
    length tried fits."""
    lo, hi, n = 0, None, start
    while hi is None:
        if fits(n):
            lo = n
            if n >= limit:
                return lo, True
            n = min(2 * n, limit)
        else:
            hi = n
    while hi - lo > max(1, tolerance * lo):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


# ------------------------------------------------------------------------------------------------------------------
# The driver.


def sp_size(model_dir: str) -> int:
    """The smallest N >= 2 dividing the model's query heads: the sequence-parallel size gk_sp runs."""
    import transformers

    heads = transformers.AutoConfig.from_pretrained(model_dir).num_attention_heads
    return next(n for n in range(2, heads + 1) if heads % n == 0)


def measure(provider: str, point: dict, *, model_dir: str, cap_mb: float, scratch: str, timeout: float,
            mmap_threshold: int = 0, extra: dict | None = None, threads: int = 2) -> dict:  # fmt: skip
    """Run one (provider, point) in a fresh process (N for gk_sp); the row's measured fields and status.
    mmap_threshold > 0: glibc's MALLOC_MMAP_THRESHOLD_ for the worker (blocks from that size on are mapped and
    returned to the system when freed); 0: glibc's default (a threshold that rises to 32 MiB as blocks are freed).
    threads: torch threads of a one-process provider (gk_sp: one per rank)."""
    sp = sp_size(model_dir) if provider == "gk_sp" else 1
    prompt, special = prompt_ids(model_dir)
    spec = dict(provider=provider, point=point, model_dir=model_dir, cap_mb=cap_mb, scratch=scratch, sp=sp,
                threads=1 if sp > 1 else threads, prompt_ids=prompt, special_ids=special, **(extra or {}))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    script = [str(WORKER), json.dumps(spec)]
    Path(scratch).mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{provider}-ranks-", dir=scratch)) if sp > 1 else None  # their output
    run = diagnose.launch(script, ranks=sp, env=env, timeout=timeout, log_dir=log_dir)
    results = [json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode == 0 and len(results) == sp and not run.timed_out:
        _remove(log_dir)
        out = dict(results[0], sp=sp)
        out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
        out["base_rss_mb"] = max(r["base_rss_mb"] for r in results)
        out["status"] = "ok"
        return out
    if not run.timed_out and (f"exitcode  : {EXIT_OVER_CAP}" in run.stderr or run.returncode == EXIT_OVER_CAP):
        _remove(log_dir)
        return {"status": "over_cap"}
    # what happened, for a reader of this run's output alone (a CI log): each rank's lines, who sent a signal
    print(diagnose.report(run, f"{provider} {point}") + (f"\n--- each rank's full output: {log_dir} ---"
                                                         if log_dir else ""), file=sys.stderr, flush=True)  # fmt: skip
    if run.timed_out:
        return {"status": f"failed: over the {timeout:.0f} s timeout"}
    if run.returncode == 0:  # every process ended well, but not every rank's result line arrived
        return {"status": f"failed: {len(results)} of {sp} result lines"}
    return {"status": f"failed: {_failure(run)}"}


def _remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _failure(run) -> str:
    """failure_reason of a failed run, the error of torchrun's root-cause rank preferred (its output read last),
    and, when a SIGTERM ended that rank, who sent it (diagnose.watch): torchrun's agent sends it only to the ranks
    left when another one failed or when the agent itself was stopped."""
    cause = diagnose.root_cause(run.stderr)
    root = int(cause["rank"]) if cause.get("rank", "").isdigit() else None
    ranks = sorted(run.ranks, key=lambda r: r == root)
    reason = failure_reason(run.returncode, "".join(run.ranks[r] for r in ranks) + run.own_stderr)
    if root is None or cause.get("exitcode") != f"-{signal.SIGTERM.value}":
        return reason
    sender = diagnose.sigterm_sender(run, root)
    return reason + (f", sent by {sender[:200]}" if sender else ", its sender unknown (no line from diagnose.watch)")


def failure_reason(returncode: int, stderr: str) -> str:
    """One line on why a measurement process failed: the exception a rank raised (not torchrun's own
    ChildFailedError, which only says that a rank failed) and, under torchrun, the root cause's exit code or signal."""
    lines = [x.strip() for x in stderr.strip().splitlines()] or ["no output"]
    errors = [x for x in lines if ("Error" in x or "error:" in x or "Exception" in x) and "ChildFailedError" not in x
              and not x.startswith(("File ", "raise ", "Traceback"))]  # fmt: skip
    # torchrun lists the other ranks' failures first (often SIGTERM: it stops them) and the root cause last
    root = next((i for i, x in enumerate(lines) if x.startswith("Root Cause")), 0)
    cause = next((x.split(":", 1)[1].split("(pid")[0].strip() for x in lines[root:] if x.startswith("exitcode  :")),
                 None)  # fmt: skip
    signal = next((x.split(":", 1)[1].strip() for x in lines[root:] if x.startswith("traceback :") and "Signal" in x),
                  None)  # fmt: skip
    text = [x for x in lines if x.strip("=-") and not x.startswith(("File ", "raise ", "^"))]
    parts = [errors[-1][:160]] if errors else [] if cause is not None else [(text or ["no output"])[-1][:160]]
    if cause is not None:
        parts.append(f"a rank's exit code {cause}" + (f" ({signal.split(' received')[0]})" if signal else ""))
    elif returncode < 0:
        parts.append(f"killed by signal {-returncode}")
    else:
        parts.append(f"exit code {returncode}")
    return "; ".join(parts)


def _key(row) -> tuple:
    return (row["provider"], row["sweep"], str(row["group_size"]), str(row["prompts"]), str(row["min_len"]),
            str(row["max_len"]))  # fmt: skip


def model_and_scratch(quick: bool, model: str) -> tuple[str, str, str]:
    """(model directory, its name in the CSV, scratch directory): --quick writes the tiny model into a fresh
    temporary directory (removed at the end of the run), else the known model or HF directory, scratch under OUT."""
    if quick:
        from grpo_kernels.train.model.hf import write_tiny_checkpoint

        scratch = tempfile.mkdtemp(prefix="long-chains-")
        return str(write_tiny_checkpoint(Path(scratch) / "model")), "tiny", scratch
    from grpo_kernels.train.model.known import resolve_model

    return str(resolve_model(model) or model), Path(model).name, str(OUT / "scratch")


def run(args) -> Path:
    from benchmarks.common import run_meta

    quick = args.quick
    model_dir, model_name, scratch = model_and_scratch(quick, args.model)
    csv_path = args.csv or OUT / f"long_chains_{model_name}.csv"
    previous = _csv_rows(csv_path)
    done = {_key(r): r for r in previous}
    meta = run_meta("cpu")
    meta.pop("triton")
    sp = sp_size(model_dir)
    providers = [p for p in PROVIDERS if p in args.providers.split(",")]
    # (provider, sweep) past the cap: its larger points are not tried, in a resumed run too
    over = {(r["provider"], r["sweep"]) for r in previous if r["status"] == "over_cap"}
    points = [p for p in sweeps(quick) if p["sweep"] in args.sweeps.split(",")]
    points = [p for p in points if not args.max_len or p["max_len"] <= args.max_len]
    points = [p for p in points if p["max_len"] >= args.min_len]
    def measure_row(provider: str, point: dict) -> dict:
        """The row of (provider, point): from the CSV when it is there, else measured and appended."""
        ranks = sp if provider == "gk_sp" else 1
        cap_mb = min(args.cap_gb, args.machine_gb / ranks) * 1024  # the ranks of gk_sp share the machine
        row = {**meta, "model": model_name, "provider": provider, **point, "sp": ranks, "cap_mb": round(cap_mb),
               "mmap_threshold": args.mmap_threshold}  # fmt: skip
        if _key(row) in done:
            return done[_key(row)]
        if (provider, point["sweep"]) in over and point["sweep"] not in ("spread", "longest"):
            row["status"] = "skipped: a smaller point of this sweep was over the cap"
        else:
            print(f"{provider:11s} {point}", flush=True)
            # other work on the cores skews step_s; the smoke test (quick) and the longest sweep (a peak, not a
            # time) do not wait for an idle machine
            row["load_before"] = round(settled_load(wait_s=0 if quick or point["sweep"] == "longest" else 180), 2)
            row.update(measure(provider, point, model_dir=model_dir, cap_mb=cap_mb, scratch=scratch,
                               timeout=args.timeout, mmap_threshold=args.mmap_threshold,
                               threads=args.threads))  # fmt: skip
            print(f"            -> {row['status']}" + (f", {row['peak_rss_mb']:.0f} MB peak, {row['step_s']:.1f} s"
                                                        if row["status"] == "ok" else ""), flush=True)  # fmt: skip
            if row.get("checkpointing"):
                print(f"            {row['checkpointing']}", flush=True)
        if row["status"] == "over_cap":
            over.add((provider, point["sweep"]))
        if row["status"] == "ok":
            row["padding_fraction"] = round(row["pad_tokens"] / row["computed_tokens"], 4)
            row["tokens_per_s"] = round(row["real_tokens"] / row["step_s"], 1)
            row["step_s"] = round(row["step_s"], 2)
            row["peak_rss_mb"], row["base_rss_mb"] = round(row["peak_rss_mb"]), round(row["base_rss_mb"])
        _append(csv_path, row)
        done[_key(row)] = row
        return row

    for point in (p for p in points if not args.group_size or p["group_size"] == args.group_size):
        for provider in providers:
            measure_row(provider, point)
    if "longest" in args.sweeps.split(","):
        start, limit = (16, 16) if quick else (args.longest_start, args.longest_limit)
        for provider in providers:
            ok = lambda n, provider=provider: measure_row(provider, longest_point(n))["status"] == "ok"  # noqa: E731
            n, capped = longest_search(ok, start, limit)
            print(f"{provider:11s} longest single chain: {n} tokens" + (f" (the --longest-limit {limit})"
                                                                         if capped else ""), flush=True)  # fmt: skip
    if quick:
        shutil.rmtree(scratch, ignore_errors=True)
    report(csv_path)
    return csv_path


def _append(path: Path, row: dict, columns: list = COLUMNS) -> None:
    append_csv([row], path, columns, extra="ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, short chains (the smoke test)")
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or an HF directory")
    parser.add_argument("--cap-gb", type=float, default=12.0, help="memory cap per process (GB)")
    parser.add_argument("--machine-gb", type=float, default=20.0,
                        help="memory the N ranks of gk_sp may take together: each is capped at min(cap, this / N)")
    parser.add_argument("--providers", default=",".join(PROVIDERS),
                        help="comma-separated subset of " + ", ".join(PROVIDERS))  # fmt: skip
    parser.add_argument("--sweeps", default="length,spread,step",
                        help="comma-separated subset of length, spread, step (in their usual order) and longest (the "
                             "longest single chain per provider, one completion per micro-batch: doubling from 2000 "
                             "tokens, then bisection to 5 %%)")  # fmt: skip
    parser.add_argument("--longest-start", type=int, default=2000, help="the longest sweep's first length")
    parser.add_argument("--longest-limit", type=int, default=131072, help="the longest sweep stops doubling here")
    parser.add_argument("--max-len", type=int, default=0,
                        help="run only the points whose completions are at most this long (0: all)")
    parser.add_argument("--min-len", type=int, default=0,
                        help="run only the points whose longest completion is at least this long (0: all)")
    parser.add_argument("--group-size", type=int, default=0, help="run only the points with this G (0: all)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads per process (gk_sp: 1 per rank); 1 for memory probes run side by side: "
                             "two 2-thread processes on 2 cores stall each other's OpenMP barriers")
    parser.add_argument("--mmap-threshold", type=int, default=2**20,
                        help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) for every worker, so that peak RSS follows the "
                             "live tensors; 0 = glibc's default, whose retained heap is part of the peak")  # fmt: skip
    parser.add_argument("--csv", type=Path, help="rows go here instead of benchmarks/results/long_chains/")
    parser.add_argument("--plot-only", action="store_true", help="rebuild the report from the CSV")
    args = parser.parse_args()
    unknown = set(args.providers.split(",")) - set(PROVIDERS) | set(args.sweeps.split(",")) - {"length", "spread",
                                                                                                  "step", "longest"}
    if args.threads < 1:
        parser.error(f"--threads needs at least 1, got {args.threads}")
    if not 16 <= args.longest_start <= args.longest_limit:
        parser.error(f"--longest-start and --longest-limit need 16 <= start <= limit, got {args.longest_start} and "
                     f"{args.longest_limit}")
    if min(args.max_len, args.min_len, args.group_size) < 0:
        parser.error(f"--max-len, --min-len and --group-size must be >= 0, got {args.max_len}, {args.min_len} and "
                     f"{args.group_size}")
    if unknown:
        parser.error(f"unknown provider or sweep: {', '.join(sorted(unknown))}")
    if args.plot_only:
        report(args.csv or OUT / f"long_chains_{Path(args.model).name}.csv")
        return
    run(args)


if __name__ == "__main__":
    main()
