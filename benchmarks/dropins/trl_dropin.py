"""Benchmark the loss step of trl.GRPOTrainer (TRL's native path) against FusedGRPOTrainer on CPU.

Usage (from the repository root):
    .venv/bin/python benchmarks/dropins/trl_dropin.py            # V = 32768 and 151936, tiny Qwen2 (H=128, 2 layers)
    .venv/bin/python benchmarks/dropins/trl_dropin.py --quick    # V = 8192, a smaller batch, no memory runs

The step: `trainer.compute_loss(model, inputs)` + `backward()` on one fixed micro-batch (B=8 completions of up to
C=256 tokens, ~10% right padding, after P=32 prompt tokens; dapo, beta=0, on-policy; fp32, i.e. bf16=False, and
TRL's default gradient checkpointing): the decoder body's forward and backward, the LM head and the loss.
Generation, rewards and the optimizer are not timed (they do not depend on the provider). Both trainers are built
from the same random-init model (no downloads) and take the same inputs dict; their losses are checked against
each other before timing. TRL 1.16's native path is its own chunked LM head (`trl.kernels.ChunkedLogProbFunction`;
on CPU: torch ops on [4096-token x 32768-vocab] tiles, over every position of prompt + completion) followed by
`_compute_loss`; the fused path is `grpo_kernels.fused_linear_grpo_loss` over the completion positions.

median_ms: median of --repeats steps after one checked step, both providers in this process.
peak_extra_mb: each provider in a fresh process: after a small warm-up step (which allocates the parameter
gradients), VmHWM is reset through /proc/self/clear_refs; peak RSS during one step minus the RSS before it.
Prints a markdown table; appends rows to benchmarks/results/trl_dropin_cpu.csv.
"""

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

from benchmarks.common import RESULTS, append_csv, print_environment, run_meta, status_kb

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "trl", "transformers", "V", "H", "B", "P", "C",
           "provider", "median_ms", "peak_extra_mb", "speedup_vs_trl", "memory_vs_trl"]  # fmt: skip
SHAPE = dict(hidden=128, batch=8, prompt=32, completion=256)
QUICK = dict(hidden=64, batch=4, prompt=16, completion=64)
PROVIDERS = ("trl", "fused")


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "t2": 2}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build(provider, *, vocab, hidden, **_):
    """(trainer, model) for a tiny random Qwen2 with this vocabulary; beta=0, so no reference model."""
    import transformers
    import trl
    from datasets import Dataset

    from grpo_kernels.integrations import FusedGRPOTrainer

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    args = trl.GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=4, beta=0.0,
                          loss_type="dapo", report_to="none", use_cpu=True, save_strategy="no", bf16=False)  # fmt: skip
    cls = FusedGRPOTrainer if provider == "fused" else trl.GRPOTrainer
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["t2"]}), processing_class=tokenizer())  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, trainer.model


def make_inputs(*, vocab, batch, prompt, completion, seed=0, **_):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.8 * completion), completion + 1, (batch,), generator=g)
    lengths[0] = completion
    mask = (torch.arange(completion)[None] < lengths[:, None]).long()
    return {"prompt_ids": torch.randint(2, vocab, (batch, prompt), generator=g),
            "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
            "completion_ids": torch.randint(2, vocab, (batch, completion), generator=g), "completion_mask": mask,
            "advantages": torch.randn(batch, generator=g), "num_items_in_batch": mask.sum()}  # fmt: skip


def step(trainer, model, inputs) -> torch.Tensor:
    model.zero_grad(set_to_none=False)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.detach()


def measure_peak(spec: dict) -> float:
    """MB one loss step allocates beyond the parameter gradients, in this (fresh) process."""
    trainer, model = build(**spec)
    step(trainer, model, make_inputs(**{**spec, "batch": 1, "completion": 8}, seed=1))  # warm-up
    inputs = make_inputs(**spec)
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    step(trainer, model, inputs)
    return (status_kb("VmHWM") - before) / 2**10


def peak_in_fresh_process(spec: dict) -> float | None:
    out = subprocess.run([sys.executable, __file__, "--peak", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"  peak memory of {spec['provider']} failed: {out.stderr.strip().splitlines()[-1:]}")
        return None
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="V = 8192, a smaller batch, no memory runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per provider (after one checked step)")
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/trl_dropin_cpu.csv")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # internal: one peak-memory measurement (JSON spec)
    args = parser.parse_args()
    if args.peak:
        print(measure_peak(json.loads(args.peak)))
        return
    import transformers
    import trl

    meta = {**run_meta("cpu"), "trl": trl.__version__, "transformers": transformers.__version__}
    print_environment(meta)
    shape = QUICK if args.quick else SHAPE
    rows, started = [], time.perf_counter()
    for vocab in (8192,) if args.quick else (32768, 151936):
        spec = {**shape, "vocab": vocab}
        inputs = make_inputs(**spec)
        res, losses = {}, {}
        for provider in PROVIDERS:
            trainer, model = build(provider, **spec)
            losses[provider] = step(trainer, model, inputs)  # the checked call, also the warm-up
            ms = time_ms(functools.partial(step, trainer, model, inputs), args.repeats)
            del trainer, model
            peak = None if args.quick else peak_in_fresh_process({**spec, "provider": provider})
            res[provider] = (ms, peak)
            print(f"  V={vocab} {provider}: {ms:.0f} ms" + ("" if peak is None else f", {peak:.0f} MB"), flush=True)
        torch.testing.assert_close(losses["fused"], losses["trl"], rtol=1e-4, atol=1e-6)
        base_ms, base_mb = res["trl"]
        for provider, (ms, peak) in res.items():
            rows.append({**meta, "V": vocab, "H": spec["hidden"], "B": spec["batch"], "P": spec["prompt"],
                         "C": spec["completion"], "provider": provider, "median_ms": round(ms, 1),
                         "peak_extra_mb": "" if peak is None else peak,
                         "speedup_vs_trl": round(base_ms / ms, 2),
                         "memory_vs_trl": "" if peak is None or not base_mb else round(peak / base_mb, 3)})  # fmt: skip
    print("\n| V | provider | step ms | peak extra MB | speedup vs TRL | memory vs TRL |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['V']} | {r['provider']} | {r['median_ms']} | {r['peak_extra_mb']} | {r['speedup_vs_trl']} "
              f"| {r['memory_vs_trl']} |")  # fmt: skip
    csv_path = args.csv or RESULTS / "trl_dropin_cpu.csv"
    append_csv(rows, csv_path, COLUMNS)
    print(f"\nappended {len(rows)} rows to {csv_path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
