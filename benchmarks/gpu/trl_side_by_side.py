"""TRL on the same GPU, side by side: the same GRPO step in trl.GRPOTrainer, the drop-in and our trainer's step.

    python -m benchmarks.gpu.trl_side_by_side --out DIR              # GPU, < 5 min, TRL and datasets installed
    python -m benchmarks.gpu.trl_side_by_side --dry-run --out DIR    # CPU: a tiny shape

TRL is 1.16 with its GPU defaults (bf16 autocast over fp32 weights, gradient checkpointing, its own chunked LM head
on CUDA); the drop-in is `FusedGRPOTrainer(packed=True, shared_prefix=True)` with the same config; ours is
`grpo_step` (block checkpointing, bf16 autocast, packed micro-batches of 16,384 tokens). Model: trainer_speed's
Qwen2.5-1.5B shape, random weights, the same seed for every provider. DAPO, beta = 0, on-policy.

Two steps, rows of DIR/trl_side_by_side.csv (provider, step, micro-batching, seconds, peak GiB above static):
  - the loss step: trainer_speed's batch (8 prompts x G = 16, completion lengths 64..1024): TRL and the drop-in take
    `compute_loss` + backward over micro-batches of one group each (16 completions, right-padded to the group's
    longest), ours one `grpo_step` (its optimizer step included: about 1 % of it at this shape);
  - the long-chain step: one prompt x 8 completions log-uniform in 500..8,000 tokens (seeded), each provider at its
    best micro-batching (TRL and the drop-in: 8, 4, 2 or 1 completions per micro-batch; ours: token budgets of 16k,
    32k, 64k), the fastest that fits; the others' rows are kept.
Peak: torch.cuda.max_memory_allocated during the step less what was allocated before it (weights and gradients,
the same in every provider: a warm-up made the gradients). Targets (the issue's): ours <= 0.6x TRL's loss-step time
and peak; the drop-in <= 0.8x; the long-chain step <= 0.5x time. Each provider's loss sums are compared with TRL's
before the rows count (relative difference in the note). The dry run (CPU, tiny shapes) checks the stage end to end.
"""

import math
import random
import sys
import time

import torch

from benchmarks.common import write_csv
from benchmarks.gpu import stage_args
from benchmarks.gpu.trainer_speed import QWEN25_15B, TINY, Shape, synthetic_rollout
from grpo_kernels.attention import HF_ATTENTION_NAME, register_hf_attention
from grpo_kernels.train.activation import checkpoint_blocks
from grpo_kernels.train.rollout import Rollout
from grpo_kernels.train.step import Policy, grpo_step

FIELDS = ["provider", "step", "micro_batching", "seconds", "peak_gib", "vs_trl_time", "vs_trl_peak", "note"]


def build_model(config: dict, device, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**config, pad_token_id=0, eos_token_id=1),
                                            attn_implementation=attn).to(device)  # fmt: skip


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "t2": 2}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def trl_trainer(provider: str, model, dry: bool):
    import trl
    from datasets import Dataset

    from grpo_kernels.integrations import FusedGRPOTrainer

    args = trl.GRPOConfig(output_dir="/tmp/trl_side_by_side", per_device_train_batch_size=8, num_generations=8,
                          beta=0.0, loss_type="dapo", report_to="none", use_cpu=dry, save_strategy="no",
                          bf16=not dry, gradient_checkpointing=True)  # fmt: skip
    kw = dict(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
              train_dataset=Dataset.from_dict({"prompt": ["t2"]}), processing_class=tokenizer())  # fmt: skip
    trainer = FusedGRPOTrainer(**kw, packed=True, shared_prefix=True) if provider == "dropin" else trl.GRPOTrainer(**kw)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_batches(rollout: Rollout, per_batch: int, device) -> list[dict]:
    """TRL's inputs for micro-batches of per_batch completions: prompts as they are (equal lengths here),
    completions right-padded to the micro-batch's longest, num_items_in_batch the whole step's tokens."""
    n = len(rollout.completion_ids)
    total = torch.tensor(sum(len(c) for c in rollout.completion_ids), device=device)
    adv = rollout.advantages.advantages
    out = []
    for start in range(0, n, per_batch):
        rows = range(start, min(start + per_batch, n))
        longest = max(len(rollout.completion_ids[i]) for i in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for j, i in enumerate(rows):
            c = rollout.completion_ids[i]
            ids[j, : len(c)], mask[j, : len(c)] = c, 1
        prompts = torch.stack([rollout.prompt_ids[i] for i in rows])
        out.append({"prompt_ids": prompts.to(device), "prompt_mask": torch.ones_like(prompts).to(device),
                    "completion_ids": ids.to(device), "completion_mask": mask.to(device),
                    "advantages": adv[list(rows)].float().to(device), "num_items_in_batch": total})  # fmt: skip
    return out


def timed(fn, dry: bool) -> tuple[float, float, object]:
    """(seconds, peak GiB above what was allocated before (NaN on the CPU), fn's result) of one call after a
    warm-up call."""
    fn()
    if not dry:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = 0 if dry else torch.cuda.memory_allocated()
    start = time.perf_counter()
    result = fn()
    if not dry:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, float("nan") if dry else (torch.cuda.max_memory_allocated() - before) / 2**30, result


def trl_step(provider: str, config: dict, rollout: Rollout, per_batch: int, dry: bool):
    device = torch.device("cpu" if dry else "cuda")
    trainer = trl_trainer(provider, build_model(config, device), dry)
    batches = trl_batches(rollout, per_batch, trainer.model.device)

    def step():
        trainer.model.zero_grad(set_to_none=False)
        total = 0.0
        for inputs in batches:
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            total += float(loss.detach())
        return total

    return timed(step, dry)


def ours_step(config: dict, rollout: Rollout, token_budget: int, dry: bool):
    device = torch.device("cpu" if dry else "cuda")
    register_hf_attention()
    model = build_model(config, device, HF_ATTENTION_NAME)
    checkpoint_blocks(list(model.model.layers), "blocks")
    policy = Policy(model, compute_dtype=None if dry else torch.bfloat16)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)  # the update changes nothing: each call is the same
    kw = dict(loss_options=dict(loss_type="dapo"), temperature=1.0, token_budget=token_budget,
              autocast_dtype=None if dry else torch.bfloat16)  # fmt: skip
    seconds, peak, metrics = timed(lambda: grpo_step(policy, optimizer, rollout, **kw), dry)
    return seconds, peak, metrics["loss"]


