"""FusedGRPOTrainer(packed=True) against trl.GRPOTrainer: the padding-free loss forward gives TRL's losses, updates,
gradients and logged metrics, on batches whose padding is most of TRL's tensors.

The completions are scripted (as in test_trl_dropin.py, `_generate_single_turn` replaced on each instance by a pure
function of the prompts) to be as uneven as a batch gets: in each group of four, one completion is a lone EOS, one is
truncated at max_completion_length (no EOS), one ends with EOS exactly at max_completion_length, one has a random
length in between; the prompts have 1 to 7 tokens, so TRL left-pads most of them. The step tests run with
mask_truncated_completions (the truncated completion is packed whole and only the loss skips it), with and without
gradient checkpointing (which recomputes the decoder layers during the backward, so they must be recomputed packed),
and fp32 throughout. The packed model restarts positions per sample while TRL's padded forward shifts them by the
left padding: for the rotary embeddings of these models that is the same function, up to rounding.
"""

import gc
import types

import pytest
import torch
from helpers import assert_close

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_trl_dropin import EOS, LOSS_METRICS, PAD, V, tiny_config, tokenizer  # noqa: E402

from grpo_kernels.integrations import FusedGRPOTrainer, use_grpo_kernels  # noqa: E402
from grpo_kernels.integrations.trl_packing import pack_trl_batch, use_packed_attention  # noqa: E402

MAX_LEN = 24
PROMPTS = ["t5 t6 t7 t8 t9 t10 t11", "t12", "t13 t14 t15", "t16 t17 t18 t19 t20", "t21 t22", "t23 t24 t25 t26 t27 t28"]
GSPO = dict(loss_type="grpo", importance_sampling_level="sequence")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_packed")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(path)
    return str(path)


def uneven_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Per group of four: [EOS], MAX_LEN tokens without EOS (truncated), MAX_LEN tokens ending with EOS, and a random
    length in between ending with EOS; a pure function of the prompts."""
    g = torch.Generator().manual_seed(sum(sum(p) * (i + 1) for i, p in enumerate(prompt_ids)))
    out = []
    for i in range(len(prompt_ids)):
        n = [1, MAX_LEN, MAX_LEN, int(torch.randint(2, MAX_LEN, (1,), generator=g))][i % 4]
        ids = torch.randint(2, V, (n,), generator=g).tolist()
        out.append(ids if i % 4 == 1 else ids[:-1] + [EOS])
    return out, None


def reward(completion_ids, **_):
    return [sum(t % 3 == 0 for t in c) / len(c) + 0.05 * len(c) for c in completion_ids]


def make_trainer(cls, model, *, steps=1, lr=0.5, packed=True, shared_prefix=False, **overrides):
    config = dict(output_dir="unused", per_device_train_batch_size=8, num_generations=4, max_steps=steps,
                  max_completion_length=MAX_LEN, learning_rate=lr, optim="sgd", lr_scheduler_type="constant",
                  epsilon_high=0.28, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
                  bf16=False, mask_truncated_completions=True, beta=0.04)  # fmt: skip
    args = trl.GRPOConfig(**{**config, **overrides})
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    kw = dict(packed=packed, shared_prefix=shared_prefix) if cls is FusedGRPOTrainer else {}
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer(),
                  **kw)  # fmt: skip
    trainer._generate_single_turn = types.MethodType(uneven_generate, trainer)
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
    gc.freeze()
    try:
        trainer.train()
    finally:
        gc.unfreeze()
    logs = [{k: v for k, v in entry.items() if k in LOSS_METRICS} for entry in trainer.state.log_history[:-1]]
    update = torch.cat([(p.detach() - before[k]).flatten() for k, p in trainer.model.named_parameters()])
    return torch.stack(losses), logs, update


def assert_same_training(model_dir, shared_prefix=False, **overrides):
    losses, logs, update = train(FusedGRPOTrainer, model_dir, shared_prefix=shared_prefix, **overrides)
    want_losses, want_logs, want_update = train(trl.GRPOTrainer, model_dir, **overrides)
    assert_close(losses, want_losses, name="loss", rtol=1e-5, atol=1e-7)
    scale = want_update.abs().max()
    assert scale > 0
    assert_close(update / scale, want_update / scale, name="parameter update / max |update|", rtol=0, atol=1e-5)
    assert len(logs) == len(want_logs)
    for got, want in zip(logs, want_logs, strict=True):
        assert set(got) == set(want), "the packed trainer logs TRL's loss metrics, no more, no less"
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    return want_logs


def shared_inputs(trainer):
    """One generation batch from TRL's own pipeline, in train mode: two prompts of different lengths."""
    trainer.model.train()
    rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    return trainer._generate_and_score_completions(rows)


