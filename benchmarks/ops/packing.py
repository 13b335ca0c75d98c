"""Padded vs packed vs shared-prefix forward + backward on a small random-init Qwen2-style model.

Usage (from the repository root):
    .venv/bin/python benchmarks/ops/packing.py            # CPU, the long-tailed mix and the prefix-ratio sweep
    .venv/bin/python benchmarks/ops/packing.py --quick    # fewer, shorter samples, the 4:1 ratio, one timed call

Model: Qwen2 config, hidden 128, 2 layers, 4 heads (head_dim 32), 2 KV heads, vocab 1024, fp32, random init.
Step: forward, the sum of completion log-probs, backward (the work of a GRPO step without the loss details).
    padded         a [B, L_max] batch with an attention mask (SDPA), L_max the longest prompt + completion.
    packed         one row, position ids reset per sample, attn_implementation="grpo_varlen".
    shared_prefix  one row with each group's prompt stored once (groups of G samples share their prompt).
Part 1, the long-tailed mix: prompts of 64 tokens, completion lengths lognormal (median 150) clipped to 16..2048.
Part 2, shared prefix at prompt:completion ratios 4:1, 1:1, 1:4 (G = 8, completions of 128 tokens): tokens that
go through attention and MLP per layer, packed vs shared prefix, and the time of a step.
tokens/s counts real (prompt + completion) tokens of the batch, so padding is pure waste. Median of 3 steps.
Rows are appended to benchmarks/results/packing_cpu.csv.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # importable from a plain checkout too

import torch

import grpo_kernels as gk
from benchmarks.common import RESULTS, append_csv, print_environment, run_meta
from grpo_kernels.attention import register_hf_attention
from grpo_kernels.packing import pack_sequences

COLUMNS = ["timestamp", "device", "torch", "triton", "git_sha", "case", "layout", "samples", "real_tokens",
           "computed_tokens", "median_ms", "tokens_per_s", "speedup_vs_padded"]  # fmt: skip
VOCAB = 1024


def model(attn: str):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def step_padded(m, prompts, completions):
    lengths = [p.numel() + c.numel() for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : lengths[i]] = torch.cat([p, c])
        mask[i, : lengths[i]] = 1
    logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    keep = torch.zeros_like(mask[:, 1:], dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        keep[i, p.numel() - 1 : p.numel() - 1 + c.numel()] = True
    logps = gk.selective_logprobs(logits[keep], ids[:, 1:][keep])
    logps.sum().backward()
    return mask.numel()


def step_packed(m, packed):
    logits = m(**packed.model_kwargs()).logits[0]
    gk.selective_logprobs(logits[packed.logit_rows], packed.completion_ids).sum().backward()
    return packed.num_tokens


def timed(fn, repeats=3, warmup=True):
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_case(case, prompts, completions, groups, meta, rows, quick=False):
    real = sum(p.numel() + c.numel() for p, c in zip(prompts, completions, strict=True))
    results = {}
    padded_model, packed_model = model("sdpa"), model("grpo_varlen")
    plain = pack_sequences(prompts, completions)
    shared = pack_sequences(prompts, completions, shared_prefix=True, group_ids=groups)
    for layout, fn in (("padded", lambda: step_padded(padded_model, prompts, completions)),
                       ("packed", lambda: step_packed(packed_model, plain)),
                       ("shared_prefix", lambda: step_packed(packed_model, shared))):  # fmt: skip
        computed = fn()  # the first call (quick: the only warm-up, and one timed call: a smoke run, not a result)
        ms = timed(fn, repeats=1, warmup=False) if quick else timed(fn)
        results[layout] = ms
        rows.append({**meta, "case": case, "layout": layout, "samples": len(prompts), "real_tokens": real,
                     "computed_tokens": computed, "median_ms": round(ms, 1), "tokens_per_s": round(real / ms * 1e3),
                     "speedup_vs_padded": round(results["padded"] / ms, 2)})  # fmt: skip
        print(f"  {case:<28} {layout:<14} {computed:>7} tokens computed ({real} real)  {ms:9.1f} ms  "
              f"{results['padded'] / ms:5.2f}x vs padded", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv", type=Path, help="append here, not to benchmarks/results/packing_cpu.csv")
    args = parser.parse_args()
    register_hf_attention()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    meta = run_meta("cpu")
    print_environment(meta)
    g = torch.Generator().manual_seed(0)
    n, group_size = (8, 4) if args.quick else (32, 8)
    cap = 128 if args.quick else 2048
    lengths = torch.exp(torch.randn(n, generator=g) + 5.0).clamp(16, cap).long()
    group_prompts = [torch.randint(0, VOCAB, (64,), generator=g) for _ in range(n // group_size)]
    prompts = [group_prompts[i // group_size] for i in range(n)]
    completions = [torch.randint(0, VOCAB, (int(x),), generator=g) for x in lengths]
    groups = [i // group_size for i in range(n)]
    rows = []
    waste = 1 - (lengths + 64).sum() / (n * (lengths.max() + 64))
    print(f"long-tailed mix: {n} samples, completions {lengths.min()}..{lengths.max()} tokens (median "
          f"{int(lengths.median())}), padding waste {waste:.0%}")  # fmt: skip
    run_case("long-tailed mix", prompts, completions, groups, meta, rows, args.quick)
    c_len = 16 if args.quick else 128
    ratios = (("4:1", 4 * c_len),) if args.quick else (("4:1", 4 * c_len), ("1:1", c_len), ("1:4", c_len // 4))
    for ratio, p_len in ratios:
        group_prompts = [torch.randint(0, VOCAB, (p_len,), generator=g) for _ in range(2)]
        prompts = [group_prompts[i // 8] for i in range(16)]
        completions = [torch.randint(0, VOCAB, (c_len,), generator=g) for _ in range(16)]
        run_case(f"prompt:completion {ratio}", prompts, completions, [i // 8 for i in range(16)], meta, rows,
                 args.quick)
    csv_path = args.csv or RESULTS / "packing_cpu.csv"
    append_csv(rows, csv_path, COLUMNS)
    print(f"appended {len(rows)} rows to {csv_path}")


if __name__ == "__main__":
    main()
