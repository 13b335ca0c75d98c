"""FusedGRPOTrainer against trl.GRPOTrainer itself (same seeds, same completions), use_grpo_kernels, the options
that raise NotImplementedError, compute_logprobs against plain logits, and the loss step's peak memory.

Identical generations: sampling is the one random step the loss does not own, so both trainers get the same
sampler: `_generate_single_turn` is replaced on each *instance* by `scripted_generate`, a pure function of the
prompt ids that returns completions of varied lengths, some ending with EOS and some truncated at
max_completion_length. Everything after it is TRL's own code in both trainers (tokenizing, masks,
mask_truncated_completions, rewards, advantages, old and reference log-probs, buffering, the training step, the
SGD update); only `_compute_loss` differs. Both start from one saved tiny model, so the loss, the metrics TRL logs
and the parameter update must agree (fp32: bf16=False, except the two bf16-autocast tests). SGD (not Adam, whose
first step is ~lr * sign(grad)) keeps the update proportional to the gradient. The vLLM importance-sampling test
feeds both trainers the same inputs dict, with a ratio and perturbed old log-probs, through `compute_loss` (no vLLM
here).
"""

import gc
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import assert_close

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels.attention import register_hf_attention  # noqa: E402
from grpo_kernels.hf_head import check_plain_head  # noqa: E402
from grpo_kernels.integrations import FusedGRPOTrainer, compute_logprobs, use_grpo_kernels  # noqa: E402
from grpo_kernels.packing import pack_sequences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V, MAX_LEN, EOS, PAD = 320, 8, 1, 0
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_METRICS = {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "aux_loss",
                "policy_loss", "entropy_coef"}  # fmt: skip
