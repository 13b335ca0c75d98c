"""Long chains of thought: who runs out of memory first. One GRPO training step (forward, loss, backward, optimizer;
no generation) on completions of 500-8,000 tokens, per provider, each in a fresh process under a memory cap.

Usage (from the repository root):
    .venv/bin/python benchmarks/long_chains.py                 # SmolLM2-135M-Instruct, fp32, cap 12 GB (hours on CPU)
    .venv/bin/python benchmarks/long_chains.py --quick         # the tiny model, short chains (the smoke test)
    .venv/bin/python benchmarks/long_chains.py --plot-only     # rebuild the plot and the memory model from the CSV

The step: P prompts (a ~100-token chat prompt asking for worked reasoning) with G completions each; completions
are synthetic token sequences (random ids of the model's vocabulary, no special tokens), seeded. Sweeps:
    spread   G = 8 and 16, one prompt, lengths drawn log-uniformly from 500 to 8,000 (the headline rows);
    length   G = 8, every completion L tokens, L = 250, 500, 1k, 2k, 4k, 8k (stops for a provider past the cap);
    step     L = 8k, the completions of one step doubled: G = 16, 32 (the largest step that fits);
    longest  (--sweeps longest, not in the default) the longest single chain per provider: two completions of L
             tokens, each its own micro-batch (TRL: compute_loss and backward per row; ours: a token budget of one
             completion), L doubling from 2,000 up to --longest-limit, then bisected to 5 %.
They run cheapest first (length up to 2k, spread G = 8, length 4k, spread G = 16, length 8k, step).
Providers (one micro-batch holds the whole step in all of them, so memory grows with the step):
    trl_ckpt / trl_nockpt   trl.GRPOTrainer.compute_loss + backward + AdamW step on TRL's padded batch (prompts
                            left-padded, completions right-padded to the longest), gradient checkpointing on (TRL's
                            default) / off; SDPA attention;
    fused_trl               FusedGRPOTrainer (the drop-in), same inputs, TRL's gradient checkpointing on;
    fused_trl_packed        the same with packed=True, shared_prefix=True: the drop-in's padding-free loss forward
                            from TRL's padded inputs (each prompt stored once);
    gk_none / gk_blocks     grpo_kernels' grpo_step (packed, shared prompt, fused LM-head loss) without / with
                            model.activation_checkpointing = "blocks";
    gk_selective            model.activation_checkpointing = "selective": the matmuls' and attention's outputs kept,
                            the ops between them recomputed;
    gk_tiled                gk_blocks with the sequence-tiled MLP (model.mlp_tile_tokens = MLP_TILE, 512): one
                            block's MLP intermediates exist for a tile of the row, not the whole row;
    gk_sp                   gk_blocks on N ranks (torchrun, gloo) with distributed.sequence_parallel = N, the
                            smallest N >= 2 that divides the model's query heads (Ulysses splits heads): 2 for the
                            tiny model, 3 for SmolLM2-135M (9 heads, 3 KV heads); FSDP2 over the N ranks too, so the
                            static memory per rank drops as well; per-rank peak, each rank capped at
                            min(--cap-gb, --machine-gb / N).
Loss "dapo", beta 0, on-policy, fp32, 2 CPU threads per process (1 per rank for gk_sp).

Per row: sp (ranks), peak_rss_mb (VmHWM of the process, the largest rank's for gk_sp), base_rss_mb (RSS before the
step: model, optimizer state and inputs), step_s, tokens_per_s (real tokens / step_s), padding_fraction (pad tokens
/ tokens the model computed), mmap_threshold (the allocator setting, below), load_before (the 1-minute load average
when it started: CPU step times are only comparable on an idle machine), status ("ok", "over_cap": the process
passed --cap-gb and was stopped, "failed: ..."). A process watches its own RSS every 20 ms and exits when it passes
the cap, so a provider that cannot fit is recorded, not fatal. Rows are appended to
benchmarks/results/long_chains/long_chains_<model>.csv as they finish; a rerun skips the rows that are there
(resumable). At the end (and with --plot-only) it writes the plot (peak memory vs tokens per step, one line per
provider) and memory_model.md: bytes per token per provider fitted on the measured rows, extrapolated to Qwen2.5-7B
in bf16 on 80 GB H100s. That extrapolation is a model, not a measurement.

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
import csv
import json
import math
import os
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable from a plain checkout too

OUT = Path(__file__).resolve().parent / "results" / "long_chains"
COLUMNS = ["timestamp", "device", "torch", "git_sha", "model", "sweep", "provider", "group_size", "prompts",
           "min_len", "max_len", "real_tokens", "computed_tokens", "padding_fraction", "step_s", "tokens_per_s",
           "sp", "base_rss_mb", "peak_rss_mb", "cap_mb", "mmap_threshold", "load_before", "status"]  # fmt: skip
PROVIDERS = ("trl_ckpt", "trl_nockpt", "fused_trl", "fused_trl_packed", "gk_none", "gk_blocks", "gk_selective",
             "gk_tiled", "gk_sp")
MLP_TILE = 512  # gk_tiled's model.mlp_tile_tokens
PROMPT = ("Solve the problem and show every step of your working, one intermediate result per line, then give the "
          "final answer as 'Answer: <number>'. A train travels 284 km at 71 km/h, stops for 25 minutes, then travels "
          "156 km at 78 km/h. What was its average speed over the whole journey, the stop included?")  # fmt: skip
EXIT_OVER_CAP = 86


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


def longest_point(n: int) -> dict:
    """The "longest" sweep's point: two completions of n tokens (a GRPO group needs two), trained one per
    micro-batch, so the peak is that of one chain of n tokens."""
    return dict(sweep="longest", group_size=2, prompts=1, min_len=n, max_len=n)


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


def lengths_of(point: dict, seed: int = 0) -> list[int]:
    """Completion lengths of a point: log-uniform in [min_len, max_len], seeded; the longest drawn is max_len."""
    n = point["group_size"] * point["prompts"]
    if point["min_len"] == point["max_len"]:
        return [point["max_len"]] * n
    rng = random.Random(seed * 7919 + n)
    out = [round(math.exp(rng.uniform(math.log(point["min_len"]), math.log(point["max_len"])))) for _ in range(n)]
    out[0] = point["max_len"]
    return out


# ------------------------------------------------------------------------------------------------------------------
# The worker: one provider, one point, in this process (or one rank of torchrun for gk_sp).


def _rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _watch(cap_mb: float) -> None:
    """Exit this process (code EXIT_OVER_CAP) as soon as its RSS passes cap_mb."""

    def loop():
        while True:
            if _rss_mb() > cap_mb:
                os._exit(EXIT_OVER_CAP)
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()


def prompt_ids(model_dir: str) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, the tokenizer's special ids): PROMPT through the chat template when the tokenizer has
    one; a model without one (the tiny character model) gets a prompt of its own characters of about that length."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    special = sorted(set(tokenizer.all_special_ids))
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in recent transformers
        return [int(i) for i in ids], special
    return tokenizer("12+34=46" * 12)["input_ids"], special


def _inputs(spec: dict, vocab: int, seed: int = 0):
    """(prompt ids, completions, rewards): the prompt and synthetic completions without special ids."""
    import torch

    point, prompt, special = spec["point"], spec["prompt_ids"], spec["special_ids"]
    g = torch.Generator().manual_seed(seed)
    fill = next(i for i in range(vocab) if i not in set(special))
    completions = []
    for n in lengths_of(point, seed):
        ids = torch.randint(0, vocab, (n,), generator=g)
        for s in special:
            ids[ids == s] = fill
        completions.append(ids)
    group = point["group_size"]
    rewards = [float(i % 2) for i in range(group * point["prompts"])]  # every group mixed: every sample has a gradient
    return torch.tensor(prompt, dtype=torch.long), completions, rewards


def _trl_step(spec: dict, model_dir: str) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset

    from grpo_kernels.integrations import FusedGRPOTrainer

    provider, point = spec["provider"], spec["point"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    b = point["group_size"] * point["prompts"]
    args = trl.GRPOConfig(output_dir=spec["scratch"], per_device_train_batch_size=b,
                          num_generations=point["group_size"], max_completion_length=point["max_len"], beta=0.0,
                          loss_type="dapo", report_to="none", use_cpu=True, save_strategy="no", bf16=False,
                          gradient_checkpointing=provider != "trl_nockpt")  # fmt: skip
    cls, packing = trl.GRPOTrainer, {}
    if provider.startswith("fused_trl"):
        cls = FusedGRPOTrainer
        packing = dict(packed=True, shared_prefix=True) if provider == "fused_trl_packed" else {}
    trainer = cls(model=model_dir, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["x"]}), processing_class=tokenizer,
                  **packing)  # fmt: skip
    model = trainer.model
    if args.gradient_checkpointing:  # what Trainer.train() does first; compute_loss alone would run without it
        kwargs = dict(args.gradient_checkpointing_kwargs or {})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    if model.is_gradient_checkpointing != args.gradient_checkpointing:
        raise RuntimeError(f"{provider}: gradient checkpointing is {model.is_gradient_checkpointing}, "
                           f"asked {args.gradient_checkpointing}")  # fmt: skip
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompt, completions, rewards = _inputs(spec, model.config.vocab_size)
    longest = max(c.numel() for c in completions)
    completion_ids = torch.full((b, longest), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(b, longest, dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : c.numel()], mask[i, : c.numel()] = c, 1
    r = torch.tensor(rewards).view(-1, point["group_size"])
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    inputs = {"prompt_ids": prompt.expand(b, -1).clone(),
              "prompt_mask": torch.ones(b, prompt.numel(), dtype=torch.long), "completion_ids": completion_ids,
              "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum()}  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        if point["sweep"] == "longest" and batch["completion_ids"].shape[0] == b:  # one completion per micro-batch
            total = 0.0
            for i in range(b):
                one = trainer.compute_loss(model, {k: v[i : i + 1] if k != "num_items_in_batch" else v
                                                   for k, v in batch.items()})  # fmt: skip
                one.backward()
                total += float(one)
            optimizer.step()
            return torch.tensor(total)
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    step({k: v[:2, :8] if k.startswith("completion") else v[:2] for k, v in inputs.items() if k != "num_items_in_batch"}
         | {"num_items_in_batch": mask[:2, :8].sum()})  # warm-up: first calls, Adam's state  # fmt: skip
    base = _rss_mb()
    start = time.perf_counter()
    loss = step(inputs)
    elapsed = time.perf_counter() - start
    real = b * prompt.numel() + sum(c.numel() for c in completions)
    computed = b * (prompt.numel() + longest)  # the padded batch
    if packing:  # one packed row: each prompt once, the completions without pads
        computed = point["prompts"] * prompt.numel() + sum(c.numel() for c in completions)
    return dict(step_s=elapsed, real_tokens=real, computed_tokens=computed, pad_tokens=max(computed - real, 0),
                base_rss_mb=base, loss=float(loss))  # fmt: skip


def _gk_step(spec: dict, model_dir: str) -> dict:
    import torch

    from grpo_kernels.train.fsdp import checkpoint_blocks, init_distributed, shard
    from grpo_kernels.train.hf_model import load_policy
    from grpo_kernels.train.rollout import Rollout
    from grpo_kernels.train.step import Policy, grpo_step
    from grpo_kernels.train.tiled_mlp import tile_mlps

    provider, point = spec["provider"], spec["point"]
    sp = spec["sp"]
    d = init_distributed("gloo", sequence_parallel=sp) if sp > 1 else None
    model, _ = load_policy(model_dir, dtype="float32")
    if provider != "gk_none":
        checkpoint_blocks(model.base_model.layers, "selective" if provider == "gk_selective" else "blocks")
    if provider == "gk_tiled":
        tile_mlps(model.base_model.layers, MLP_TILE)
    policy = Policy(model)
    if d is not None:
        shard(policy, model.base_model.layers, device=d.device, world=d.world, dtype=torch.float32)
    prompt, completions, rewards = _inputs(spec, model.config.vocab_size)
    n = len(completions)
    rollout = Rollout(prompt_ids=[prompt] * n, completion_ids=completions,
                      sampler_logps=[torch.zeros(c.numel()) for c in completions],
                      group_size=point["group_size"]).with_rewards(rewards)  # fmt: skip
    real = n * prompt.numel() + sum(c.numel() for c in completions)  # what a padded batch holds without its pads
    packed = point["prompts"] * prompt.numel() + sum(c.numel() for c in completions)  # the shared prompt once
    budget = -(-packed // sp)  # one micro-batch holds the whole step, as in the TRL providers
    if point["sweep"] == "longest":  # one completion (and its prompt) per micro-batch
        budget = -(-(prompt.numel() + point["max_len"]) // sp)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    kw = {} if d is None else {"dist": d}

    def step(batch, token_budget):
        return grpo_step(policy, optimizer, batch, loss_options={"loss_type": "dapo"}, temperature=1.0,
                         token_budget=token_budget, shared_prefix=True, **kw)  # fmt: skip

    warm = Rollout(prompt_ids=[prompt] * 2, completion_ids=[c[:8] for c in completions[:2]],
                   sampler_logps=[torch.zeros(8)] * 2, group_size=2).with_rewards([0.0, 1.0])  # fmt: skip
    step(warm, prompt.numel() + 16)  # warm-up: first calls, Adam's state
    base = _rss_mb()
    start = time.perf_counter()
    metrics = step(rollout, budget)
    elapsed = time.perf_counter() - start
    pad = budget * sp - packed
    return dict(step_s=elapsed, real_tokens=real, computed_tokens=packed + pad, pad_tokens=pad, base_rss_mb=base,
                loss=metrics["loss"], rank=0 if d is None else d.rank)  # fmt: skip


def worker(spec: dict) -> None:
    """Run one measurement in this process; prints one JSON line (per rank under torchrun)."""
    import torch

    torch.set_num_threads(spec["threads"])
    _watch(spec["cap_mb"])
    model_dir = spec["model_dir"]
    result = (_trl_step if spec["provider"].startswith(("trl", "fused")) else _gk_step)(spec, model_dir)
    result["peak_rss_mb"] = _rss_mb("VmHWM")
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.flush()
    # one write(2) of a line under PIPE_BUF: the ranks of gk_sp share the pipe, and print's separate writes of the
    # text and its newline can interleave with another rank's
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


# ------------------------------------------------------------------------------------------------------------------
# The driver.


def sp_size(model_dir: str) -> int:
    """The smallest N >= 2 dividing the model's query heads: the sequence-parallel size gk_sp runs."""
    import transformers

    heads = transformers.AutoConfig.from_pretrained(model_dir).num_attention_heads
    return next(n for n in range(2, heads + 1) if heads % n == 0)


