"""The trainer's speed and memory on one GPU: a real model shape, each activation-checkpointing mode.

    python -m benchmarks.gpu.trainer_speed --out DIR              # GPU, < 5 min (writes DIR/trainer_speed.csv)
    python -m benchmarks.gpu.trainer_speed --dry-run --out DIR    # CPU: a tiny shape, every mode but "offload"

Model: Qwen2.5-1.5B's shape (28 decoder blocks, hidden 1536, MLP 8960, 12 heads, 2 KV heads, tied embeddings) with
random weights and a vocabulary of 49,152 (SmolLM2's tokenizer's size); packed attention (grpo_varlen). As the trainer
runs model.dtype = "bfloat16" on one GPU: fp32 parameters (the optimizer's master weights; AdamW's state fp32), bf16
compute (autocast, the fused LM head in bf16). Batch: 8 prompts of 128 synthetic token ids x G = 16 completions whose
lengths are drawn uniformly in 64..1024 (seeded), random 0/1 rewards: DAPO, packing.token_budget 16,384.

Rows per mode (none, selective, blocks, offload, auto), each on a fresh model after one warm-up step:
  - train: one `grpo_step` (one iteration, no old or reference log-probs): seconds, tokens/s, MFU = model FLOPs
    (6 x parameters per token, plus attention 6 x 2 x layers x hidden x the sum over sequences of L^2 / 2 for the
    causal products; no recompute counted) over seconds x the bf16 matmul rate measured in this call (8192^3);
  - old and ref log-probs: one more step that computes them (compute_old_logps, beta = 0.04 against a frozen copy),
    less the train step's seconds;
  - peak: the GPU memory the step allocated at most, above what was allocated before it (weights, gradients and
    AdamW's state exist by then: the warm-up made them);
  - a mode that does not fit is a row "out of memory", not a failure; "auto" names the mode it chose; the step is
    checked as it runs (a hook on the first block's MLP): recomputed in the backward where the mode checkpoints it;
  - any other failure of a mode (or of the generation) is an "error" row, the next mode still runs, and the stage
    exits 1 at the end. Models are built on the GPU (seconds each), fresh per mode.
Generation (once, mode-independent): the trainer's HF sampler on the same model, the 128 rows to 1,024 new tokens
(random weights never stop early): seconds and tokens/s. The dry run runs all of it at a tiny shape on the CPU
("offload" needs CUDA: its row says so) to check the stage end to end; its numbers mean nothing.
vLLM (mode "vllm", benchmarks/gpu/vllm_speed.py): the colocated engine's start and decode with and without CUDA graphs
(sampling.vllm_enforce_eager), the memory its sleep levels give back (sampling.vllm_sleep); "not run" rows where vLLM
is not importable or there is no CUDA.
"""

import copy
import random
import sys
import time

import torch

from benchmarks.common import BlockProbe, write_csv
from benchmarks.gpu import stage_args
from benchmarks.gpu.vllm_speed import vllm_rows
from grpo_kernels.attention import HF_ATTENTION_NAME, register_hf_attention
from grpo_kernels.train.model import activation
from grpo_kernels.train.model.policy import Policy
from grpo_kernels.train.rollout.batch import Rollout
from grpo_kernels.train.rollout.hf_sampler import HFSampler
from grpo_kernels.train.step import grpo_step

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512)  # fmt: skip
MODES = ("none", "selective", "blocks", "offload", "auto")
LOSS = dict(loss_type="dapo", epsilon_high=0.28)
FIELDS = ["mode", "quantity", "value", "unit", "note"]


class Shape:
    def __init__(self, dry: bool):
        self.dry = dry
        self.model = TINY if dry else QWEN25_15B
        self.prompts, self.group_size, self.prompt_len = (2, 4, 8) if dry else (8, 16, 128)
        self.lengths = (8, 32) if dry else (64, 1024)
        self.token_budget = 256 if dry else 16384
        self.device = torch.device("cpu" if dry else "cuda")


def build_model(shape: Shape):
    from transformers import AutoModelForCausalLM, Qwen2Config

    register_hf_attention()
    torch.manual_seed(0)
    with torch.device(shape.device):  # weights made where they run: seconds on a GPU, a minute on its CPU
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape.model), attn_implementation=HF_ATTENTION_NAME)
    return model.to(shape.device)