PROMPTS = ["t5 t6 t7", "t8 t9", "t10 t11 t12 t13", "t14", "t15 t16", "t17 t18 t19"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_config():
    return transformers.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=EOS)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tensors here are tiny: OpenMP threads only add synchronisation (and stall on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2, saved once: every trainer (and TRL's reference model) loads it."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(path)
    return str(path)


def scripted_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Stands in for sampling: completions depend on the prompts only (EOS-terminated or truncated)."""
    g = torch.Generator().manual_seed(sum(sum(p) * (i + 1) for i, p in enumerate(prompt_ids)))
    out = []
    for i in range(len(prompt_ids)):
        n = int(torch.randint(2, MAX_LEN + 1, (1,), generator=g))
        ids = torch.randint(2, V, (n,), generator=g).tolist()
        out.append(ids[:-1] + [EOS] if i % 3 and n < MAX_LEN else ids)
    return out, None


def reward(completion_ids, **_):
    return [sum(t % 3 == 0 for t in c) / len(c) + 0.1 * len(c) for c in completion_ids]


def make_trainer(cls, model, *, steps=1, lr=0.5, **overrides):
    config = dict(output_dir="unused", per_device_train_batch_size=8, num_generations=4, max_steps=steps,
                  max_completion_length=MAX_LEN, learning_rate=lr, optim="sgd", lr_scheduler_type="constant",
                  epsilon_high=0.28, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
                  bf16=False)  # fmt: skip
    args = trl.GRPOConfig(**{**config, **overrides})
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer())
    trainer._generate_single_turn = types.MethodType(scripted_generate, trainer)
    return trainer


def train(cls, model_dir, **overrides):
    """-> (losses of every compute_loss call, loss metrics of every logged step, parameter update)."""
    trainer = make_trainer(cls, model_dir, **overrides)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    losses, compute_loss = [], trainer.compute_loss

    def recording_compute_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(loss.detach().double())
        return loss

    trainer.compute_loss = recording_compute_loss
    gc.freeze()  # train() ends with gc.collect(), slow over the objects of every earlier test: skip those
    try:
        trainer.train()
    finally:
        gc.unfreeze()
    logs = [{k: v for k, v in entry.items() if k in LOSS_METRICS} for entry in trainer.state.log_history[:-1]]
    update = torch.cat([(p.detach() - before[k]).flatten() for k, p in trainer.model.named_parameters()])
    return torch.stack(losses), logs, update


def assert_same_training(model_dir, **overrides):
    losses, logs, update = train(FusedGRPOTrainer, model_dir, **overrides)
    want_losses, want_logs, want_update = train(trl.GRPOTrainer, model_dir, **overrides)
    assert_close(losses, want_losses, name="loss", rtol=1e-5, atol=1e-7)
    scale = want_update.abs().max()
    assert scale > 0
    assert_close(update / scale, want_update / scale, name="parameter update / max |update|", rtol=0, atol=1e-4)
    assert len(logs) == len(want_logs)
    for got, want in zip(logs, want_logs, strict=True):
        assert set(got) == set(want), "the fused trainer logs TRL's loss metrics, no more, no less"
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    return want_logs


# TRL 1.16 rejects none of these combinations (sequence level with bnpo/dr_grpo/dapo/cispo only warns).
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_step_matches_trl_loss_metrics_and_update(model_dir, loss_type, beta, level):
    assert_same_training(model_dir, loss_type=loss_type, beta=beta, importance_sampling_level=level)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_num_iterations_2_reuses_old_logprobs_like_trl(model_dir, loss_type, level):
    """Two steps on one generation: the second is off-policy (TRL's old log-probs, ratios away from 1)."""
    logs = assert_same_training(model_dir, loss_type=loss_type, beta=0.04, importance_sampling_level=level,
                                num_iterations=2, steps=2, lr=2.0)  # fmt: skip
    if loss_type == "dapo" and level == "token":
        assert logs[1]["clip_ratio/region_mean"] > 0, "the off-policy step should clip some tokens"


@pytest.mark.parametrize("overrides", [
    dict(loss_type="dapo", delta=1.2, epsilon=0.1, use_bias_correction_kl=False, temperature=0.7, num_iterations=2,
         steps=2, lr=2.0),
    dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, per_device_train_batch_size=4,
         gradient_accumulation_steps=2),
    dict(loss_type="cispo", epsilon_high=3.0, per_device_train_batch_size=4, steps_per_generation=4, steps=2),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", per_device_train_batch_size=4,
         gradient_accumulation_steps=2, steps_per_generation=4, steps=2),
    dict(loss_type="luspo", importance_sampling_level="sequence", delta=1.5, use_bias_correction_kl=True,
         num_iterations=2, steps=2, lr=2.0),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=0.25, vespo_lambda_neg=4.0,
         use_bias_correction_kl=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
         steps_per_generation=4, steps=2, lr=2.0),
], ids=["delta-epsilon-no_bias_kl-temperature", "sapo_temperatures-grad_accum", "cispo-steps_per_generation",
        "gspo-grad_accum-steps_per_generation", "luspo-delta-bias_kl-off_policy",
        "vespo_k_lambda-bias_kl-grad_accum-steps_per_generation"])  # fmt: skip
def test_other_loss_options_and_batching_match_trl(model_dir, overrides):
    """delta, epsilon, KL without bias correction, temperature, SAPO temperatures, and TRL's normalizers over
    gradient accumulation and steps_per_generation (old log-probs whenever a generation spans several steps)."""
    assert_same_training(model_dir, beta=0.04, **overrides)


@pytest.mark.parametrize("overrides", [
    dict(loss_type="dapo", top_entropy_quantile=0.5), dict(loss_type="grpo", top_entropy_quantile=0.2),
    dict(loss_type="sapo", top_entropy_quantile=0.7, importance_sampling_level="sequence"),
    dict(loss_type="dapo", off_policy_mask_threshold=0.05, num_iterations=2, steps=2, lr=2.0),
    dict(loss_type="cispo", epsilon_high=3.0, top_entropy_quantile=0.5, off_policy_mask_threshold=0.05,
         num_iterations=2, steps=2, lr=2.0),
], ids=["entropy_mask-dapo", "entropy_mask-grpo", "entropy_mask-gspo_sapo", "off_policy_mask",
        "both-cispo"])  # fmt: skip
