"""The HF sampler and one GRPO step on the tiny model: the sampler's log-probs are the trainer's, and a step moves
the policy toward positive advantages."""

import pytest
import torch

from grpo_kernels import group_advantages
from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.data.tasks import CharTokenizer, make_task, tiny_model
from grpo_kernels.train.model.policy import completion_logprobs
from grpo_kernels.train.rollout.hf_sampler import HFSampler
from grpo_kernels.train.step import grpo_step, sft_warmup


@pytest.fixture(scope="module")
def setup():
    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size, seed=3)
    task = make_task("add", difficulty=1)
    losses = sft_warmup(model, tok, task, steps=20, batch_size=16)
    assert losses[-1] < losses[0]
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, max_new_tokens=5)
    prompts = [tok.encode(e.prompt, bos=True) for e in task.examples(6, seed=1)]
    return tok, model, sampler, sampler.sample(prompts, 4, seeds=list(range(5, 11)))


def test_rollout_shapes_and_reproducibility(setup):
    tok, _, sampler, rollout = setup
    assert len(rollout.completion_ids) == 24 and rollout.group_size == 4
    for c, lp in zip(rollout.completion_ids, rollout.sampler_logps, strict=True):
        assert 1 <= c.numel() <= 5 and lp.shape == c.shape and bool((lp <= 0).all())
        assert tok.eos_id not in c[:-1].tolist()
    again = sampler.sample([rollout.prompt_ids[0].tolist()], 4, seeds=[5])
    assert [c.tolist() for c in again.completion_ids] == [c.tolist() for c in rollout.completion_ids[:4]]


def test_sampler_logps_are_the_trainers(setup):
    _, model, _, rollout = setup
    packed = pack_sequences(rollout.prompt_ids, rollout.completion_ids)
    trainer = completion_logprobs(model, packed, temperature=1.0)
    assert (trainer - torch.cat(rollout.sampler_logps)).abs().max() < 1e-4


def test_a_step_moves_log_probs_toward_positive_advantages(setup):
    _, model, _, rollout = setup
    rewards = torch.tensor([float(c.numel() % 2 == 0) for c in rollout.completion_ids])  # any non-constant reward
    if group_advantages(rewards, group_size=4).invalid_fraction == 1:
        rewards[::2] = 1 - rewards[::2]
    adv = group_advantages(rewards, group_size=4).advantages
    packed = pack_sequences(rollout.prompt_ids, rollout.completion_ids)
    cu = packed.completion_cu_seqlens.long()

    def seq_logps():
        lp = completion_logprobs(model, packed, temperature=1.0)
        return torch.stack([lp[cu[i] : cu[i + 1]].sum() for i in range(len(cu) - 1)])

    before = seq_logps()
    weights = [p.detach().clone() for p in model.parameters()]
    metrics = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.05), rollout.with_rewards(rewards),
                        loss_options=dict(loss_type="dapo"), temperature=1.0, token_budget=64)  # fmt: skip
    assert metrics["micro_batches"] > 1  # the budget forces gradient accumulation
    assert all(map(lambda v: v == v, metrics.values())) and metrics["grad_norm"] > 0
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert float((adv * (seq_logps() - before)).sum()) > 0


def test_the_step_reads_its_metrics_back_once_whatever_the_number_of_micro_batches(setup, monkeypatch):
    """grpo_step sums the loss and metrics as tensors and converts them once: the host reads it makes itself
    (item/float/int/bool/tolist called from step.py) stay at one as the token budget splits the batch further."""
    import copy
    import sys

    from grpo_kernels.train import step

    _, model, _, rollout = setup
    scored = rollout.with_rewards([float(i % 3 == 0) for i in range(len(rollout.completion_ids))])
    reads = []

    def counted(real):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == step.__file__:
                reads.append(sys._getframe(1).f_lineno)
            return real(self, *args, **kwargs)

        return read

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    counts = {}
    for budget in (1000, 64, 24):
        reads.clear()
        policy = copy.deepcopy(model)
        metrics = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.01), scored, num_iterations=2,
                            loss_options=dict(loss_type="grpo"), temperature=1.0, token_budget=budget,
                            compute_old_logps=True)  # fmt: skip
        counts[metrics["micro_batches"]] = len(reads)
    assert len(counts) == 3 and min(counts) == 1 and max(counts) >= 6, counts
    assert set(counts.values()) == {1}, counts