def long_chain_rollout(shape: Shape) -> Rollout:
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    low, high = (16, 64) if shape.dry else (500, 8000)
    vocab = shape.model["vocab_size"]
    lengths = [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(8)]
    lengths[0] = high
    prompt = torch.randint(2, vocab, (shape.prompt_len,), generator=g)
    completions = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
    return Rollout(prompt_ids=[prompt] * 8, completion_ids=completions, sampler_logps=[-torch.rand(n) for n in lengths],
                   group_size=8).with_rewards([0.0, 1.0] * 4)  # fmt: skip


def run_step(name: str, shape: Shape, rollout: Rollout, options: dict, rows: list) -> None:
    """Rows of each provider at each of its micro-batchings for this step (out of memory: a row saying so)."""
    results = {}
    for provider, choices in options.items():
        for choice in choices:
            try:
                if provider == "ours":
                    seconds, peak, loss = ours_step(shape.model, rollout, choice, shape.dry)
                else:
                    seconds, peak, loss = trl_step(provider, shape.model, rollout, choice, shape.dry)
            except torch.OutOfMemoryError as exc:
                rows.append(dict(provider=provider, step=name, micro_batching=choice, seconds="out of memory",
                                 note=str(exc).splitlines()[0][:120]))  # fmt: skip
                continue
            finally:
                if not shape.dry:
                    torch.cuda.empty_cache()
            results.setdefault(provider, []).append((seconds, peak, loss, choice))
    base = min(results.get("trl", [(float("nan"),) * 4]))
    for provider, runs in results.items():
        best = min(runs)
        for seconds, peak, loss, choice in runs:
            agree = abs(loss - base[2]) / max(abs(base[2]), 1e-12)
            rows.append(dict(provider=provider, step=name, micro_batching=choice, seconds=f"{seconds:.3f}",
                             peak_gib=f"{peak:.2f}", vs_trl_time=f"{seconds / base[0]:.2f}x",
                             vs_trl_peak=f"{peak / base[1]:.2f}x" if base[1] == base[1] else "",
                             note=("best; " if (seconds, peak, loss, choice) == best else "")
                             + f"loss {loss:.6g}, {agree:.1e} from TRL's"))  # fmt: skip
        print(*(r for r in rows if r["provider"] == provider and r["step"] == name), sep="\n", flush=True)


def main(argv=None) -> int:
    args, out = stage_args("trl_side_by_side", __doc__, "CPU, tiny shapes", argv)
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as exc:
        raise SystemExit(f"trl_side_by_side: {exc.name} is not installed (carry the wheels of "
                         "benchmarks/gpu/wheels.txt)") from exc  # fmt: skip
    shape = Shape(args.dry_run)
    assert shape.model is (TINY if args.dry_run else QWEN25_15B)
    rows: list[dict] = []
    per_group = shape.group_size
    run_step("loss step", shape, synthetic_rollout(shape),
             {"trl": [per_group], "dropin": [per_group], "ours": [shape.token_budget]}, rows)  # fmt: skip
    splits = [8, 2] if args.dry_run else [8, 4, 2, 1]
    budgets = [1024] if args.dry_run else [16384, 32768, 65536]
    run_step("long chains", shape, long_chain_rollout(shape), {"trl": splits, "dropin": splits, "ours": budgets}, rows)
    write_csv(rows, out / "trl_side_by_side.csv", FIELDS)
    print(f"trl {trl.__version__}; wrote {out / 'trl_side_by_side.csv'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