def synthetic_rollout(shape: Shape) -> Rollout:
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    vocab = shape.model["vocab_size"]
    prompts, completions, logps = [], [], []
    for _ in range(shape.prompts):
        prompt = torch.randint(0, vocab, (shape.prompt_len,), generator=g)
        for _ in range(shape.group_size):
            n = rng.randint(*shape.lengths)
            prompts.append(prompt)
            completions.append(torch.randint(0, vocab, (n,), generator=g))
            logps.append(-torch.rand(n, generator=g) * 5)
    rewards = torch.randint(0, 2, (len(completions),), generator=g).float()
    rewards[0], rewards[1] = 0.0, 1.0  # the first group carries a gradient whatever the draw
    return Rollout(prompt_ids=prompts, completion_ids=completions, sampler_logps=logps,
                   group_size=shape.group_size).with_rewards(rewards)  # fmt: skip


def model_flops(config: dict, rollout: Rollout) -> float:
    """6 x parameters x tokens (tied head counted once, as a matmul) + causal attention's products, forward and
    backward, no recompute."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers = config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f  # q, o, k, v, gate, up, down
    params = layers * per_layer + v * h
    lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
    attention = 6 * 2 * layers * h * sum(n * n / 2 for n in lengths)
    return 6 * params * sum(lengths) + attention


def matmul_tflops(shape: Shape) -> float:
    if shape.dry:
        return float("nan")
    import triton

    a = torch.randn(8192, 8192, device=shape.device, dtype=torch.bfloat16)
    return 2 * 8192**3 / triton.testing.do_bench(lambda: a @ a, return_mode="median") / 1e9


def apply_mode(model, mode: str, shape: Shape, tokens: int) -> tuple[bool, str]:
    """Checkpoint the decoder blocks as the trainer does for `mode` (its activation.apply; "auto": what its chooser
    picks for this device's free memory); returns (whether the first block is checkpointed, auto's line: "" for the
    other modes)."""
    chosen, count, line = activation.apply(model, mode=mode, tokens=tokens, completion_tokens=shape.lengths[1],
                                           dtype_bytes=2, device=shape.device)  # fmt: skip
    return chosen != "none" and count > 0, line


def sync(shape: Shape) -> None:
    if not shape.dry:
        torch.cuda.synchronize()


def measure_mode(mode: str, shape: Shape, rollout: Rollout, flops: float, tflops: float, rows: list) -> None:
    model = build_model(shape)
    checkpointed, note = apply_mode(model, mode, shape, shape.token_budget)
    policy = Policy(model, compute_dtype=torch.bfloat16)
    ref = Policy(copy.deepcopy(model).requires_grad_(False), compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    kw = dict(temperature=1.0, token_budget=shape.token_budget, autocast_dtype=torch.bfloat16)
    grpo_step(policy, optimizer, rollout, loss_options=LOSS, **kw)  # warm-up: gradients and AdamW's state exist now
    sync(shape)
    if not shape.dry:
        torch.cuda.reset_peak_memory_stats()
    before = 0 if shape.dry else torch.cuda.memory_allocated()
    with BlockProbe(model.model.layers[0].mlp, shape.device.type) as probe:
        start = time.perf_counter()
        metrics = grpo_step(policy, optimizer, rollout, loss_options=LOSS, **kw)
        sync(shape)
        train_s = time.perf_counter() - start
    if probe.checkpointed != checkpointed:
        raise RuntimeError(f"mode {mode}: the step ran {'with' if probe.checkpointed else 'without'} recomputation "
                           f"({probe.summary()})")  # fmt: skip
    peak = float("nan") if shape.dry else (torch.cuda.max_memory_allocated() - before) / 2**30
    start = time.perf_counter()
    grpo_step(policy, optimizer, rollout, loss_options={**LOSS, "beta": 0.04}, ref_policy=ref, compute_old_logps=True,
              **kw)  # fmt: skip
    sync(shape)
    logps_s = time.perf_counter() - start - train_s
    mfu = flops / train_s / (tflops * 1e12)
    rows += [dict(mode=mode, quantity="train step", value=f"{train_s:.3f}", unit="s",
                  note=f"{metrics['micro_batches']} micro-batches; {probe.summary()}" + (f"; {note}" if note else "")),
             dict(mode=mode, quantity="train tokens/s", value=f"{metrics['train_tokens_per_s']:.0f}", unit="tokens/s"),
             dict(mode=mode, quantity="train MFU", value=f"{mfu:.3f}", unit="fraction",
                  note=f"{flops / 1e12:.1f} TFLOP over {train_s:.3f} s at {tflops:.0f} TFLOP/s"),
             dict(mode=mode, quantity="old + ref log-probs", value=f"{logps_s:.3f}", unit="s",
                  note="a step that computes them less the train step"),
             dict(mode=mode, quantity="peak above static", value=f"{peak:.2f}", unit="GiB")]  # fmt: skip
    del policy, ref, optimizer, model


def generation_rows(shape: Shape, rows: list) -> None:
    model = build_model(shape)
    vocab = shape.model["vocab_size"]
    sampler = HFSampler(model, eos_id=vocab - 1, pad_id=0, max_new_tokens=shape.lengths[1], stop_ids=())
    prompts = [torch.randint(1, vocab - 1, (shape.prompt_len,)) for _ in range(shape.prompts)]
    sync(shape)
    start = time.perf_counter()
    rollout = sampler.sample(prompts, shape.group_size, seeds=list(range(shape.prompts)))
    sync(shape)
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for c in rollout.completion_ids)
    rows += [dict(mode="-", quantity="generation", value=f"{seconds:.2f}", unit="s",
                  note=f"HF sampler, {len(rollout.completion_ids)} rows, {tokens} tokens, fp32 weights"),
             dict(mode="-", quantity="generation tokens/s", value=f"{tokens / seconds:.0f}",
                  unit="tokens/s")]  # fmt: skip
    del sampler, model


def main(argv=None) -> int:
    args, out = stage_args("trainer_speed", __doc__, "CPU, a tiny shape", argv,
                           lambda p: p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes"))
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"trainer_speed: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    shape = Shape(args.dry_run)
    rollout = synthetic_rollout(shape)
    flops, tflops = model_flops(shape.model, rollout), matmul_tflops(shape)
    rows = [dict(mode="-", quantity="bf16 matmul", value=f"{tflops:.0f}", unit="TFLOP/s", note="8192^3"),
            dict(mode="-", quantity="completion tokens", value=str(sum(len(c) for c in rollout.completion_ids)),
                 unit="tokens", note=f"lengths {shape.lengths[0]}..{shape.lengths[1]}")]  # fmt: skip

    def write():
        write_csv(rows, out / "trainer_speed.csv", FIELDS)

    for mode in modes:
        if mode == "offload" and shape.dry:
            rows.append(dict(mode=mode, quantity="train step", value="-", unit="", note="CUDA only: not run on CPU"))
            continue
        try:
            measure_mode(mode, shape, rollout, flops, tflops, rows)
        except Exception as exc:  # noqa: BLE001 (a row; the next mode still runs)
            rows.append(failure_row(mode, exc))
        if not shape.dry:
            torch.cuda.empty_cache()
        write()
        print(*(r for r in rows if r["mode"] == mode), sep="\n", flush=True)
    try:
        generation_rows(shape, rows)
    except Exception as exc:  # noqa: BLE001
        rows.append(failure_row("-", exc, "generation"))
    write()
    print(*(r for r in rows if r["mode"] == "-"), sep="\n", flush=True)
    try:
        vllm_rows(shape, build_model, rows)
    except Exception as exc:  # noqa: BLE001
        rows.append(failure_row("vllm", exc, "start"))
    write()
    print(*(r for r in rows if r["mode"] == "vllm"), sep="\n")
    return 1 if any(r["value"] == "error" for r in rows) else 0  # out of memory is a result, not a failure


def failure_row(mode: str, exc: BaseException, quantity: str = "train step") -> dict:
    what = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else "error"
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return dict(mode=mode, quantity=quantity, value=what, unit="", note=f"{type(exc).__name__}: {first}")


if __name__ == "__main__":
    sys.exit(main())
