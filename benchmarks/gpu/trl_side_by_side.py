"""TRL on the same GPU, side by side: the same GRPO step in trl.GRPOTrainer, the drop-in and our trainer's step.

    python -m benchmarks.gpu.trl_side_by_side --out DIR              # GPU, < 5 min, TRL and datasets installed
    python -m benchmarks.gpu.trl_side_by_side --dry-run --out DIR    # CPU: a tiny shape

TRL is 1.16 with its GPU defaults (bf16 autocast over fp32 weights, gradient checkpointing, its own chunked LM head
on CUDA), its model prepared as Trainer.train() prepares it (gradient checkpointing enabled, accelerate's autocast
wrapper): calling compute_loss alone would run with neither. The drop-in is `FusedGRPOTrainer(packed=True,
shared_prefix=True)` with the same config; ours is `grpo_step` (block checkpointing, bf16 autocast, packed micro-batches
of 16,384 tokens). Each provider's step is checked as it runs (a hook on the first block's MLP): every block forward
recomputed in the backward, and under bf16 autocast on the GPU (none in the dry run); a step that is not is an error
row, not a time. Model: trainer_speed's Qwen2.5-1.5B shape, random weights made on the GPU, the same seed for every
provider, built once per provider and reused for all its steps (no step changes the weights). DAPO, beta = 0,
on-policy.

Two steps, rows of DIR/trl_side_by_side.csv (provider, step, micro-batching, seconds, peak GiB above static):
  - the loss step: trainer_speed's batch (8 prompts x G = 16, completion lengths 64..1024): TRL and the drop-in take
    `compute_loss` + backward over micro-batches of one group each (16 completions, right-padded to the group's
    longest), ours one `grpo_step` (its optimizer step included: about 1 % of it at this shape);
  - the long-chain step: one prompt x 8 completions log-uniform in 500..8,000 tokens (seeded), each provider at its
    best micro-batching (TRL and the drop-in: 8, 4, 2 or 1 completions per micro-batch; ours: token budgets of 16k,
    32k, 64k), the fastest that fits; the others' rows are kept.
Peak: torch.cuda.max_memory_allocated during the step less what was allocated before it (weights and gradients,
the same in every provider: a warm-up made the gradients). Rows are written as they come; a provider's failure
(its build, a step, out of memory) is a row and the others still run; the exit status is 1 if any row is an error
(out of memory is a result). Targets (the issue's): ours <= 0.6x TRL's loss-step time
and peak; the drop-in <= 0.8x; the long-chain step <= 0.5x time. Each provider's loss sums are compared with TRL's
before the rows count (relative difference in the note). The dry run (CPU, tiny shapes) checks the stage end to end.
"""

import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import BlockProbe, trl_prepare_for_steps, write_csv
from benchmarks.gpu import stage_args
from benchmarks.gpu.trainer_speed import QWEN25_15B, TINY, Shape, synthetic_rollout
from grpo_kernels.attention import HF_ATTENTION_NAME, register_hf_attention
from grpo_kernels.train.model.activation import checkpoint_blocks
from grpo_kernels.train.model.policy import Policy
from grpo_kernels.train.rollout.batch import Rollout
from grpo_kernels.train.step import grpo_step

FIELDS = ["provider", "step", "micro_batching", "seconds", "peak_gib", "vs_trl_time", "vs_trl_peak", "block_calls",
          "note"]


