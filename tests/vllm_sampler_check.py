"""VLLMSampler end to end on the tiny model, for tests/test_vllm_sampler.py, which runs it in a subprocess (vLLM is
slow to start and changes process-wide state). Prints one line, MARKER + JSON results; the test asserts on them.

    python tests/vllm_sampler_check.py WORK_DIR

The reference log-probs are the HF model's own: log_softmax(logits / T) gathered, in plain torch.
"""

import json
import logging
import os
import sys
import time

import torch

T, TOP_P, G, MAX_NEW = 0.8, 0.95, 4, 12
SEEDS = [11, 12, 13]
MARKER = "vllm-sampler-check: "
TEXTS = ["12+30=", "7+5=", "reverse:abc="]


def hf_logprobs(model, prompt, completion) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token under the HF model."""
    ids = torch.cat([torch.as_tensor(prompt), torch.as_tensor(completion)])
    with torch.no_grad():
        logits = model(ids[None]).logits[0, prompt.numel() - 1 : -1].float()
    return torch.log_softmax(logits / T, -1).gather(-1, ids[prompt.numel() :, None])[:, 0]


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def teach_eos(model, tok, steps=30):
    """A few AdamW steps on "prompt=answer<eos>" so that completions often end with <eos> (a random init rarely
    samples it), and the distributions are far from uniform."""
    from grpo_kernels.train.data.tasks import make_task

    examples = make_task("add", difficulty=2).examples(32, seed=0)
    batch = [torch.tensor(tok.encode(e.prompt + e.answer, bos=True, eos=True)) for e in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids = batch[step % len(batch)][None]
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def main(work_dir: str) -> dict:
    from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
    from grpo_kernels.train.model.hf import save_hf_model
    from grpo_kernels.train.rollout.vllm_sampler import VLLMSampler, quiet_routine_vllm_lines

    torch.manual_seed(0)
    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size, attn_implementation="sdpa", seed=0)
    teach_eos(model, tok)
    model.eval()
    directory = save_hf_model(model, os.path.join(work_dir, "model"))
    options = dict(eos_id=tok.eos_id, max_new_tokens=MAX_NEW, temperature=T, top_p=TOP_P, max_model_len=128)

    # Multiprocessing forced on is refused before any engine starts (vLLM's env values may be cached after one).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        VLLMSampler(directory, **options)
        multiprocessing_refused = False
    except ImportError as exc:
        return {"vllm_import_error": str(exc)}
    except ValueError as exc:
        multiprocessing_refused = "VLLM_ENABLE_V1_MULTIPROCESSING" in str(exc)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    start = time.perf_counter()
    sampler = VLLMSampler(directory, **options)
    # What vLLM shows at its default log level from here on (its handler hangs on the "vllm" logger, configured by
    # the engine's start: a handler added before it is dropped; tests/test_smollm2.py checks a run's whole output).
    shown = []
    capture = logging.Handler(logging.INFO)
    capture.emit = lambda record: shown.append(f"{record.levelname} {record.getMessage()}")
    logging.getLogger("vllm").addHandler(capture)
    startup_s = time.perf_counter() - start

    prompts = [tok.encode(text, bos=True) for text in TEXTS]
    start = time.perf_counter()
    rollout = sampler.sample(prompts, G, seeds=SEEDS)
    sample_s = time.perf_counter() - start
    again = sampler.sample(prompts, G, seeds=SEEDS)
    alone = sampler.sample([torch.tensor(prompts[1])], G, seeds=SEEDS[1:2])  # group 1 by itself
    as_lists = lambda r: [c.tolist() for c in r.completion_ids]
    # vLLM seeds a request's completions with seed, seed + 1, ...: seeds s and s + 1 must not share G - 1 of them.
    twice = as_lists(sampler.sample([prompts[0], prompts[0]], G, seeds=[7, 8]))
    consecutive_seeds_overlap = twice[G : 2 * G - 1] == twice[1:G]
    sample_vs_hf = max(
        max_diff(lp, hf_logprobs(model, p, c))
        for p, c, lp in zip(rollout.prompt_ids, rollout.completion_ids, rollout.sampler_logps, strict=True)
    )
    scored = sampler.sequence_logprobs(rollout.prompt_ids[0], rollout.completion_ids[0])

    # One optimizer step on the HF model: the sampler is stale until load_weights.
    fixed_prompt = torch.tensor(tok.encode("5+9=", bos=True))
    fixed_completion = torch.tensor(tok.encode("14", eos=True))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.cat([fixed_prompt, fixed_completion])[None]
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    reference = hf_logprobs(model, fixed_prompt, fixed_completion)
    before_sync = max_diff(sampler.sequence_logprobs(fixed_prompt, fixed_completion), reference)
    try:
        sampler.load_weights(dict(list(model.state_dict().items())[:5]))
        partial_refused = False
    except ValueError:
        partial_refused = True
    start = time.perf_counter()
    hidden_before = quiet_routine_vllm_lines()
    sampler.load_weights(model.state_dict())
    load_weights_s = time.perf_counter() - start
    hidden_by_sync = quiet_routine_vllm_lines() - hidden_before
    after_sync = max_diff(sampler.sequence_logprobs(fixed_prompt, fixed_completion), reference)
    after_sync_sampled = sampler.sample([fixed_prompt], G, seeds=[5])
    after_sync_sample_vs_hf = max(
        max_diff(lp, hf_logprobs(model, fixed_prompt, c))
        for c, lp in zip(after_sync_sampled.completion_ids, after_sync_sampled.sampler_logps, strict=True)
    )
    # The engine copied the weights: changing the HF model afterwards does not reach it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    unchanged = max_diff(sampler.sequence_logprobs(fixed_prompt, fixed_completion), reference)

    return {
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "group_size": rollout.group_size,
        "max_new_tokens": MAX_NEW,
        "num_prompts": len(prompts),
        "prompts_match": [p.tolist() for p in rollout.prompt_ids] == [p for p in prompts for _ in range(G)],
        "completions": as_lists(rollout),
        "logp_shapes_match": [lp.shape for lp in rollout.sampler_logps] == [c.shape for c in rollout.completion_ids],
        "logp_dtypes": sorted({str(lp.dtype) for lp in rollout.sampler_logps}),
        "logp_max": max(float(lp.max()) for lp in rollout.sampler_logps),
        "reproducible": as_lists(again) == as_lists(rollout)
        and all(map(torch.equal, again.sampler_logps, rollout.sampler_logps)),
        "group_alone_same": as_lists(alone) == as_lists(rollout)[G : 2 * G],
        "consecutive_seeds_overlap": consecutive_seeds_overlap,
        "sample_vs_hf": sample_vs_hf,
        "sequence_vs_sample": max_diff(scored, rollout.sampler_logps[0]),
        "before_sync": before_sync,
        "after_sync": after_sync,
        "after_sync_sample_vs_hf": after_sync_sample_vs_hf,
        "unchanged_after_hf_edit": unchanged,
        "partial_state_dict_refused": partial_refused,
        "multiprocessing_refused": multiprocessing_refused,
        "shown_log_lines": shown,
        "hidden_by_sync": hidden_by_sync,
        "startup_s": startup_s,
        "sample_s": sample_s,
        "load_weights_s": load_weights_s,
    }


if __name__ == "__main__":
    print(MARKER + json.dumps(main(sys.argv[1])), flush=True)
