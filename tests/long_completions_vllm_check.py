"""VLLMSampler with long completions and truncation flags on the tiny model, for tests/test_long_completions.py,
which runs it in a subprocess (vLLM is slow to start and changes process-wide state). Prints one line, MARKER +
JSON results; the test asserts on them.

    python tests/long_completions_vllm_check.py WORK_DIR

The model is the tiny decoder with <eos> all but ruled out (`rule_out_eos`), so that completions run to the limit.
"""

import json
import os
import sys
import time

import torch

MARKER = "long-completions-vllm-check: "
LONG, SHORT, G, MARGIN = 400, 5, 2, 5
TEXTS = ["1+1", "reverse:abc="]  # 4 and 13 tokens
STOPS = list(range(3, 20))  # a third of the tiny vocabulary: short completions end at one about half of the time


def rule_out_eos(model, eos_id: int) -> None:
    """Make <eos> all but impossible to sample after a context without it. Hidden dimension 0 of every token's (tied)
    embedding becomes 1, which dominates the random-init residual stream, so the final norm outputs a large positive
    value there (about sqrt(hidden)); in the output rows it shifts every logit alike (softmax ignores that) except
    that of <eos>, whose row gets -1 there: its logit lies about 2 sqrt(hidden) below the others. The model samples
    the other tokens about uniformly."""
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = 1.0
        embedding[eos_id, 0] = -1.0


def main(work_dir: str) -> dict:
    from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"vllm_import_error": str(exc)}
    from grpo_kernels.train.model.hf import save_hf_model
    from grpo_kernels.train.rollout.vllm_sampler import VLLMSampler

    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size, attn_implementation="sdpa", seed=0).eval()
    rule_out_eos(model, tok.eos_id)
    directory = save_hf_model(model, os.path.join(work_dir, "model"))
    prompts = [tok.encode_prompt(text) for text in TEXTS]
    # The short prompt's completions end at max_new_tokens, the long one's MARGIN tokens earlier, at max_model_len.
    max_model_len = max(map(len, prompts)) + LONG - MARGIN
    start = time.perf_counter()
    sampler = VLLMSampler(directory, eos_id=tok.eos_id, max_new_tokens=LONG, max_model_len=max_model_len)
    startup_s = time.perf_counter() - start
    engine_max_model_len = sampler.llm.llm_engine.model_config.max_model_len
    start = time.perf_counter()
    long = sampler.sample(prompts, G, seeds=[1, 2])
    long_s = time.perf_counter() - start

    # Short completions with many stop ids: some end at one, some run to max_new_tokens.
    sampler.max_new_tokens, sampler.stop_ids = SHORT, [tok.eos_id, *STOPS]
    short = sampler.sample([tok.encode_prompt(f"{k}+{k}=") for k in range(8)], 4, seeds=list(range(10, 18)))
    return {
        "max_new_tokens": LONG,
        "max_model_len": max_model_len,
        "engine_max_model_len": engine_max_model_len,
        "long_prompt_lengths": [len(p) for p in long.prompt_ids],
        "long_lengths": [len(c) for c in long.completion_ids],
        "long_truncated": long.truncated,
        "short_max_new_tokens": SHORT,
        "short_completions": [c.tolist() for c in short.completion_ids],
        "short_truncated": short.truncated,
        "stop_ids": [tok.eos_id, *STOPS],
        "startup_s": startup_s,
        "long_sample_s": long_s,
    }


if __name__ == "__main__":
    print(MARKER + json.dumps(main(sys.argv[1])), flush=True)