def loss_and_grads(trainer, inputs):
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    if loss.requires_grad:
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def assert_same_loss_and_grads(got, want):
    assert_close(got[0], want[0], name="loss", rtol=1e-5, atol=1e-7)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        scale = w.abs().max().clamp(min=1e-12)
        assert_close(g / scale, w / scale, name="grad / max |grad|", rtol=0, atol=1e-5)


def test_the_scripted_batch_is_mostly_padding_with_every_kind_of_completion(model_dir):
    inputs = shared_inputs(make_trainer(trl.GRPOTrainer, model_dir))
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    assert len(set(prompt_mask.sum(1).tolist())) == 2 and completion_mask.shape[1] == MAX_LEN
    lengths = (inputs["completion_ids"] != PAD).sum(1)
    assert {1, MAX_LEN} <= set(lengths.tolist())
    assert (completion_mask.sum(1) == 0).sum() == 2, "one truncated completion per group, masked by TRL"
    layout = pack_trl_batch(inputs, pad_token_id=PAD)
    assert layout.packed.num_tokens == int(prompt_mask.sum() + lengths.sum())
    assert layout.packed.num_tokens < 0.75 * (prompt_mask.numel() + completion_mask.numel())


LOSSES = {"grpo": dict(loss_type="grpo"), "dapo": dict(loss_type="dapo"), "dr_grpo": dict(loss_type="dr_grpo"),
          "bnpo": dict(loss_type="bnpo"), "gspo": GSPO}  # fmt: skip


@pytest.mark.parametrize("checkpointing", [True, False], ids=["grad_ckpt", "no_grad_ckpt"])
@pytest.mark.parametrize("loss", list(LOSSES.values()), ids=list(LOSSES))
def test_packed_steps_match_trl_on_uneven_completions(model_dir, loss, checkpointing):
    """Two steps on one generation (the second off-policy, so ratios clip), KL on, truncated completions masked."""
    logs = assert_same_training(model_dir, gradient_checkpointing=checkpointing, num_iterations=2, steps=2, lr=2.0,
                                **loss)  # fmt: skip
    assert all("clip_ratio/region_mean" in entry and "kl" in entry for entry in logs)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_packed_other_loss_types_match_trl(model_dir, loss_type):
    assert_same_training(model_dir, loss_type=loss_type, num_iterations=2, steps=2, lr=2.0)


@pytest.mark.parametrize("overrides", [
    dict(loss_type="dapo", mask_truncated_completions=False),
    dict(loss_type="grpo", gradient_checkpointing_kwargs={"use_reentrant": True}),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", per_device_train_batch_size=4,
         gradient_accumulation_steps=2, steps_per_generation=4, steps=2),
], ids=["no_truncation_mask", "reentrant_grad_ckpt", "gspo-grad_accum-steps_per_generation"])  # fmt: skip
def test_packed_batching_and_checkpointing_variants_match_trl(model_dir, overrides):
    """Truncated completions in the loss, reentrant checkpointing, and micro-batches of 4 out of a shuffled
    generation batch (TRL shuffles it across steps_per_generation: groups no longer sit together)."""
    assert_same_training(model_dir, **overrides)


@pytest.mark.parametrize("loss", [dict(loss_type="dapo"), GSPO], ids=["dapo", "gspo"])
def test_shared_prefix_matches_trl(model_dir, loss):
    assert_same_training(model_dir, shared_prefix=True, num_iterations=2, steps=2, lr=2.0, **loss)