def measure(provider: str, point: dict, *, model_dir: str, cap_mb: float, scratch: str, timeout: float,
            mmap_threshold: int = 0) -> dict:  # fmt: skip
    """Run one (provider, point) in a fresh process (N for gk_sp); the row's measured fields and status.
    mmap_threshold > 0: glibc's MALLOC_MMAP_THRESHOLD_ for the worker (blocks from that size on are mapped and
    returned to the system when freed); 0: glibc's default (a threshold that rises to 32 MiB as blocks are freed)."""
    sp = sp_size(model_dir) if provider == "gk_sp" else 1
    prompt, special = prompt_ids(model_dir)
    spec = dict(provider=provider, point=point, model_dir=model_dir, cap_mb=cap_mb, scratch=scratch, sp=sp,
                threads=1 if sp > 1 else 2, prompt_ids=prompt, special_ids=special)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    script = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    if sp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--standalone", *script]
    else:
        cmd = [sys.executable, *script]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over the {timeout:.0f} s timeout"}
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and len(results) == sp:
        out = dict(results[0], sp=sp)
        out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
        out["base_rss_mb"] = max(r["base_rss_mb"] for r in results)
        out["status"] = "ok"
        return out
    if f"exitcode  : {EXIT_OVER_CAP}" in proc.stderr or proc.returncode == EXIT_OVER_CAP:
        return {"status": "over_cap"}
    if proc.returncode == 0:  # every process ended well, but not every rank's result line arrived
        return {"status": f"failed: {len(results)} of {sp} result lines"}
    return {"status": f"failed: {failure_reason(proc.returncode, proc.stderr)}"}


