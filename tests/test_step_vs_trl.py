"""Our trainer's step against TRL's on the same batch: `grpo_step` (packed, shared prefix, the fused LM-head loss,
grad clip, the optimizer) given the completions, rewards and prompts of one trl.GRPOTrainer step must make the same
parameter update and compute the same advantages. What is left for a whole run to differ in is then the sampler's
random stream (tests/test_learning_vs_trl.py, benchmarks/learning/vs_trl.py).

TRL samples with the scripted stand-in of tests/test_trl_dropin.py (a pure function of the prompts); its own code
does the rest. SGD keeps the update proportional to the gradient."""

import dataclasses

import pytest
import torch
from helpers import assert_close

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from test_trl_dropin import _one_thread, make_trainer, model_dir, reward, tiny_config  # noqa: E402, F401

from grpo_kernels.attention import register_hf_attention  # noqa: E402
from grpo_kernels.train.rollout.batch import Rollout  # noqa: E402
from grpo_kernels.train.step import grpo_step  # noqa: E402

LR = 0.5


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny Qwen2 with its LM head tied to the embedding, as SmolLM2's."""
    path = tmp_path_factory.mktemp("tiny_qwen2_tied")
    config = tiny_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def trl_step(model_dir, loss_type, temperature=1.0):  # noqa: F811
    """(the inputs TRL's loss saw, TRL's parameter update) of one TRL step."""
    trainer = make_trainer(trl.GRPOTrainer, model_dir, lr=LR, loss_type=loss_type, temperature=temperature)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    seen, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    assert len(seen) == 1  # one generation, one optimizer step
    update = {k: p.detach() - before[k] for k, p in trainer.model.named_parameters()}
    return seen[0], update


@pytest.mark.parametrize("loss_type, tied, temperature", [("dapo", False, 1.0), ("grpo", False, 1.0),
                                                          ("dapo", True, 0.7), ("grpo", True, 0.7)],
                         ids=["dapo-untied", "grpo-untied", "dapo-tied_head-T0.7", "grpo-tied_head-T0.7"])
def test_grpo_step_on_trls_batch_makes_trls_update(model_dir, tied_model_dir, loss_type, tied, temperature):  # noqa: F811
    model_dir = tied_model_dir if tied else model_dir
    inputs, want = trl_step(model_dir, loss_type, temperature)
    prompts = [ids[mask.bool()] for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)]
    completions = [ids[mask.bool()] for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"],
                                                         strict=True)]  # fmt: skip
    # TRL shuffles the rows of its generation batch: the groups again (the batch's prompts are distinct)
    first = {}
    for i, p in enumerate(prompts):
        first.setdefault(tuple(p.tolist()), i)
    order = sorted(range(len(prompts)), key=lambda i: (first[tuple(prompts[i].tolist())], i))
    assert len(first) == 2 and len(order) == 8
    prompts, completions = [prompts[i] for i in order], [completions[i] for i in order]
    rollout = Rollout(prompt_ids=prompts, completion_ids=completions,
                      sampler_logps=[torch.zeros(len(c)) for c in completions], group_size=4)  # fmt: skip
    rollout = rollout.with_rewards(reward([c.tolist() for c in completions]))
    # TRL divides by std + 1e-4, the kernel by std + 1e-6: equal to ~1e-4 of the advantage
    assert_close(rollout.advantages.advantages, inputs["advantages"][order].float(), name="advantages", rtol=1e-3,
                 atol=1e-5)  # the difference alone moves the update by ~2e-4 of its largest element
    # the step on TRL's own advantages: what is compared below is the step alone
    trls = inputs["advantages"][order].float()
    rollout = dataclasses.replace(rollout, advantages=rollout.advantages._replace(advantages=trls))
    register_hf_attention()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="grpo_varlen")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grpo_step(model, optimizer, rollout, loss_options={"loss_type": loss_type, "epsilon_low": 0.2,
                                                       "epsilon_high": 0.28, "beta": 0.0},
              temperature=temperature, token_budget=64, shared_prefix=True, grad_clip=1.0)  # fmt: skip
    got = torch.cat([(p.detach() - before[k]).flatten() for k, p in model.named_parameters()])
    want = torch.cat([want[k].flatten() for k, _ in model.named_parameters()])
    scale = want.abs().max()
    assert scale > 0
    assert_close(got / scale, want / scale, name="parameter update / max |update|", rtol=0, atol=1e-5)