def test_shared_prefix_shares_only_identical_prompts(model_dir):
    inputs = shared_inputs(make_trainer(trl.GRPOTrainer, model_dir))
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # the groups interleaved: identical prompts are not neighbours any more
    inputs = {k: v[order] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 8 else v
              for k, v in inputs.items()}  # fmt: skip
    layout = pack_trl_batch(inputs, pad_token_id=PAD, shared_prefix=True)
    assert len(layout.packed.prefix_groups) == 2
    plain = pack_trl_batch(inputs, pad_token_id=PAD)
    prompt_lengths = inputs["prompt_mask"][[0, 1]].sum()
    assert plain.packed.num_tokens - layout.packed.num_tokens == 3 * prompt_lengths
    assert torch.equal(layout.ids, plain.ids) and torch.equal(layout.packed.completion_ids, plain.ids)
    fused = make_trainer(FusedGRPOTrainer, model_dir, shared_prefix=True)
    native = make_trainer(trl.GRPOTrainer, model_dir)
    assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


def _rounded(get_high_entropy_mask):  # as in test_trl_dropin: tied entropies must not straddle the quantile
    def rounded(self, entropies, mask, threshold):
        return get_high_entropy_mask(self, torch.round(entropies * 1e4) / 1e4, mask, threshold)

    return rounded


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_packed_masks_vllm_ratio_and_tool_mask_match_trl(model_dir, mode, monkeypatch):
    """TRL's per-token tensors ([B, C]: old / reference / sampler log-probs, the vLLM ratio, tool_mask) reach the
    fused loss flattened, and TRL's mask functions (top_entropy_quantile, off_policy_mask_threshold) see [B, C]."""
    monkeypatch.setattr(trl.GRPOTrainer, "get_high_entropy_mask", _rounded(trl.GRPOTrainer.get_high_entropy_mask))
    kw = dict(loss_type="dapo", num_iterations=2, vllm_importance_sampling_mode=mode, top_entropy_quantile=0.6,
              off_policy_mask_threshold=0.02, entropy_coef=0.05)  # fmt: skip
    fused, native = make_trainer(FusedGRPOTrainer, model_dir, **kw), make_trainer(trl.GRPOTrainer, model_dir, **kw)
    inputs = shared_inputs(native)
    old = inputs["old_per_token_logps"]
    inputs["old_per_token_logps"] = old + 0.3 * torch.randn_like(old)
    ratio = torch.rand(old.shape if mode.startswith("token") else (old.shape[0], 1)) * 2.5
    ratio[ratio < 0.4] = 0.0
    inputs["importance_sampling_ratio"] = ratio
    tool_mask = torch.ones_like(inputs["completion_mask"])
    tool_mask[:, 3:7] = 0  # a tool response inside the completions: attended to, not in the loss
    inputs["tool_mask"] = tool_mask
    for trainer in (fused, native):
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


def test_packed_eval_loss_matches_trl(model_dir):
    fused, native = make_trainer(FusedGRPOTrainer, model_dir), make_trainer(trl.GRPOTrainer, model_dir)
    inputs = shared_inputs(native)
    for trainer in (fused, native):
        trainer.model.eval()
    with torch.no_grad():
        assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["plain", "shared_prefix"])
def test_the_packed_forward_sees_no_padding(model_dir, shared_prefix):
    """The decoder body of the loss forward embeds one row holding exactly the real prompt tokens (each distinct
    prompt once with shared_prefix) and every completion token up to its last real one, truncated ones included."""
    fused = make_trainer(FusedGRPOTrainer, model_dir, shared_prefix=shared_prefix)
    inputs = shared_inputs(fused)
    prompt_lengths = inputs["prompt_mask"].sum(1)
    completion_lengths = (inputs["completion_ids"] != PAD).sum(1)
    assert prompt_lengths.unique().numel() == 2 and completion_lengths.unique().numel() > 2
    prompts = prompt_lengths.unique().sum() if shared_prefix else prompt_lengths.sum()
    shapes = []
    handle = fused.model.get_input_embeddings().register_forward_pre_hook(lambda m, a: shapes.append(a[0].shape))
    try:
        loss_and_grads(fused, inputs)
    finally:
        handle.remove()
    assert shapes == [(1, int(prompts + completion_lengths.sum()))]