def failure_reason(returncode: int, stderr: str) -> str:
    """One line on why a measurement process failed: the exception a rank raised (not torchrun's own
    ChildFailedError, which only says that a rank failed) and, under torchrun, the root cause's exit code or signal."""
    lines = [x.strip() for x in stderr.strip().splitlines()] or ["no output"]
    errors = [x for x in lines if ("Error" in x or "error:" in x or "Exception" in x) and "ChildFailedError" not in x
              and not x.startswith(("File ", "raise ", "Traceback"))]  # fmt: skip
    cause = next((x.split(":", 1)[1].split("(pid")[0].strip() for x in lines if x.startswith("exitcode  :")), None)
    signal = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("traceback :") and "Signal" in x), None)
    text = [x for x in lines if x.strip("=-") and not x.startswith(("File ", "raise ", "^"))]
    parts = [errors[-1][:160]] if errors else [] if cause is not None else [(text or ["no output"])[-1][:160]]
    if cause is not None:
        parts.append(f"a rank's exit code {cause}" + (f" ({signal.split(' received')[0]})" if signal else ""))
    elif returncode < 0:
        parts.append(f"killed by signal {-returncode}")
    else:
        parts.append(f"exit code {returncode}")
    return "; ".join(parts)


def _csv_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _key(row) -> tuple:
    return (row["provider"], row["sweep"], str(row["group_size"]), str(row["prompts"]), str(row["min_len"]),
            str(row["max_len"]))  # fmt: skip


