"""One measurement of benchmarks/long_chains/sweep.py (its docstring says what is measured): one provider, one point,
in this process, or one rank of torchrun for gk_sp. The driver runs it as `worker.py SPEC` (SPEC: the JSON of
long_chains.measure) in a fresh process under the memory cap; it prints one line "RESULT <json>" per process, then
ends without the interpreter's teardown (end_process), or exits with EXIT_OVER_CAP as soon as its RSS passes the cap.
Its phases, and who sent it a SIGTERM, go to stderr (diagnose.py)."""

import json
import math
import os
import random
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

from benchmarks.long_chains import diagnose  # noqa: E402  stdlib only: what a failed run prints

MLP_TILE = 512  # gk_tiled's model.mlp_tile_tokens
AUTO_SHARE = 0.9  # gk_auto's activation budget: this share of the room between the cap and the process's RSS
PROMPT = ("Solve the problem and show every step of your working, one intermediate result per line, then give the "
          "final answer as 'Answer: <number>'. A train travels 284 km at 71 km/h, stops for 25 minutes, then travels "
          "156 km at 78 km/h. What was its average speed over the whole journey, the stop included?")  # fmt: skip
EXIT_OVER_CAP = 86


def lengths_of(point: dict, seed: int = 0) -> list[int]:
    """Completion lengths of a point: log-uniform in [min_len, max_len], seeded; the longest drawn is max_len (the
    "longest" sweep: max_len, then min_len)."""
    n = point["group_size"] * point["prompts"]
    if point["sweep"] == "longest":
        return [point["max_len"], point["min_len"]]
    if point["min_len"] == point["max_len"]:
        return [point["max_len"]] * n
    rng = random.Random(seed * 7919 + n)
    out = [round(math.exp(rng.uniform(math.log(point["min_len"]), math.log(point["max_len"])))) for _ in range(n)]
    out[0] = point["max_len"]
    return out


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