def build_model(config: dict, device, attn: str = "sdpa"):
    """The model, seeded, its weights made on `device` (seconds on a GPU, where a CPU build of 1.5B parameters takes
    about a minute)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config, pad_token_id=0, eos_token_id=1),
                                                 attn_implementation=attn)  # fmt: skip
    return model.to(device)


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "t2": 2}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def trl_trainer(provider: str, model, dry: bool):
    """TRL's GRPOTrainer (or the drop-in) prepared as its train() would be: gradient checkpointing on, the model
    wrapped for bf16 autocast on the GPU."""
    import trl
    from datasets import Dataset

    from grpo_kernels.integrations import FusedGRPOTrainer

    scratch = str(Path(tempfile.gettempdir(), "trl_side_by_side"))
    args = trl.GRPOConfig(output_dir=scratch, per_device_train_batch_size=8, num_generations=8, beta=0.0,
                          loss_type="dapo", report_to="none", use_cpu=dry, save_strategy="no", bf16=not dry,
                          gradient_checkpointing=True)  # fmt: skip
    kw = dict(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
              train_dataset=Dataset.from_dict({"prompt": ["t2"]}), processing_class=tokenizer())  # fmt: skip
    trainer = FusedGRPOTrainer(**kw, packed=True, shared_prefix=True) if provider == "dropin" else trl.GRPOTrainer(**kw)
    trl_prepare_for_steps(trainer, provider)
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


class Provider:
    """One provider's model and trainer, built once and reused for every step and micro-batching (no step changes the
    weights: TRL's and the drop-in's compute_loss + backward take no optimizer step, ours steps with lr 0)."""

    def __init__(self, name: str, config: dict, dry: bool):
        self.name, self.dry = name, dry
        self.device = torch.device("cpu" if dry else "cuda")
        if name == "ours":
            register_hf_attention()
            self.model = build_model(config, self.device, HF_ATTENTION_NAME)
            checkpoint_blocks(list(self.model.model.layers), "blocks")
            self.policy = Policy(self.model, compute_dtype=None if dry else torch.bfloat16)
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=0.0)
        else:
            self.trainer = trl_trainer(name, build_model(config, self.device), dry)
            self.model = self.trainer.model

    def step(self, rollout: Rollout, choice: int):
        """The step at this micro-batching (TRL / drop-in: completions per micro-batch; ours: the token budget) as
        a call returning its loss."""
        if self.name == "ours":
            kw = dict(loss_options=dict(loss_type="dapo"), temperature=1.0, token_budget=choice,
                      autocast_dtype=None if self.dry else torch.bfloat16)  # fmt: skip
            return lambda: grpo_step(self.policy, self.optimizer, rollout, **kw)["loss"]
        batches = trl_batches(rollout, choice, self.device)

        def step():
            self.model.zero_grad(set_to_none=False)
            total = 0.0
            for inputs in batches:
                loss = self.trainer.compute_loss(self.trainer.model_wrapped, inputs)
                loss.backward()
                total += float(loss.detach())
            return total

        return step

    def measure(self, rollout: Rollout, choice: int) -> tuple[float, float, float, BlockProbe]:
        """(seconds, peak GiB, loss, what the first decoder block saw) of the step after a warm-up."""
        with BlockProbe(self.model.model.layers[0].mlp, self.device.type) as probe:
            seconds, peak, loss = timed(self.step(rollout, choice), self.dry)
        return seconds, peak, loss, probe


def setup_error(probe: BlockProbe, dry: bool) -> str:
    """Why the measured step is not the one this stage times ("" when it is): every provider recomputes its blocks
    in the backward and runs them under bf16 autocast on the GPU (none on the CPU dry run)."""
    want = {None} if dry else {torch.bfloat16}
    if not probe.checkpointed:
        return f"not checkpointed ({probe.summary()})"
    if probe.autocast != want:
        return f"autocast is not {'off' if dry else 'bf16'} ({probe.summary()})"
    return ""


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


def failure_row(provider: str, step: str, choice, exc: BaseException) -> dict:
    what = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else "error"
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return dict(provider=provider, step=step, micro_batching=choice, seconds=what,
                note=f"{type(exc).__name__}: {first}")  # fmt: skip


def fastest(rows: list, provider: str, step: str) -> dict | None:
    ok = [r for r in rows if (r["provider"], r["step"]) == (provider, step) and "loss" in r]
    return min(ok, key=lambda r: float(r["seconds"]), default=None)


def with_ratios(rows: list) -> list:
    """Each measured row with its time and peak against TRL's fastest micro-batching of the same step, and its loss's
    relative difference from that one's (where TRL's ran); "best" marks each provider's fastest per step."""
    for r in rows:
        if "loss" not in r:
            continue
        base, best = fastest(rows, "trl", r["step"]), fastest(rows, r["provider"], r["step"])
        r["note"] = ("best; " if r is best else "") + f"loss {r['loss']:.6g}"
        if base is not None:
            seconds, peak, base_peak = float(r["seconds"]), float(r["peak_gib"]), float(base["peak_gib"])
            r["vs_trl_time"] = f"{seconds / float(base['seconds']):.2f}x"
            r["vs_trl_peak"] = f"{peak / base_peak:.2f}x" if peak == peak else ""
            r["note"] += f", {abs(r['loss'] - base['loss']) / max(abs(base['loss']), 1e-12):.1e} from TRL's"
    return rows


def run_provider(name: str, shape: Shape, steps: list, rows: list, write) -> None:
    """Every (step, micro-batching) of one provider on its one model, each row written as it comes; a failure (the
    build, a step, a step not set up as this stage times it) is a row, and the rest still run."""
    try:
        provider = Provider(name, shape.model, shape.dry)
    except Exception as exc:  # noqa: BLE001 (reported as rows; the other providers still run)
        rows += [failure_row(name, step, "-", exc) for step, _, _ in steps]
        write()
        return
    for step, rollout, choices in steps:
        for choice in choices[name]:
            try:
                seconds, peak, loss, probe = provider.measure(rollout, choice)
                wrong = setup_error(probe, shape.dry)
                if wrong:
                    raise RuntimeError(f"{name} did not run as this stage times it: {wrong}")
                rows.append(dict(provider=name, step=step, micro_batching=choice, seconds=f"{seconds:.3f}",
                                 peak_gib=f"{peak:.2f}", block_calls=probe.summary(), loss=loss))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 (out of memory among them: a row, and the next choice runs)
                rows.append(failure_row(name, step, choice, exc))
            finally:
                if not shape.dry:
                    torch.cuda.empty_cache()
            write()
            print(rows[-1], flush=True)
    del provider
    if not shape.dry:
        torch.cuda.empty_cache()


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
    splits = [8, 2] if args.dry_run else [8, 4, 2, 1]
    budgets = [1024] if args.dry_run else [16384, 32768, 65536]
    per_group = {"trl": [shape.group_size], "dropin": [shape.group_size], "ours": [shape.token_budget]}
    steps = [("loss step", synthetic_rollout(shape), per_group),
             ("long chains", long_chain_rollout(shape), {"trl": splits, "dropin": splits, "ours": budgets})]
    rows: list[dict] = []
    path = out / "trl_side_by_side.csv"

    def write():
        write_csv(with_ratios(rows), path, FIELDS, extra="ignore")

    for name in ("trl", "dropin", "ours"):  # TRL first: the others' rows carry their ratio to its fastest
        run_provider(name, shape, steps, rows, write)
    failed = [r for r in rows if r["seconds"] == "error"]  # out of memory is a result on the GPU, not a failure
    print(*with_ratios(rows), sep="\n")
    print(f"trl {trl.__version__}; wrote {path} ({len(rows)} rows, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
