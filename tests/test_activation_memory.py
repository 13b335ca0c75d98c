"""model.activation_checkpointing = "auto": the activation estimate against SmolLM2-135M's measured long-chain steps,
the choice at both ends of the budget (none when it fits, blocks when only it fits, a one-line refusal when one
completion does not fit), and a training run that logs its choice."""

import json

import pytest
import torch
import transformers

from grpo_kernels.cli import main
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.model.activation import activation_bytes, choose_checkpointing

SMOLLM2 = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # fmt: skip
GIB = 2**30


def test_estimates_match_the_measured_slopes_and_order_the_modes():
    # benchmarks/results/long_chains: SmolLM2 fp32 with block checkpointing, 127.7 kB per token over the rows of at
    # least 8,000 tokens; with the MLP tiled at 512, 93.7 kB (8 x 1000, 2000 and 4000 tokens)
    tokens = 16113
    per_token = {m: activation_bytes(m, SMOLLM2, dtype_bytes=4, tokens=tokens) / tokens
                 for m in ("none", "selective", "blocks", "offload")}  # fmt: skip
    assert per_token["blocks"] == pytest.approx(127.7e3, rel=0.05)
    tiled = activation_bytes("blocks", SMOLLM2, dtype_bytes=4, tokens=tokens, mlp_tile_tokens=512) / tokens
    assert tiled == pytest.approx(93.7e3, rel=0.05)
    # selective: 789 kB per token fitted over 8 x 250 to 8 x 1000 tokens; none: 1,428 kB (the estimate is above it)
    assert per_token["selective"] == pytest.approx(789e3, rel=0.1)
    assert per_token["none"] == pytest.approx(1.23 * 1428e3, rel=0.02)  # not in the fit: 23 % above
    assert per_token["none"] > per_token["selective"] > per_token["blocks"] > per_token["offload"] > 0
    assert activation_bytes("blocks", SMOLLM2, dtype_bytes=2, tokens=tokens) == pytest.approx(
        activation_bytes("blocks", SMOLLM2, dtype_bytes=4, tokens=tokens) / 2)


@pytest.mark.parametrize("budget_gib, mode", [(100, "none"), (4, "selective"), (2, "part"), (1, "part"),
                                              (0.6, "blocks")])  # fmt: skip
def test_auto_takes_the_fastest_mode_that_fits(budget_gib, mode):
    # 4096 tokens of SmolLM2 fp32: none 6.7 GiB, selective 2.9, blocks 0.49 (see the line); between selective and
    # blocks, "blocks" on the fewest first blocks that fit, the last ones keeping their activations
    chosen, blocks, line = choose_checkpointing(SMOLLM2, budget=budget_gib * GIB, tokens=4096, completion_tokens=64,
                                                dtype_bytes=4)  # fmt: skip
    assert f"budget {budget_gib:.2f}" in line
    if mode != "part":
        assert (chosen, blocks) == (mode, 0 if mode == "none" else 30) and f'"auto": "{mode}" (' in line
        return

    def est(n):
        return activation_bytes("blocks", SMOLLM2, dtype_bytes=4, tokens=4096, checkpointed=n)

    assert chosen == "blocks" and 0 < blocks < 30 and est(blocks) <= budget_gib * GIB < est(blocks - 1)
    assert f'"auto": "blocks" on the first {blocks} of 30 decoder blocks, the last {30 - blocks} keeping' in line


def test_the_partial_estimate_runs_from_none_to_blocks():
    def est(n, mode="blocks"):
        return activation_bytes(mode, SMOLLM2, dtype_bytes=4, tokens=4096, checkpointed=n)

    steps = [est(n) - est(n + 1) for n in range(30)]
    assert est(30) == activation_bytes("blocks", SMOLLM2, dtype_bytes=4, tokens=4096)
    # counted with the recompute's working set: one checkpointed block saves less than that, so "none" comes first
    assert est(0) > est(1) > activation_bytes("none", SMOLLM2, dtype_bytes=4, tokens=4096)
    assert min(steps) == pytest.approx(max(steps)) and steps[0] > 0  # each checkpointed block saves the same
    with pytest.raises(ValueError, match=r"checkpointed must be in \[0, 30\]"):
        est(31)