def run(args) -> Path:
    from benchmarks.common import run_meta

    quick = args.quick
    if quick:
        import tempfile

        from grpo_kernels.train.hf_model import write_tiny_checkpoint

        scratch = tempfile.mkdtemp(prefix="long-chains-")
        model_dir, model_name = str(write_tiny_checkpoint(Path(scratch) / "model")), "tiny"
    else:
        from grpo_kernels.train.models import resolve_model

        scratch = str(OUT / "scratch")
        model_dir, model_name = str(resolve_model(args.model) or args.model), Path(args.model).name
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
            row["load_before"] = round(os.getloadavg()[0], 2)  # other work on the cores skews step_s
            row.update(measure(provider, point, model_dir=model_dir, cap_mb=cap_mb, scratch=scratch,
                               timeout=args.timeout, mmap_threshold=args.mmap_threshold))  # fmt: skip
            print(f"            -> {row['status']}" + (f", {row['peak_rss_mb']:.0f} MB peak, {row['step_s']:.1f} s"
                                                        if row["status"] == "ok" else ""), flush=True)  # fmt: skip
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
        start, limit = (16, 16) if quick else (2000, args.longest_limit)
        for provider in providers:
            ok = lambda n, provider=provider: measure_row(provider, longest_point(n))["status"] == "ok"  # noqa: E731
            n, capped = longest_search(ok, start, limit)
            print(f"{provider:11s} longest single chain: {n} tokens" + (f" (the --longest-limit {limit})"
                                                                         if capped else ""), flush=True)  # fmt: skip
    if quick:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    report(csv_path)
    return csv_path


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