def test_entropy_and_off_policy_masks_match_trl(model_dir, overrides, monkeypatch):
    """top_entropy_quantile (TRL zeroes the policy term of low-entropy tokens, normalizers unchanged) and
    off_policy_mask_threshold (drops drifted negative-advantage sequences), with TRL's own mask functions.

    The members of a group share their first token's distribution, so entropies tie, and a tie can sit exactly on
    the quantile: then a 1e-7 difference between TRL's entropies and the fused pass's decides `>=` differently for
    the whole tie. Both trainers therefore see entropies rounded to 1e-4 (TRL's function on them, in both)."""
    monkeypatch.setattr(trl.GRPOTrainer, "get_high_entropy_mask", _rounded(trl.GRPOTrainer.get_high_entropy_mask))
    assert_same_training(model_dir, beta=0.04, **overrides)


def _rounded(get_high_entropy_mask):
    def rounded(self, entropies, mask, threshold):
        return get_high_entropy_mask(self, torch.round(entropies * 1e4) / 1e4, mask, threshold)

    return rounded


def test_masks_combine_with_the_vllm_ratio_as_trl(model_dir, monkeypatch):
    monkeypatch.setattr(trl.GRPOTrainer, "get_high_entropy_mask", _rounded(trl.GRPOTrainer.get_high_entropy_mask))
    kw = dict(loss_type="dapo", beta=0.04, num_iterations=2, vllm_importance_sampling_mode="token_truncate",
              top_entropy_quantile=0.6, off_policy_mask_threshold=0.02)  # fmt: skip
    fused, native = make_trainer(FusedGRPOTrainer, model_dir, **kw), make_trainer(trl.GRPOTrainer, model_dir, **kw)
    inputs = shared_inputs(native)
    old = inputs["old_per_token_logps"]
    inputs["old_per_token_logps"] = old + 0.3 * torch.randn_like(old)
    ratio = torch.rand(old.shape) * 2.5
    ratio[ratio < 0.4] = 0.0
    inputs["importance_sampling_ratio"] = ratio
    for trainer in (fused, native):
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


def test_mask_truncated_completions_matches_trl(model_dir):
    assert_same_training(model_dir, loss_type="dapo", beta=0.04, mask_truncated_completions=True)


def test_cast_lm_head_to_fp32_under_bf16_autocast_matches_trl(model_dir):
    assert_same_training(model_dir, loss_type="grpo", beta=0.0, cast_lm_head_to_fp32=True, bf16=True)


def test_bf16_autocast_agrees_with_trl_to_bf16_precision(model_dir):
    """TRL's default on CPU (bf16=True autocast): both heads run in bf16, with different roundings."""
    losses, _, update = train(FusedGRPOTrainer, model_dir, loss_type="dapo", beta=0.04, bf16=True)
    want_losses, _, want_update = train(trl.GRPOTrainer, model_dir, loss_type="dapo", beta=0.04, bf16=True)
    assert_close(losses, want_losses, name="loss", dtype=torch.bfloat16)
    scale = want_update.abs().max()
    assert_close(update / scale, want_update / scale, name="parameter update / max |update|", dtype=torch.bfloat16)


def shared_inputs(trainer):
    """One generation batch from TRL's own pipeline (old and reference log-probs included), in train mode."""
    trainer.model.train()
    rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    return trainer._generate_and_score_completions(rows)


def loss_and_grads(trainer, inputs):
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    if loss.requires_grad:
        loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


def assert_same_loss_and_grads(got, want):
    assert_close(got[0], want[0], name="loss", rtol=1e-5, atol=1e-7)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        scale = w.abs().max().clamp(min=1e-12)
        assert_close(g / scale, w / scale, name="grad / max |grad|", rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode,loss_type", [("token_truncate", "dapo"), ("token_mask", "grpo"),
                                            ("sequence_truncate", "cispo"), ("sequence_mask", "sapo"),
                                            ("sequence_truncate", "luspo"), ("token_truncate", "vespo"),
                                            ("token_mask", "vespo")])  # fmt: skip
