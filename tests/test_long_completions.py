"""Long completions end to end: a completion that cannot fit the model is one error line at load, the samplers get
max_model_len and flag exactly the completions cut at the token limit, masking them out of the loss gives TRL's
loss and gradient for every loss type, and a step logs its length and packing metrics.

The vLLM check runs in a subprocess (tests/long_completions_vllm_check.py); without an importable vllm it skips, or
fails when GRPO_REQUIRE_VLLM=1.
"""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import run_vllm_check

from grpo_kernels import reference
from grpo_kernels.cli import main
from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model import lengths
from grpo_kernels.train.model.fsdp import SINGLE
from grpo_kernels.train.model.policy import completion_logprobs
from grpo_kernels.train.rollout.batch import Rollout
from grpo_kernels.train.rollout.hf_sampler import HFSampler
from grpo_kernels.train.step import grpo_step

sys.path.insert(0, str(Path(__file__).parent))
from long_completions_vllm_check import MARKER, rule_out_eos  # noqa: E402

V = CharTokenizer().vocab_size


def _train_error(tmp_path, *args) -> str:
    """The one-line error of `grpo-kernels train` with these options; checks that nothing was written."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", f"--logging.run_dir={run}", *args])
    message = str(info.value.code)
    assert message.startswith("grpo-kernels train: error:") and "\n" not in message, message
    assert not run.exists()
    return message


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--sampling.max_new_tokens=1100", "--packing.token_budget=4096"],
         "exceeds the max_position_embeddings (1024) of model tiny: lower sampling.max_new_tokens"),
        (["--sampling.max_model_len=20"], "sampling.max_model_len (20) is smaller than the longest prompt"),
        (["--sampling.max_model_len=2048"], "sampling.max_model_len (2048) exceeds the max_position_embeddings (1024)"),
        (["--sampling.max_model_len=16"], "sampling.max_model_len (16) must exceed sampling.max_new_tokens (16)"),
    ],
)  # fmt: skip
def test_a_completion_that_cannot_fit_is_one_error_line_at_load_and_nothing_written(tmp_path, args, expected):
    assert expected in _train_error(tmp_path, *args)


def test_the_model_length_check_names_the_options_and_resolves_max_model_len():
    ok = dict(longest_prompt=60, max_new_tokens=8000, position_limit=8192, model="m")
    assert lengths.check_model_len(max_model_len=None, **ok) == 8060
    assert lengths.check_model_len(max_model_len=8192, **ok) == 8192
    with pytest.raises(ValueError, match=r"sampling.max_new_tokens \(8192\) = 8252 tokens exceeds"):
        lengths.check_model_len(**{**ok, "max_new_tokens": 8192}, max_model_len=None)
    with pytest.raises(ValueError, match=r"sampling.max_model_len \(8000\) is smaller"):
        lengths.check_model_len(max_model_len=8000, **ok)
    assert lengths.check_model_len(**{**ok, "position_limit": None}, max_model_len=None) == 8060
    llama = transformers.LlamaConfig(max_position_embeddings=8192)
    assert lengths.position_limit(llama) == 8192


def test_kv_cache_arithmetic_of_smollm2():
    """SmolLM2-135M: 30 layers, 3 kv heads of 64 -> 45 KiB a token in float32; 1 GiB holds 23,301 tokens."""
    config = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3)  # fmt: skip
    assert lengths.kv_cache_bytes_per_token(config, "float32") == 46080
    assert lengths.kv_cache_bytes_per_token(config, "bfloat16") == 23040
    assert int(2**30 / lengths.kv_cache_bytes_per_token(config)) == 23301
    assert lengths.kv_cache_gib(config, 8 * 8060) == pytest.approx(2.767, abs=1e-3)
    short = dict(group_size=8, max_model_len=8060, dtype="float32")
    assert "holds 2.9 sequences" in lengths.kv_cache_shortfall(config, **short, space_gib=1.0)
    assert "set VLLM_CPU_KVCACHE_SPACE=3" in lengths.kv_cache_shortfall(config, **short, space_gib=1.0)
    assert lengths.kv_cache_shortfall(config, **short, space_gib=3.0) == ""


def test_the_samplers_get_the_longest_prompt_plus_max_new_tokens_as_max_model_len(monkeypatch):
    from grpo_kernels.train import build
    from grpo_kernels.train.rollout import colocated, vllm_sampler

    seen = {}

    class Engine:
        def __init__(self, directory, **options):
            seen.update(options)

        def load_weights(self, weights):  # the trainer's weights, handed over before the first sample
            seen["weights"] = dict(weights)

    monkeypatch.setattr(vllm_sampler, "VLLMSampler", Engine)
    for extra, given in (([], None), (["sampling.max_model_len=500"], 500)):
        config = load_config(None, ["sampling.sampler=vllm", "sampling.max_new_tokens=300",
                                    "packing.token_budget=1024", "task.num_train_prompts=16", *extra])  # fmt: skip
        inputs = build.load(config)
        tok, train_set, eval_set, model = inputs.tok, inputs.train_set, inputs.eval_set, inputs.model
        longest = max(len(tok.encode_prompt(e.prompt)) for e in train_set + eval_set)
        colocated.make_sampler(config, model, tok, SINGLE)
        assert seen["max_model_len"] == (given or longest + 300) and seen["max_new_tokens"] == 300


def test_the_hf_sampler_flags_exactly_the_completions_cut_at_max_new_tokens():
    tok = CharTokenizer()
    stops = set(range(3, 20)) | {tok.eos_id}  # a third of the vocabulary: about half the completions stop early
    sampler = HFSampler(tiny_model(V, seed=2), eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=5,
                        stop_ids=sorted(stops))  # fmt: skip
    r = sampler.sample([tok.encode_prompt(f"{k}+{k}=") for k in range(8)], 4, seeds=list(range(8)))
    assert len(r.truncated) == 32 and 0 < sum(r.truncated) < 32
    for c, cut in zip(r.completion_ids, r.truncated, strict=True):
        c = c.tolist()
        assert cut == (c[-1] not in stops)
        assert not stops & set(c[:-1]) and (len(c) == 5 if cut else len(c) <= 5)
    # the flags travel with their completions
    assert r.select([3, 1]).truncated == r.truncated[12:16] + r.truncated[4:8]
    assert Rollout.concat([r.select([1]), r.select([0])]).truncated == r.truncated[4:8] + r.truncated[:4]
    scored = r.with_rewards(torch.rand(32)).mask_truncated()
    assert scored.truncated == r.truncated and scored.masked == r.truncated
    assert scored.select([2]).masked == r.truncated[8:12]


def test_the_hf_sampler_runs_long_completions_to_the_limit_and_scores_them_as_the_trainer():
    tok = CharTokenizer()
    model = tiny_model(V, seed=0)
    rule_out_eos(model, tok.eos_id)
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=300)
    r = sampler.sample([tok.encode_prompt("12+30=")], 2, seeds=[1])
    assert [len(c) for c in r.completion_ids] == [300, 300] and r.truncated == [True, True]
    logps = completion_logprobs(model, pack_sequences(r.prompt_ids, r.completion_ids), temperature=1.0)
    assert (logps - torch.cat(r.sampler_logps)).abs().max() < 1e-4


def _rollout(lengths_, truncated, prompt_lengths, *, g):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=gen) for n in prompt_lengths]
    return Rollout(prompt_ids=[prompts[i // g] for i in range(len(lengths_))],
                   completion_ids=[torch.randint(3, V, (n,), generator=gen) for n in lengths_],
                   sampler_logps=[torch.zeros(n) for n in lengths_], group_size=g,
                   truncated=truncated)  # fmt: skip


def _padded_reference(model, rollout, mask_rows, temperature, **options):
    """reference.grpo_loss on the padded [B, L] batch with mask rows (TRL's completion mask), differentiated into
    model's gradients."""
    packed = pack_sequences(rollout.prompt_ids, rollout.completion_ids)
    h = model.base_model(**packed.model_kwargs()).last_hidden_state[0][packed.logit_rows]
    logps = torch.log_softmax(model.get_output_embeddings()(h).float() / temperature, -1)
    logps = logps.gather(-1, packed.completion_ids[:, None])[:, 0]
    cu, longest = packed.completion_cu_seqlens.long(), max(len(c) for c in rollout.completion_ids)
    rows = [logps[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
    padded = torch.stack([torch.cat([x, x.new_zeros(longest - len(x))]) for x in rows])
    mask = torch.stack([torch.cat([torch.full((len(x),), float(keep)), torch.zeros(longest - len(x))])
                        for x, keep in zip(rows, mask_rows, strict=True)])  # fmt: skip
    loss, _ = reference.grpo_loss(padded, None, rollout.advantages.advantages, mask=mask, **options)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    "loss_type,level",
    [("grpo", "token"), ("grpo", "sequence"), ("dapo", "token"), ("cispo", "token"), ("vespo", "sequence"),
     ("bnpo", "token"), ("dr_grpo", "token"), ("sapo", "token"), ("luspo", "sequence")],
)  # fmt: skip
def test_masking_truncated_completions_gives_trls_loss_and_gradient(loss_type, level):
    """grpo_step with the truncated completions masked = reference.grpo_loss on the padded batch with TRL's mask
    (completion mask x not truncated; num_items_in_batch = its sum): a group that is all truncated included.
    bnpo/dr_grpo normalize per micro-batch (TRL's gradient accumulation), so they are checked on one."""
    model = tiny_model(V, seed=1)
    truncated = [False, True, False, True] + [True] * 4 + [False, False, True, False]
    rollout = _rollout([5, 9, 3, 9, 9, 9, 9, 9, 2, 7, 9, 4], truncated, [4, 6, 3], g=4)
    rollout = rollout.with_rewards(torch.rand(12, generator=torch.Generator().manual_seed(1))).mask_truncated()
    options = dict(loss_type=loss_type, importance_sampling_level=level,
                   max_completion_length=9 if loss_type == "dr_grpo" else None)  # fmt: skip
    budget = 1000 if loss_type in ("bnpo", "dr_grpo") else 24
    policy = copy.deepcopy(model)
    metrics = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), rollout, loss_options=options,
                        temperature=0.9, token_budget=budget, grad_clip=None)  # fmt: skip
    assert metrics["micro_batches"] == (1 if budget == 1000 else 7)
    grad = torch.cat([p.grad.flatten() for p in policy.parameters()])
    want_loss, want_grad = _padded_reference(copy.deepcopy(model), rollout, [not t for t in truncated], 0.9,
                                             **options)  # fmt: skip
    assert abs(metrics["loss"] - want_loss) <= 1e-6 * abs(want_loss) + 1e-8, (metrics["loss"], want_loss)
    assert (grad - want_grad).norm() <= 1e-6 * want_grad.norm(), float((grad - want_grad).norm() / want_grad.norm())
    unmasked, _ = _padded_reference(copy.deepcopy(model), rollout, [True] * 12, 0.9, **options)
    assert abs(unmasked - want_loss) > 1e-3 * abs(want_loss)  # the mask changes the loss: the check can fail


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_fully_truncated_batch_has_loss_zero_and_no_gradient(loss_type):
    model = tiny_model(V, seed=1)
    rollout = _rollout([6, 6, 6, 6], [True] * 4, [3, 5], g=2).with_rewards([1.0, 0.0, 0.0, 1.0]).mask_truncated()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.1), rollout,
                        loss_options=dict(loss_type=loss_type), temperature=1.0, token_budget=16)  # fmt: skip
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0 and metrics["truncated_fraction"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_the_step_logs_length_and_packing_metrics_of_a_hand_checkable_rollout(shared_prefix):
    """Group 0: prompt 3, completions 2 and 6; group 1: prompt 4, completions 5 and 1 (the second one truncated).
    Plain packing holds 3+2 + 3+6 + 4+5 + 4+1 = 28 tokens, shared-prefix packing 3+2+6 + 4+5+1 = 21, in 2
    micro-batches of budget 16."""
    rollout = _rollout([2, 6, 5, 1], [False, False, False, True], [3, 4], g=2).with_rewards([1.0, 0.0, 0.0, 1.0])
    model = tiny_model(V, seed=1)
    metrics = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rollout, loss_options={},
                        temperature=1.0, token_budget=16, shared_prefix=shared_prefix)  # fmt: skip
    assert metrics["micro_batches"] == 2
    assert (metrics["completion_length_min"], metrics["completion_length_median"],
            metrics["completion_length_max"]) == (1.0, 3.5, 6.0)  # fmt: skip
    assert metrics["truncated_fraction"] == 0.25
    assert metrics["packing_efficiency"] == (21 if shared_prefix else 28) / 32
    assert lengths.packing_efficiency(28, token_budget=16, micro_batches=1, world=2) == 28 / 32