# ------------------------------------------------------------------------------------------------------------------
# Report: table, plot, memory model.

# Qwen2.5-7B (config.json): 28 layers, hidden 3584, MLP 18944, 28 query / 4 KV heads of 128, vocab 152064.
QWEN7B = dict(layers=28, hidden=3584, intermediate=18944, params=7.62e9)
# Llama-3.1-8B (config.json): 32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, vocab 128256.
LLAMA8B = dict(layers=32, hidden=4096, intermediate=14336, params=8.03e9)
# ALST (Arctic Long Sequence Training, Snowflake, 2025), Llama-8B on H100s: the longest sequence it trains.
ALST_TOKENS = {1: "500k (1 GPU)", 8: "3.7M (8 GPUs)"}
H100_GB = 80.0


def fit(rows: list[dict], min_tokens: int = 0) -> dict:
    """{provider: (bytes per token, static MB)}: least squares of peak RSS on tokens computed, over the provider's
    ok rows of the length and step sweeps (and spread) of at least min_tokens tokens."""
    out = {}
    for provider in PROVIDERS:
        pts = [(float(r["computed_tokens"]), float(r["peak_rss_mb"])) for r in rows
               if r["provider"] == provider and r["status"] == "ok" and float(r["computed_tokens"]) >= min_tokens
               and r["sweep"] != "longest"]  # a longest-chain row's peak is one micro-batch's, not the step's
        if len({x for x, _ in pts}) < 2:
            continue
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[provider] = (slope * 2**20, my - slope * mx)
    return out


