"""Is one of this package's CPU paths less accurate than the other? Both against float64, on a real training batch.

    python -m benchmarks.ops.simd_accuracy [--models tiny,smollm2-135m] [--out FILE]

For each model, one GRPO rollout of the run it trains in (tiny: the demo's config after its SFT warm start;
smollm2-135m: the learning-vs-TRL run's task and settings, from the instruct model): 16 prompts x G = 8, packed. Its
hidden states and LM head go through the fused log-prob and loss ops ("dapo", on-policy) by

- the C++ row kernels with this package's AVX-512 paths on (`impl="cpp"`, the default on CPU),
- the same kernels with them off (`grpo_kernels.cpu.simd(False)`),
- the naive eager path (`impl="reference"`: full logits, log-softmax, the reference loss), in float32,

and each is compared with the naive path in float64 (the truth): the largest error relative to the largest value of
the log-probs, the loss, d loss / d hidden and d loss / d head, and the gradients' scale bias (<x, truth> / |truth|^2
- 1: a path that systematically shrinks or grows the update shows here, not in a max error). The advantages op is
compared the same way. A path that is less accurate than the others is a defect; equal errors at float32 rounding
mean the learning differences between the paths are rounding amplified by training, not a bias.
"""

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import ARITH_FORMAT_WEIGHT_COMMITTED, ROOT, device_name
from grpo_kernels import cpu, reference
from grpo_kernels.advantages import group_advantages
from grpo_kernels.fused_linear import fused_linear_grpo_loss, fused_linear_logprobs

RUNS = {
    "tiny": ["--config-file", str(ROOT / "examples" / "train_tiny_cpu.toml")],
    "smollm2-135m": ["--model.name=smollm2-135m", "--task.name=arith", "--task.difficulty=2",
                     f"--task.format_weight={ARITH_FORMAT_WEIGHT_COMMITTED}",  # the bonus its committed table ran with
                     "--sampling.temperature=0.7", "--sampling.max_new_tokens=24"],
}  # fmt: skip


def batch(model_name: str, seed: int = 0):
    """(hidden [T, H], head [V, H], completion ids [T], cu_seqlens, rewards [N], G, temperature) of one rollout."""
    from grpo_kernels.packing import pack_sequences
    from grpo_kernels.train.build import load
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.data.tasks import PromptStream
    from grpo_kernels.train.rollout.hf_sampler import HFSampler
    from grpo_kernels.train.rollout.sampling import seed_for
    from grpo_kernels.train.step import sft_warmup

    args = RUNS[model_name]
    path = Path(args[1]) if args[0] == "--config-file" else None
    config = load_config(path, [f"--seed={seed}", *(args if path is None else [])])
    torch.manual_seed(seed)
    inputs = load(config)
    tok, task, train_set, model = inputs.tok, inputs.task, inputs.train_set, inputs.model
    if config.task.sft_warmup_steps:
        sft_warmup(model, tok, task, steps=config.task.sft_warmup_steps, seed=seed)
    s, g = config.sampling, 8
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids,
                        max_new_tokens=s.max_new_tokens, temperature=s.temperature)  # fmt: skip
    examples = PromptStream(train_set, seed).take(16)
    rollout = sampler.sample([tok.encode_prompt(e.prompt) for e in examples], g,
                             seeds=[seed_for(seed, 0, 0, k) for k in range(len(examples))])  # fmt: skip
    rewards = [inputs.rewards.reward(tok.decode(c), examples[k])
               for k, c in zip(rollout.group_ids, rollout.completion_ids, strict=True)]  # fmt: skip
    packed = pack_sequences(rollout.prompt_ids, rollout.completion_ids)
    model.eval()
    with torch.no_grad():
        h = model.base_model(**packed.model_kwargs()).last_hidden_state[0][packed.logit_rows]
    head = model.get_output_embeddings().weight.detach()
    return h, head, packed.completion_ids, packed.completion_cu_seqlens, torch.tensor(rewards), g, s.temperature


def run_ops(h, w, ids, cu, adv, temperature, impl):
    """(log-probs, loss, d hidden, d head) of the fused ops on (h, w) by impl, in h's dtype."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logps = fused_linear_logprobs(h.detach(), w.detach(), ids, temperature=temperature, impl=impl)
    per_token = adv.to(h.dtype).repeat_interleave((cu[1:] - cu[:-1]).long())
    loss, _ = fused_linear_grpo_loss(h, w, ids, per_token, temperature=temperature, cu_seqlens=cu, loss_type="dapo",
                                     epsilon_low=0.2, epsilon_high=0.28, impl=impl)  # fmt: skip
    loss.backward()
    return logps.detach().double(), loss.detach().double(), h.grad.double(), w.grad.double()


def errors(got, truth) -> dict:
    out = {}
    for name, x, t in zip(("logps", "loss", "d_hidden", "d_head"), got, truth, strict=True):
        out[name] = ((x - t).abs().max() / t.abs().max().clamp_min(1e-300)).item()
        if name.startswith("d_"):
            out[name + "_scale_bias"] = ((x * t).sum() / (t * t).sum() - 1).item()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2-135m")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simd_accuracy.md")
    args = parser.parse_args(argv)
    bad = [m for m in args.models.split(",") if m not in RUNS]
    if bad:
        raise SystemExit(f"simd-accuracy: unknown --models {', '.join(bad)} (known: {', '.join(RUNS)})")
    if not cpu.simd_enabled():
        raise SystemExit("simd-accuracy: this CPU has no AVX-512: there is only one C++ path to measure")
    lines = ["# This package's CPU paths against float64 on a real training batch", "",
             f"Command: `python -m benchmarks.ops.simd_accuracy --models {args.models}` on {device_name('cpu')}, torch "
             f"{torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()})", "",
             "Largest error relative to the largest value; scale bias = <x, truth> / |truth|^2 - 1.", "",
             "| model | tokens | path | log-probs | loss | d hidden | d head | d hidden scale bias | "
             "d head scale bias | advantages |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in args.models.split(","):
        h, w, ids, cu, rewards, g, temperature = batch(name)
        adv64 = reference.group_advantages(rewards.double(), group_size=g).advantages
        truth = run_ops(h.double(), w.double(), ids, cu, adv64, temperature, "reference")
        for label, impl, on in (("C++ AVX-512 on", "cpp", True), ("C++ AVX-512 off", "cpp", False),
                                ("eager float32", "reference", True)):  # fmt: skip
            cpu.simd(on)
            try:
                adv = group_advantages(rewards.float(), group_size=g).advantages if impl == "cpp" else adv64.float()
                e = errors(run_ops(h.float(), w.float(), ids, cu, adv, temperature, impl), truth)
                a = ((adv.double() - adv64).abs().max() / adv64.abs().max()).item() if impl == "cpp" else float("nan")
            finally:
                cpu.simd(True)
            lines.append(f"| {name} | {ids.numel()} | {label} | {e['logps']:.2e} | {e['loss']:.2e} | "
                         f"{e['d_hidden']:.2e} | {e['d_head']:.2e} | {e['d_hidden_scale_bias']:+.1e} | "
                         f"{e['d_head_scale_bias']:+.1e} | {a:.2e} |")  # fmt: skip
        print(lines[-3:], flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