def test_routed_attention_keeps_generation_and_padded_forwards(model_dir):
    """After packed=True the model's padded calls (HF generate, TRL's log-prob forwards) still run its sdpa attention
    with the padding mask: the same greedy tokens and scores as an untouched copy."""
    routed = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    use_packed_attention(routed)
    assert routed.config._attn_implementation == "grpo_varlen|sdpa"
    ids = torch.randint(2, V, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :2] = 0, 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=PAD, eos_token_id=None)  # fmt: skip
    got, want = routed.generate(ids, **kw), plain.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert_close(torch.stack(got.scores), torch.stack(want.scores), name="generate scores", rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attn", ["eager", "grpo_varlen"])
def test_eager_and_grpo_varlen_models_pack_too(model_dir, attn):
    """An eager model keeps eager attention for its padded calls; a model loaded with grpo_varlen runs them on sdpa."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn)
    fused = make_trainer(FusedGRPOTrainer, model)
    assert fused.model.config._attn_implementation == f"grpo_varlen|{'sdpa' if attn == 'grpo_varlen' else attn}"
    native = make_trainer(trl.GRPOTrainer, model_dir)
    inputs = shared_inputs(native)
    assert_same_loss_and_grads(loss_and_grads(fused, inputs), loss_and_grads(native, inputs))


def test_packing_it_cannot_honour_raises_naming_the_option(model_dir):
    trainer = make_trainer(trl.GRPOTrainer, model_dir, beta=0.0)
    trainer.model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(NotImplementedError, match=r"^packed=True: the model runs attn_implementation="):
        use_grpo_kernels(trainer, packed=True)
    trainer.model.config._attn_implementation_internal = "sdpa"
    trainer.model.config.attention_chunk_size = 4  # Llama 4's chunked attention lives in the mask: refused
    with pytest.raises(NotImplementedError, match=r"^packed=True: the model config sets attention_chunk_size=4"):
        use_grpo_kernels(trainer, packed=True)
    assert trainer.model.config._attn_implementation == "sdpa", "the attention is restored after a refusal"
    with pytest.raises(ValueError, match="shared_prefix=True .* needs packed=True"):
        use_grpo_kernels(trainer, shared_prefix=True)
    with pytest.raises(TypeError, match="packed and shared_prefix must be bools"):
        FusedGRPOTrainer(model=model_dir, reward_funcs=reward, packed="yes")


def test_packed_gemma2_sliding_window_and_softcaps_match_trl(tmp_path):
    """Gemma 2: a sliding window shorter than the sequences (every other layer), attention-logit and final-logit
    soft-capping: the packed row honours them as TRL's padded masks do."""
    from test_trl_dropin import _scaled_head_models

    config = _scaled_head_models()["gemma2"]
    config.sliding_window = 5
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert_same_training(str(tmp_path), loss_type="dapo", temperature=0.7, num_iterations=2, steps=2, lr=2.0)


def test_shared_prefix_with_a_router_aux_loss_raises(tmp_path):
    from test_trl_dropin import _moe_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_moe_config()).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match=r"shared_prefix=True with router_aux_loss_coef=0.05"):
        make_trainer(FusedGRPOTrainer, str(tmp_path), shared_prefix=True, beta=0.0)


def test_packed_moe_router_aux_loss_matches_trl(tmp_path):
    """The load-balancing loss over the packed row's router logits (no attention mask: every token is real) equals
    TRL's over its padded batch with the mask."""
    from test_trl_dropin import _moe_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_moe_config()).save_pretrained(tmp_path)
    logs = assert_same_training(str(tmp_path), loss_type="dapo", beta=0.0)
    assert all(entry["aux_loss"] > 0 for entry in logs)