def memory_model(rows: list[dict], config: dict) -> str:
    """Markdown: the fitted bytes/token and the extrapolation to Qwen2.5-7B bf16 on 80 GB GPUs (a model)."""
    fits = fit(rows)
    if not fits:
        return "\n".join(["No provider has two measured points: no memory model.", "", *longest_table(rows)])
    layers, hidden, inter = config["layers"], config["hidden"], config["intermediate"]
    scale = (QWEN7B["layers"] * (QWEN7B["hidden"] + QWEN7B["intermediate"])) / (layers * (hidden + inter)) * 0.5
    # Static memory per GPU under FSDP2 over 8 GPUs: bf16 params + fp32 master weights, fp32 gradients and two Adam
    # moments = 18 bytes per parameter, sharded 8 ways; plus one unsharded bf16 block in flight (small).
    static_gb = QWEN7B["params"] * 18 / 8 / 2**30
    lines = [
        "# Memory model (fitted on the measured rows; the 7B columns are an extrapolation, not a measurement)",
        "",
        f"Measured model: {layers} layers, hidden {hidden}, MLP {inter}, fp32. Per provider, peak RSS = static + "
        "bytes/token x tokens computed per step (least squares over its measured rows).",
        f"Extrapolation to Qwen2.5-7B in bf16: bytes/token scaled by layers x (hidden + MLP) "
        f"({QWEN7B['layers']} x ({QWEN7B['hidden']} + {QWEN7B['intermediate']}) / ({layers} x ({hidden} + {inter}))) "
        f"and by 0.5 for bf16 = x{scale:.1f}; static {static_gb:.1f} GB per GPU (FSDP2 over 8 GPUs: 18 bytes per "
        f"parameter: bf16 weights, fp32 master, gradients and two Adam moments); {H100_GB:.0f} GB per GPU. "
        "With SP = N, a GPU holds 1/N of the tokens' activations. Longest chain = the tokens per GPU that fit, for one "
        "completion per micro-batch.",
        "",
        "| provider | bytes/token (measured) | static MB (measured) | 7B bytes/token (model) | longest chain per "
        "GPU, SP=1 (model) | SP=2 | SP=4 | SP=8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    free = (H100_GB - static_gb) * 2**30
    for provider, (per_token, static) in fits.items():
        b7 = per_token * scale
        chains = [f"{free * n / b7 / 1e3:.0f}k" if b7 > 0 else "-" for n in (1, 2, 4, 8)]
        if not provider.startswith("gk_") or provider == "gk_sp":  # SP is the trainer's; gk_sp is measured per rank
            chains[1:] = ["-"] * 3
        lines.append(f"| {provider} | {per_token / 1e3:.1f} kB | {static:.0f} | {b7 / 1e6:.2f} MB | "
                     + " | ".join(chains) + " |")  # fmt: skip
    lines += ["", "gk_sp's slope is a rank's peak over the whole row's tokens (each rank computes 1/N): it checks "
              "the "
              "SP columns of gk_blocks (about 1/N of gk_blocks' slope expected). Attention's own working memory (SDPA "
              "per sequence) is in the measured slopes (the allocator's retained heap is not, with the mmap threshold "
              "the rows record); GPU attention kernels need "
              "less than the CPU path measured here. The static term on CPU includes the Python process, torch and "
              "the model's fp32 weights, gradients and Adam moments.", ""]
    return "\n".join(lines + component_model(rows, config) + longest_table(rows))


def longest_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per provider, the longest single chain measured to fit and the shortest that did not."""
    out = []
    for provider in PROVIDERS:
        mine = [r for r in rows if r["provider"] == provider and r["sweep"] == "longest"]
        if not mine:
            continue
        fit = [int(r["max_len"]) for r in mine if r["status"] == "ok"]
        over = [int(r["max_len"]) for r in mine if r["status"] != "ok"]
        peak = next((r["peak_rss_mb"] for r in mine if fit and int(r["max_len"]) == max(fit)), "")
        out.append(f"| {provider} | {max(fit) if fit else 0} | {peak} | {min(over) if over else '-'} |")
    if not out:
        return []
    return ["## The longest single chain (measured: one completion per micro-batch, under the cap)", "",
            "| provider | longest that fits (tokens) | its peak MB | shortest that did not |", "|---|---:|---:|---:|",
            *out, ""]  # fmt: skip


COMPONENT_MIN_TOKENS = 8000  # below, a step's peak is set by other phases (the flat start of every provider's line)


def component_model(rows: list[dict], config: dict) -> list[str]:
    """Markdown lines: a model of the longest chain per 80 GB GPU for Qwen2.5-7B and Llama-8B in bf16 with block
    checkpointing, the tiled MLP and offloaded checkpoints, from components fitted on the measured model (its rows
    of at least COMPONENT_MIN_TOKENS tokens)."""
    fits = fit(rows, COMPONENT_MIN_TOKENS)
    if "gk_blocks" not in fits or "gk_tiled" not in fits:
        return ["No gk_blocks and gk_tiled fits: no component model.", ""]
    layers, hidden, inter = config["layers"], config["hidden"], config["intermediate"]
    floor = layers * hidden * 4  # fp32 bytes per token of the checkpointed block inputs
    mlp = (fits["gk_blocks"][0] - fits["gk_tiled"][0]) / (inter * 4)  # per token, in intermediate-size floats
    rest = (fits["gk_tiled"][0] - floor) / (hidden * 4)  # the rest of one block's working set, in hidden-size floats
    lines = ["## Components and the longest chain with the tiled MLP and offloaded checkpoints (a model)", "",
             f"Fitted on the rows of at least {COMPONENT_MIN_TOKENS} tokens (gk_blocks "
             f"{fits['gk_blocks'][0] / 1e3:.1f} kB, gk_tiled {fits['gk_tiled'][0] / 1e3:.1f} kB per token): the "
             f"checkpointed block inputs are {floor / 1e3:.1f} kB per token ({layers} x "
             f"{hidden} fp32: the floor); the tiled MLP removes {mlp:.2f} x intermediate size floats per token "
             f"(gk_blocks - gk_tiled); the rest of one block's working set is {rest:.2f} x hidden size floats per "
             "token (gk_tiled - floor). Scaled to a model in bf16 (2 bytes), per token and GPU: floor (layers x hidden "
             "x 2; 0 with offload: the block inputs are in host memory, which must hold them) + rest x hidden x 2 + "
             "(mlp x intermediate x 2 unless tiled); with SP = N a GPU holds 1/N of the tokens. 8 GPUs, FSDP2 over "
             "all 8 (18 bytes per parameter / 8 static), 80 GB each; the fused head keeps no logits. Not modelled: "
             "attention kernels' own buffers, the all-to-all buffers of SP, fragmentation. One GPU does not fit the "
             "optimizer state of these models (18 bytes x 8B parameters = 144 GB): this trainer keeps it on the "
             "device, so ALST's one-GPU row has no counterpart here.", "",
             "Offload moves the floor to the host: with every GPU full, a node of 8 holds 8 x (SP=1 chain) tokens "
             "whatever N, so its host memory must hold that many tokens' block inputs (the host memory column): at "
             "these lengths the host memory of a node (commonly 1-2 TB) binds before the GPUs do.", "",
             "| model | mode | bytes/token (model) | SP=1 | SP=2 | SP=4 | SP=8 | host memory per node "
             "| ALST, published |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, m in (("Qwen2.5-7B", QWEN7B), ("Llama-8B", LLAMA8B)):
        free = (H100_GB - m["params"] * 18 / 8 / 2**30) * 2**30
        for mode, offload, tiled in (("blocks", False, False), ("blocks + tiled MLP", False, True),
                                     ("offload + tiled MLP", True, True)):  # fmt: skip
            per_token = (0 if offload else m["layers"] * m["hidden"] * 2) + rest * m["hidden"] * 2
            per_token += 0 if tiled else mlp * m["intermediate"] * 2
            chains = [_tokens(free * n / per_token) for n in (1, 2, 4, 8)]
            alst = ALST_TOKENS[8] if name == "Llama-8B" and offload else ""
            host = f"{8 * free / per_token * m['layers'] * m['hidden'] * 2 / 1e12:.1f} TB" if offload else "-"
            lines.append(f"| {name} | {mode} | {per_token / 1e3:.0f} kB | " + " | ".join(chains)
                         + f" | {host} | {alst} |")  # fmt: skip
    return lines + [""]


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def report(csv_path: Path) -> None:
    rows = _csv_rows(csv_path)
    if not rows:
        print(f"no rows in {csv_path}")
        return
    print("\n| sweep | G | lengths | provider | status | peak MB | step s | tokens/s | padding |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sweep']} | {r['group_size']} | {r['min_len']}-{r['max_len']} | {r['provider']} | {r['status']} | "
              f"{r['peak_rss_mb']} | {r['step_s']} | {r['tokens_per_s']} | {r['padding_fraction']} |")  # fmt: skip
    config = _model_config(rows[-1]["model"])
    if config is not None:
        (csv_path.parent / "memory_model.md").write_text(memory_model(rows, config))
    _plot(rows, csv_path.with_suffix(".png"))


def _model_config(name: str) -> dict | None:
    if name == "tiny":
        return dict(layers=2, hidden=128, intermediate=256)
    if name == "smollm2-135m":
        return dict(layers=30, hidden=576, intermediate=1536)
    return None


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for provider in PROVIDERS:
        pts = sorted((int(r["computed_tokens"]), float(r["peak_rss_mb"]) / 1024) for r in rows
                     if r["provider"] == provider and r["status"] == "ok" and r["sweep"] != "longest")  # fmt: skip
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=provider)
    cap = max(float(r["cap_mb"]) for r in rows) / 1024
    ax.axhline(cap, color="gray", linestyle="--", linewidth=1, label=f"cap {cap:.0f} GB")
    ax.set_xscale("log")
    ax.set_xlabel("tokens computed per step (padding included)")
    ax.set_ylabel("peak RSS per process (GB)")
    ax.set_title(f"One GRPO step, {rows[-1]['model']}, fp32, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


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
    parser.add_argument("--longest-limit", type=int, default=131072, help="the longest sweep stops doubling here")
    parser.add_argument("--max-len", type=int, default=0,
                        help="run only the points whose completions are at most this long (0: all)")
    parser.add_argument("--group-size", type=int, default=0, help="run only the points with this G (0: all)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    parser.add_argument("--mmap-threshold", type=int, default=2**20,
                        help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) for every worker, so that peak RSS follows the "
                             "live tensors; 0 = glibc's default, whose retained heap is part of the peak")  # fmt: skip
    parser.add_argument("--csv", type=Path, help="rows go here instead of benchmarks/results/long_chains/")
    parser.add_argument("--plot-only", action="store_true", help="rebuild the report from the CSV")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one measurement (JSON spec)
    args = parser.parse_args()
    unknown = set(args.providers.split(",")) - set(PROVIDERS) | set(args.sweeps.split(",")) - {"length", "spread",
                                                                                                  "step", "longest"}
    if args.longest_limit < 16:
        parser.error(f"--longest-limit must be >= 16, got {args.longest_limit}")
    if args.max_len < 0 or args.group_size < 0:
        parser.error(f"--max-len and --group-size must be >= 0, got {args.max_len} and {args.group_size}")
    if unknown:
        parser.error(f"unknown provider or sweep: {', '.join(sorted(unknown))}")
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.plot_only:
        report(args.csv or OUT / f"long_chains_{Path(args.model).name}.csv")
        return
    run(args)


if __name__ == "__main__":
    main()