def settled_load(limit: float = 1.0, wait_s: float = 180.0) -> float:
    """The 1-minute load average once it is below limit (waiting up to wait_s): right after the previous
    measurement it still counts that process for a minute, which is not other work."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _label_blocks(blocks, spec: dict) -> None:
    """Profiling (spec "profile"): long_chains_profiling.label_blocks."""
    if spec.get("profile"):
        from benchmarks.long_chains.profiler_hooks import label_blocks

        label_blocks(blocks)


def _timed(step, spec: dict):
    """(step's result, seconds): step() timed; with spec "profile" (a path) under torch's profiler, its summary
    written there (long_chains_profiling.profiled)."""
    if spec.get("profile"):
        from benchmarks.long_chains.profiler_hooks import profiled

        return profiled(step, spec["profile"])
    start = time.perf_counter()
    out = step()
    return out, time.perf_counter() - start


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
    for n in spec.get("lengths") or lengths_of(point, seed):
        ids = torch.randint(0, vocab, (n,), generator=g)
        for s in special:
            ids[ids == s] = fill
        completions.append(ids)
    group = point["group_size"]
    rewards = [float(i % 2) for i in range(group * point["prompts"])]  # every group mixed: every sample has a gradient
    return torch.tensor(prompt, dtype=torch.long), completions, rewards


ROWFOLD_ROWS = 128  # trl_rowfold: rows of a head tile folded at a time


def trl_rowfold() -> None:
    """Make TRL's chunked LM head fold its CPU tiles ROWFOLD_ROWS rows at a time (provider trl_rowfold).

    TRL's `ChunkedLogProbFunction` projects 4,096 tokens x 32,768 vocabulary entries per tile and folds each tile into
    per-token statistics: on a GPU with a Triton kernel (one program per token, no tile-sized temporaries), elsewhere
    with torch ops on the whole tile (`_forward_tile`, `_backward_tile`), which hold several tile-sized fp32
    temporaries at once (about 0.5 GB each at 4,096 tokens). Every op of those folds is per row, so folding a slice of
    rows at a time gives the same values while its temporaries shrink to the slice: what is left is the memory TRL
    needs where its kernels run. The call sites look the folds up by name at each call, so the module's are replaced."""
    from trl.kernels import chunked_logprob as head

    def sliced(fold, per_row: int):  # per_row: how many arguments after (tile, stride) have one entry per row
        def by_rows(tile, stride, *args, **kwargs):
            for i in range(0, tile.shape[0], ROWFOLD_ROWS):
                rows = slice(i, i + ROWFOLD_ROWS)
                fold(tile[rows], stride, *(a[rows] if k < per_row else a for k, a in enumerate(args)), **kwargs)

        by_rows.rowfold = True
        return by_rows

    if not getattr(head._forward_tile, "rowfold", False):
        # forward: targets, running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target, target_logit;
        # backward: targets, log_z, entropy, grad_logprobs, grad_entropy. A TRL whose folds take other arguments
        # would be sliced wrongly: refused rather than measured.
        import inspect

        known = {"_forward_tile": ["tile", "tile_stride", "targets", "running_max", "sum_exp", "x_sum_exp",
                                   "sq_sum_exp", "z_sum", "max_before_target", "target_logit", "vocab_start"],
                 "_backward_tile": ["tile", "tile_stride", "targets", "log_z", "entropy", "grad_logprobs",
                                    "grad_entropy", "vocab_start"]}  # fmt: skip
        for name, params in known.items():
            found = list(inspect.signature(getattr(head, name)).parameters)[: len(params)]
            if found != params:
                raise RuntimeError(f"trl_rowfold: trl.kernels.chunked_logprob.{name} takes {found}, not {params} "
                                   "(written against TRL 1.16)")  # fmt: skip
        head._forward_tile = sliced(head._forward_tile, 8)
        head._backward_tile = sliced(head._backward_tile, 5)


def _trl_step(spec: dict, model_dir: str) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset

    from grpo_kernels.integrations import FusedGRPOTrainer

    provider, point = spec["provider"], spec["point"]
    if provider == "trl_rowfold":
        trl_rowfold()
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
    _label_blocks(model.model.layers, spec)
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

    # rows per micro-batch: spec "micro_rows" (long_chains_best), one for the longest sweep, else the whole step. As
    # in TRL, a micro-batch is a slice of the step's padded batch (padded to the step's longest completion) and each
    # micro-batch's loss is normalized by the whole step's tokens (num_items_in_batch), so their gradients add up.
    micro = spec.get("micro_rows") or (1 if point["sweep"] == "longest" else b)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        if batch["completion_ids"].shape[0] == b and micro < b:
            total = 0.0
            for i in range(0, b, micro):
                part = trainer.compute_loss(model, {k: v[i : i + micro] if k != "num_items_in_batch" else v
                                                    for k, v in batch.items()})  # fmt: skip
                part.backward()
                total += float(part)
            optimizer.step()
            return torch.tensor(total)
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    diagnose.phase("warm-up")
    step({k: v[:2, :8] if k.startswith("completion") else v[:2] for k, v in inputs.items() if k != "num_items_in_batch"}
         | {"num_items_in_batch": mask[:2, :8].sum()})  # warm-up: first calls, Adam's state  # fmt: skip
    base = _rss_mb()
    diagnose.phase("step")
    loss, elapsed = _timed(lambda: step(inputs), spec)
    real = b * prompt.numel() + sum(c.numel() for c in completions)
    computed = b * (prompt.numel() + longest)  # the padded batch
    if packing:  # one packed row: each prompt once, the completions without pads
        computed = point["prompts"] * prompt.numel() + sum(c.numel() for c in completions)
    return dict(step_s=elapsed, real_tokens=real, computed_tokens=computed, pad_tokens=max(computed - real, 0),
                base_rss_mb=base, loss=float(loss), micro_batches=-(-b // micro))  # fmt: skip


def _gk_step(spec: dict, model_dir: str) -> dict:
    import torch

    from grpo_kernels.train.model import activation
    from grpo_kernels.train.model.fsdp import init_distributed, shard
    from grpo_kernels.train.model.hf import load_policy
    from grpo_kernels.train.model.policy import Policy
    from grpo_kernels.train.rollout.batch import Rollout
    from grpo_kernels.train.step import grpo_step

    provider, point = spec["provider"], spec["point"]
    sp = spec["sp"]
    d = init_distributed("gloo", sequence_parallel=sp) if sp > 1 else None
    diagnose.phase("loading the model")
    model, _ = load_policy(model_dir, dtype="float32")
    _label_blocks(model.base_model.layers, spec)
    if provider not in ("gk_none", "gk_auto"):  # the trainer's activation.apply (tokens etc. matter for "auto" only)
        mode = "selective" if provider == "gk_selective" else "blocks"
        activation.apply(model, mode=mode, tokens=0, completion_tokens=0, dtype_bytes=4,
                         mlp_tile_tokens=MLP_TILE if provider == "gk_tiled" else 0)  # fmt: skip
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
    budget = spec.get("token_budget") or budget  # long_chains_best: each rank's budget, chosen by its search
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    kw = {} if d is None else {"dist": d}

    def step(batch, token_budget):
        return grpo_step(policy, optimizer, batch, loss_options={"loss_type": "dapo"}, temperature=1.0,
                         token_budget=token_budget, shared_prefix=True, **kw)  # fmt: skip

    warm = Rollout(prompt_ids=[prompt] * 2, completion_ids=[c[:8] for c in completions[:2]],
                   sampler_logps=[torch.zeros(8)] * 2, group_size=2).with_rewards([0.0, 1.0])  # fmt: skip
    diagnose.phase("warm-up")
    step(warm, prompt.numel() + 16)  # warm-up: first calls, Adam's state
    base = _rss_mb()
    diagnose.phase("step")
    chose = ""
    if provider == "gk_auto":  # the trainer's "auto", its budget the cap's room above this process
        longest = max(c.numel() for c in completions)
        chose = activation.apply(model, mode="auto", tokens=budget, completion_tokens=longest, dtype_bytes=4,
                                 budget_gb=AUTO_SHARE * (spec["cap_mb"] - base) / 1024)[2]  # fmt: skip
    metrics, elapsed = _timed(lambda: step(rollout, budget), spec)
    if d is not None:  # every rank past its last collective before any of them ends (end_process)
        torch.distributed.barrier()
    pad = budget * sp - packed
    return dict(step_s=elapsed, real_tokens=real, computed_tokens=packed + max(pad, 0), pad_tokens=max(pad, 0),
                base_rss_mb=base, loss=metrics["loss"], rank=0 if d is None else d.rank,
                micro_batches=metrics["micro_batches"], checkpointing=chose)  # fmt: skip


def worker(spec: dict) -> None:
    """Run one measurement in this process; prints one JSON line (per rank under torchrun)."""
    import torch

    torch.set_num_threads(spec["threads"])
    _watch(spec["cap_mb"])
    diagnose.phase("setup")
    model_dir = spec["model_dir"]
    result = (_trl_step if spec["provider"].startswith(("trl", "fused")) else _gk_step)(spec, model_dir)
    result["peak_rss_mb"] = _rss_mb("VmHWM")
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    diagnose.phase("done")
    sys.stdout.flush()
    # one write(2) of a line under PIPE_BUF: where ranks share a pipe (torchrun without --redirects), print's
    # separate writes of the text and its newline can interleave with another rank's
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


def end_process(code: int = 0) -> None:
    """End this process now, without the interpreter's teardown: the measurement's line is written by then.

    Under torchrun, gloo's threads outlive that teardown (in torch 2.13 destroy_process_group does not stop a
    new_group's, such as gk_sp's sequence-parallel group) and, when one of them still holds a tensor as the
    interpreter finalizes, the process aborts: "terminate called without an active exception" (pytorch#190489),
    SIGABRT, and torchrun stops the other rank with SIGTERM, the "exit code -15" a CI run once reported for gk_sp
    (seen here once in about 300 gk_sp runs beside other work; the two ranks of tests/test_long_chains_failures.py,
    with gloo work in flight on a new_group, abort so in 7 of 10 runs without it, 10 of 10 after
    destroy_process_group, and in none of 30 with it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    diagnose.watch(int(os.environ.get("RANK", "0")))  # first: before torch starts threads
    worker(json.loads(sys.argv[1]))
    end_process()