def test_a_short_run_with_long_completions_logs_the_length_metrics(tmp_path):
    run = tmp_path / "run"
    main(["train", f"--logging.run_dir={run}", "--optim.steps=2", "--task.name=add", "--sampling.group_size=2",
          "--sampling.prompts_per_step=2", "--sampling.max_new_tokens=300", "--packing.token_budget=1024",
          "--sampling.mask_truncated_completions=true", "--task.num_train_prompts=8", "--task.num_eval_prompts=2",
          "--sampling.temperature=0.7"])  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 1 <= r["completion_length_min"] <= r["completion_length_median"] <= r["completion_length_max"] <= 300
        assert 0 <= r["truncated_fraction"] <= 1 and 0 < r["packing_efficiency"] <= 1 and r["loss"] == r["loss"]
    assert "mask_truncated_completions = true" in (run / "config.toml").read_text()
    assert "max_model_len" not in (run / "config.toml").read_text()  # none, the default: left out
    main(["plot", str(run)])
    assert (run / "lengths.png").stat().st_size > 0


@pytest.fixture(scope="module")
def vllm_check(tmp_path_factory):
    script = Path(__file__).with_name("long_completions_vllm_check.py")
    return run_vllm_check(script, tmp_path_factory.mktemp("vllm"), MARKER, timeout=600)


@pytest.mark.slow
def test_vllm_samples_long_completions_within_max_model_len_and_flags_the_truncated(vllm_check):
    c = vllm_check
    assert c["engine_max_model_len"] == c["max_model_len"]  # not the model's 1024 positions
    # the short prompt's completions run to max_new_tokens, the long prompt's to max_model_len: all truncated
    n, cap = c["max_new_tokens"], c["max_model_len"]
    assert c["long_lengths"] == [min(n, cap - p) for p in c["long_prompt_lengths"]]
    assert len(set(c["long_lengths"])) == 2 and c["long_truncated"] == [True] * 4
    stops, flags = set(c["stop_ids"]), c["short_truncated"]
    assert 0 < sum(flags) < len(flags)
    for ids, cut in zip(c["short_completions"], flags, strict=True):
        assert cut == (ids[-1] not in stops) and not stops & set(ids[:-1])
        assert len(ids) == c["short_max_new_tokens"] if cut else len(ids) <= c["short_max_new_tokens"]