def test_vllm_importance_sampling_ratio_applied_as_trl(model_dir, mode, loss_type):
    """TRL's ratio (truncated or masked, zeros included) multiplies the policy term before the KL, in both; vespo
    folds it into its phi (its clamped logs summed over every position, padding included: the ratios here are
    random there too)."""
    kw = dict(loss_type=loss_type, beta=0.04, num_iterations=2, vllm_importance_sampling_mode=mode)
    fused, native = make_trainer(FusedGRPOTrainer, model_dir, **kw), make_trainer(trl.GRPOTrainer, model_dir, **kw)
    inputs = shared_inputs(native)
    old = inputs["old_per_token_logps"]
    inputs["old_per_token_logps"] = old + 0.3 * torch.randn_like(old)  # ratios on both sides of the clip range
    shape = old.shape if mode.startswith("token") else (old.shape[0], 1)
    ratio = torch.rand(shape) * 2.5
    ratio[ratio < 0.4] = 0.0  # what the *_mask modes produce
    if loss_type == "vespo":  # one zero puts log 1e-8 into its sequence's sum, so phi ~ 0: zeros in one row only
        ratio = torch.exp(0.3 * torch.randn(shape))
        ratio[0, 1] = 0.0 if mode == "token_mask" else ratio[0, 1]
    inputs["importance_sampling_ratio"] = ratio
    for trainer in (fused, native):
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # the loss-side switch only
    assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


def test_eval_loss_matches_trl(model_dir):
    kw = dict(loss_type="dapo", beta=0.04)
    fused, native = make_trainer(FusedGRPOTrainer, model_dir, **kw), make_trainer(trl.GRPOTrainer, model_dir, **kw)
    inputs = shared_inputs(native)
    for trainer in (fused, native):
        trainer.model.eval()
    with torch.no_grad():
        got, want = loss_and_grads(fused, inputs), loss_and_grads(native, inputs)
    assert_same_loss_and_grads(got, want)


class RecordingTrainer(trl.GRPOTrainer):
    """A user's own subclass: its _compute_loss must be replaced on the instance, the class left alone."""

    def _compute_loss(self, model, inputs):
        self.calls = getattr(self, "calls", 0) + 1
        return super()._compute_loss(model, inputs)