@pytest.mark.parametrize("name", ["gemma2_softcap", "cohere_scale", "qwen2_head_bias"])
def test_policy_log_probs_are_the_models_own_for_transformed_heads(name):
    """The trainer's fused head computes what the model's forward does: Gemma 2's final-logit soft-cap, Cohere's
    logit scale, and an LM head with a bias (each would be silently wrong if the head were taken as h W^T)."""
    import transformers

    common = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    config = {"gemma2_softcap": transformers.Gemma2Config(final_logit_softcapping=0.3, head_dim=16, **common),
              "cohere_scale": transformers.CohereConfig(logit_scale=0.5, **common),
              "qwen2_head_bias": transformers.Qwen2Config(**common)}[name]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if name == "qwen2_head_bias":
        head = torch.nn.Linear(32, 61, bias=True)
        torch.nn.init.normal_(head.bias, std=1.0)
        model.lm_head = head
    prompt, completion = torch.randint(0, 61, (5,)), torch.randint(0, 61, (7,))
    packed = pack_sequences([prompt], [completion])
    got = completion_logprobs(model, packed, temperature=0.7)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion])[None]).logits[0, 4:-1]
    want = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, completion[:, None])[:, 0]
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_batches_on_a_padded_attention_model_are_refused(setup, attn):
    """HF's packed-sequence detection splits at position 0 only, so with sdpa / eager the completions of a shared
    prompt attended to each other (log-probs off by ~7e-2, no error); the trainer refused the config, the
    low-level functions now refuse the batch. Plain packing on the same model stays exact."""
    tok, model, _, rollout = setup
    other = tiny_model(tok.vocab_size, seed=3, attn_implementation=attn)
    other.load_state_dict(model.state_dict())
    shared = pack_sequences(rollout.prompt_ids, rollout.completion_ids, shared_prefix=True,
                            group_ids=rollout.group_ids)  # fmt: skip
    with pytest.raises(ValueError, match=rf"shared-prefix packed batch needs attn_implementation='grpo_varlen'; "
                                         rf"this model runs '{attn}'"):  # fmt: skip
        completion_logprobs(other, shared, temperature=1.0)
    rewards = torch.tensor([float(i % 2) for i in range(len(rollout.completion_ids))])
    with pytest.raises(ValueError, match="shared-prefix packed batch"):
        grpo_step(other, torch.optim.SGD(other.parameters(), lr=0.0), rollout.with_rewards(rewards),
                  loss_options=dict(loss_type="dapo"), temperature=1.0, token_budget=64,
                  shared_prefix=True)  # fmt: skip
    plain = pack_sequences(rollout.prompt_ids, rollout.completion_ids)
    want = completion_logprobs(model, shared, temperature=1.0)
    assert (completion_logprobs(other, plain, temperature=1.0) - want).abs().max() < 1e-4


def test_the_steps_reward_std_and_entropy_are_the_quantities_trl_logs_under_those_names(setup):
    """reward_std: TRL's (the unbiased std of the step's rewards, trl's own nanstd); entropy: the mean entropy of the
    completion tokens under the policy before the update, the HF model's logits through the reference op."""
    import copy

    from trl.trainer.utils import nanstd

    from grpo_kernels import reference

    _, model, _, rollout = setup
    policy = copy.deepcopy(model)
    rewards = torch.tensor([float(i % 3 == 0) + 0.25 * (i % 5) for i in range(len(rollout.completion_ids))])
    with torch.no_grad():
        entropies = []
        for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True):
            logits = policy(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1]
            entropies.append(reference.selective_logprobs(logits, c, return_entropy=True)[1])
    metrics = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.01), rollout.with_rewards(rewards),
                        loss_options=dict(loss_type="dapo", return_entropy=True), temperature=1.0,
                        token_budget=1000)  # fmt: skip
    assert metrics["micro_batches"] == 1
    assert metrics["reward_std"] == pytest.approx(float(nanstd(rewards)), rel=1e-6)
    assert metrics["entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-5)