def test_auto_warns_when_only_one_completion_fits_and_refuses_when_not_even_that():
    mode, blocks, line = choose_checkpointing(SMOLLM2, budget=0.25 * GIB, tokens=4096, completion_tokens=512,
                                              dtype_bytes=4)  # fmt: skip
    assert (mode, blocks) == ("blocks", 30) and "may not fit" in line and "lower packing.token_budget" in line
    with pytest.raises(ValueError, match=r"model.activation_memory_gb: an activation budget of 0.01 GiB cannot hold "
                                         r"one completion of 512 tokens"):  # fmt: skip
        choose_checkpointing(SMOLLM2, budget=0.01 * GIB, tokens=4096, completion_tokens=512, dtype_bytes=4)


def test_auto_is_the_default_and_the_budget_is_checked():
    config = load_config()
    assert config.model.activation_checkpointing == "auto" and config.model.activation_memory_gb is None
    assert load_config(overrides=["--model.activation_memory_gb=12"]).model.activation_memory_gb == 12.0
    for bad in ("0", "-1", "inf"):
        with pytest.raises(ValueError, match="model.activation_memory_gb must be a (positive )?finite number"):
            load_config(overrides=[f"--model.activation_memory_gb={bad}"])


def _run(tmp_path, *extra):
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=1", "--sampling.group_size=4",
          "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=4", "--task.name=add",
          "--task.sft_warmup_steps=2", "--task.num_eval_prompts=4", "--packing.token_budget=64", *extra])  # fmt: skip
    return run


def test_a_run_logs_its_choice_and_refuses_a_budget_below_one_completion(tmp_path, capsys):
    run = _run(tmp_path / "big", "--model.activation_memory_gb=1")
    assert 'model.activation_checkpointing = "auto": "none"' in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0]
    _run(tmp_path / "small", "--model.activation_memory_gb=0.0001")  # 107 kB: blocks holds 4 tokens, not 64
    assert '"auto": "blocks", but a full micro-batch of 64 tokens may not fit' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="model.activation_memory_gb: an activation budget of 0.00 GiB cannot hold "
                                         "one completion of 4 tokens"):  # fmt: skip
        _run(tmp_path / "none", "--model.activation_memory_gb=0.00001")


def test_a_run_whose_budget_holds_a_few_blocks_checkpoints_only_the_first_ones(tmp_path, capsys, monkeypatch):
    import grpo_kernels.train.model.activation as activation
    from grpo_kernels.train.data.tasks import tiny_model

    tiny = tiny_model(97, num_layers=4).config  # the sizes that matter here do not depend on the vocabulary

    def est(n):
        return activation_bytes("blocks", tiny, dtype_bytes=4, tokens=64, checkpointed=n)

    assert est(3) < activation_bytes("selective", tiny, dtype_bytes=4, tokens=64)
    applied = []
    real = activation.checkpoint_blocks
    monkeypatch.setattr(activation, "checkpoint_blocks", lambda blocks, mode: (applied.append((len(blocks), mode)),
                                                                                real(blocks, mode)))  # fmt: skip
    _run(tmp_path, "--model.num_layers=4", f"--model.activation_memory_gb={(est(3) + est(2)) / 2 / GIB}")
    assert '"auto": "blocks" on the first 3 of 4 decoder blocks, the last 1 keeping' in capsys.readouterr().out
    assert applied == [(3, "blocks")]


def test_the_cpu_budget_is_shared_by_the_ranks_on_the_host(monkeypatch):
    from grpo_kernels.train.model.activation import activation_budget

    model = torch.nn.Linear(10, 10)  # 110 parameters: 1,320 bytes of gradients and moments to come
    assert activation_budget(model, torch.device("cpu"), 2.0) == 2 * GIB
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = activation_budget(model, torch.device("cpu"), None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four = activation_budget(model, torch.device("cpu"), None)
    assert one > 0 and (four + 1320) == pytest.approx((one + 1320) / 4, rel=0.05)  # MemAvailable moves a little


def test_apply_refuses_an_unknown_mode_naming_the_option_before_touching_the_model():
    from grpo_kernels.train.data.tasks import tiny_model
    from grpo_kernels.train.model import activation

    model = tiny_model(97, num_layers=2)
    forwards = [block.forward for block in model.base_model.layers]
    with pytest.raises(ValueError, match=r"mode \(model.activation_checkpointing\) must be one of 'none', 'auto'"):
        activation.apply(model, mode="everything", tokens=64, completion_tokens=8, dtype_bytes=4)
    assert [block.forward for block in model.base_model.layers] == forwards
    assert activation.apply(model, mode="blocks", tokens=64, completion_tokens=8, dtype_bytes=4)[:2] == ("blocks", 2)