def biased_head_model(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(1)
    head = torch.nn.Linear(64, V, bias=True)
    head.bias.data.normal_(0, 0.5)
    model.lm_head = head
    return model


def test_use_grpo_kernels_swaps_the_instance_loss_only(model_dir):
    mine = make_trainer(RecordingTrainer, biased_head_model(model_dir), loss_type="bnpo", beta=0.04)
    native = make_trainer(trl.GRPOTrainer, biased_head_model(model_dir), loss_type="bnpo", beta=0.04)
    inputs = shared_inputs(native)
    inputs["old_per_token_logps"] = inputs["completion_mask"] * 0.0 - 5.0  # off-policy, so ratios clip
    assert use_grpo_kernels(mine) is mine
    assert_same_loss_and_grads(loss_and_grads(mine, inputs), loss_and_grads(native, inputs))
    assert getattr(mine, "calls", 0) == 0, "the subclass's _compute_loss no longer runs on this instance"
    assert RecordingTrainer._compute_loss is not trl.GRPOTrainer._compute_loss
    assert "_compute_loss" not in vars(native) and "_compute_loss" in vars(mine)


@pytest.mark.parametrize("overrides,named", [
    (dict(loss_type="vespo", top_entropy_quantile=0.5), "loss_type='vespo' with top_entropy_quantile=0.5"),
    (dict(loss_type="vespo", off_policy_mask_threshold=0.1), "off_policy_mask_threshold=0.1"),
])  # fmt: skip
def test_unfused_config_options_raise_naming_the_option(model_dir, overrides, named):
    with pytest.raises(NotImplementedError, match=named.replace("(", r"\(")):
        make_trainer(FusedGRPOTrainer, model_dir, **overrides)


def test_peft_adapter_on_lm_head_raises(model_dir):
    with pytest.raises(NotImplementedError, match="PEFT adapter on lm_head"):
        FusedGRPOTrainer(model=model_dir, reward_funcs=reward, peft_config=SimpleNamespace(target_modules=["lm_head"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.lm_head = torch.nn.Sequential(model.lm_head)  # any LM head that is not a plain nn.Linear (a LoRA layer)
    with pytest.raises(NotImplementedError, match="not a torch.nn.Linear"):
        make_trainer(FusedGRPOTrainer, model)


@pytest.mark.parametrize("attr,value", [("final_logit_softcapping", 0.0), ("logit_scale", 0.0),
                                        ("logits_scaling", -2.0)])  # fmt: skip
def test_logit_transforms_in_the_model_config_raise(model_dir, attr, value):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    setattr(model.config, attr, value)
    with pytest.raises(NotImplementedError, match=attr):
        make_trainer(FusedGRPOTrainer, model)


def test_softcap_after_a_logit_scale_folds_into_cap_and_temperature():
    """Scale s, then cap c (TRL's distillation order), then temperature T: c tanh(s z / c) / T is the fused head with
    softcap c / s at temperature T / s."""
    from grpo_kernels.hf_head import logit_multiplier, logit_softcap

    config = transformers.CohereConfig(logit_scale=0.25, final_logit_softcapping=0.6)
    s, c = logit_multiplier(config), logit_softcap(config)
    h, w, ids = torch.randn(5, 8), torch.randn(V, 8), torch.randint(0, V, (5,))
    logits = 0.6 * torch.tanh(0.25 * (h @ w.T).double() / 0.6) / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    got = gk.fused_linear_logprobs(h, w, ids, temperature=0.7 / s, softcap=c)
    assert_close(got.double(), want, name="scaled and capped log-probs", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [
    dict(loss_type="grpo", entropy_coef=0.05), dict(loss_type="dapo", entropy_coef=-0.1),
    dict(loss_type="sapo", entropy_coef=0.05, importance_sampling_level="sequence"),
    dict(loss_type="cispo", entropy_coef=0.05, top_entropy_quantile=0.5),
    dict(loss_type="dapo", entropy_coef=0.02, use_adaptive_entropy=True, entropy_target=100.0, steps=2,
         per_device_train_batch_size=4, gradient_accumulation_steps=2),
    dict(loss_type="grpo", entropy_coef=0.3, use_adaptive_entropy=True, entropy_target=0.0, entropy_coef_min=0.1,
         entropy_coef_delta=0.05, steps=2),
], ids=["grpo", "dapo-negative", "gspo_sapo", "cispo-entropy_mask", "adaptive-applied-grad_accum",
        "adaptive-gated"])  # fmt: skip
def test_entropy_bonus_matches_trl(model_dir, overrides, monkeypatch):
    """entropy_coef (loss - coef x mean entropy over TRL's effective mask, gradient through the fused head) and the
    adaptive controller: the same losses, update and logged policy_loss / entropy_coef as TRL."""
    monkeypatch.setattr(trl.GRPOTrainer, "get_high_entropy_mask", _rounded(trl.GRPOTrainer.get_high_entropy_mask))
    logs = assert_same_training(model_dir, beta=0.04, **overrides)
    assert all("policy_loss" in entry for entry in logs)
    if overrides.get("use_adaptive_entropy"):
        assert len({entry["entropy_coef"] for entry in logs}) == 2  # the controller moved the coefficient


def _moe_config():
    return transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, pad_token_id=PAD,
                                       eos_token_id=EOS, router_aux_loss_coef=0.05)  # fmt: skip


@pytest.mark.parametrize("overrides", [dict(), dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)],
                         ids=["one_batch", "grad_accum"])  # fmt: skip
def test_moe_router_aux_loss_matches_trl(tmp_path, overrides):
    """router_aux_loss_coef > 0: the model's own load-balancing loss on its router logits, added (and logged as
    aux_loss) as TRL adds it."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_moe_config()).save_pretrained(tmp_path)
    logs = assert_same_training(str(tmp_path), loss_type="dapo", beta=0.0, **overrides)
    assert all(entry["aux_loss"] > 0 for entry in logs)


def test_moe_router_aux_loss_raises_for_a_model_that_computes_it_otherwise():
    model = transformers.AutoModelForCausalLM.from_config(_moe_config())
    del model.num_experts_per_tok
    with pytest.raises(NotImplementedError, match="router_aux_loss_coef"):
        make_trainer(FusedGRPOTrainer, model)


def test_deepspeed_zero3_and_vision_language_models_raise(model_dir):
    trainer = make_trainer(trl.GRPOTrainer, model_dir)
    with mock.patch("transformers.integrations.deepspeed.is_deepspeed_zero3_enabled", return_value=True):
        with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO-3"):
            use_grpo_kernels(trainer)
    vlm = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: "a text sub-config"))
    with pytest.raises(NotImplementedError, match="vision-language"):
        check_plain_head(vlm)


def plain_logprobs(logits, ids, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("keep", [None, 4])
def test_compute_logprobs_padded_matches_log_softmax_of_the_logits(model_dir, keep):
    model = biased_head_model(model_dir).eval()
    ids = torch.randint(2, V, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, -2:] = 0  # right padding
    got = compute_logprobs(model, ids, attention_mask=mask, logits_to_keep=keep, temperature=0.7)
    k = keep or ids.shape[1] - 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -k - 1 : -1]
    real = mask[:, -k:].bool()
    assert got.shape == (3, k) and got.dtype == torch.float32
    assert_close(got[real], plain_logprobs(logits, ids[:, -k:], 0.7)[real], name="log-probs", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(attention_mask=torch.ones(3, 10, dtype=torch.long)), r"attention_mask must be a tensor shaped like"),
    (dict(attention_mask=[[1] * 11] * 3), r"attention_mask must be a tensor"),
    (dict(logits_to_keep=11), r"logits_to_keep must be an int in \[1, 10\]"),
])  # fmt: skip
def test_compute_logprobs_rejects_bad_arguments(model_dir, kwargs, message):
    model = biased_head_model(model_dir).eval()
    with pytest.raises(ValueError, match=message):
        compute_logprobs(model, torch.randint(2, V, (3, 11)), **kwargs)


def test_compute_logprobs_packed_matches_log_softmax_of_the_logits(model_dir):
    register_hf_attention()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="grpo_varlen").eval()
    prompts = [torch.randint(2, V, (n,)) for n in (3, 5, 1)]
    completions = [torch.randint(2, V, (n,)) for n in (4, 0, 6)]
    packed = pack_sequences(prompts, completions)
    got = compute_logprobs(model, None, packed=packed)
    with torch.no_grad():
        logits = model(**packed.model_kwargs()).logits[0][packed.logit_rows]
    assert got.shape == (10,)
    assert_close(got, plain_logprobs(logits, packed.completion_ids, 1.0), name="packed log-probs", rtol=1e-5,
                 atol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_loss_step_peak_memory_below_trl_at_32k_vocab():
    """Each trainer in a fresh process (benchmarks/dropins/trl_dropin.py --peak): only the direction is asserted."""
    peaks = {}
    for provider in ("trl", "fused"):
        spec = json.dumps(dict(provider=provider, vocab=32768, hidden=64, batch=4, prompt=16, completion=128))
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dropins" / "trl_dropin.py"), "--peak", spec],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[provider] = float(out.stdout.strip().splitlines()[-1])
    assert peaks["fused"] < peaks["trl"], peaks


def _scaled_head_models():
    """Models whose forward scales the logits: Cohere (x logit_scale) and Granite (/ logits_scaling)."""
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS)  # fmt: skip
    return {"cohere": transformers.CohereConfig(logit_scale=0.5, **common),
            "granite": transformers.GraniteConfig(logits_scaling=4.0, tie_word_embeddings=False, **common),
            # a cap small enough to bend this tiny model's logits (|z| ~ 0.5): tanh is far from linear there
            "gemma2": transformers.Gemma2Config(final_logit_softcapping=0.3, head_dim=16, **common)}


@pytest.mark.parametrize("name", ["cohere", "granite", "gemma2"])
def test_models_that_scale_their_logits_match_trl_and_their_own_logits(tmp_path, name):
    """The scale is folded into the fused head's temperature, Gemma 2's soft-cap computed by the fused head:
    compute_logprobs equals the model's own logits, and a training step equals TRL's (on the model's logits)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_scaled_head_models()[name]).eval()
    ids = torch.randint(2, V, (3, 9))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    got = compute_logprobs(model, ids, temperature=0.7)
    assert_close(got, plain_logprobs(logits, ids[:, 1:], 0.7), name=f"{name} log-probs", rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    assert_same_training(str(tmp_path), loss_type="dapo", beta=0.04, temperature=0.7)
