"""grpo_kernels.integrations.verl against verl 0.9.1 itself (its registered losses, agg_loss, FusedLinearForPPO and
patched model forward are the oracles; nothing of verl's is copied or mocked here).

    .venv-trainers/bin/python -m pytest -q tests/trainers/test_verl.py
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close, assert_lowp_no_worse
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.utils.experimental import torch_functional as verl_tf
from verl.workers.config import ActorConfig

from grpo_kernels.integrations import verl as gv

ROOT = Path(__file__).resolve().parents[2]
MODES = ("vanilla", "gspo", "cispo", "sapo")
BATCH_INFOS = {
    "local": {},
    "global_ints": dict(dp_size=2, batch_num_tokens=71, global_batch_size=9, loss_scale_factor=17),
    "global_tensors": dict(
        dp_size=1, batch_num_tokens=torch.tensor(40.0), global_batch_size=torch.tensor(6), loss_scale_factor=None
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert set(gv.register_verl_losses()) == set(gv.LOSS_MODES)


def actor_config(info=None, **fields):
    """verl's ActorConfig with DAPO's clip-higher, and global_batch_info as verl's ppo_loss sets it."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         **{"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, **fields})  # fmt: skip
    config.global_batch_info.update(info or {})
    return config


def make_batch(b=5, length=13, *, holes=False, dtype=torch.float32):
    """Ragged right-padded response masks (one full row, one empty row), optional holes (tool tokens), per-token
    advantages with exact zeros, old log-probs off-policy (some clipped) and two tokens with |d| > 20."""
    lengths = torch.randint(1, length + 1, (b,))
    lengths[0] = length
    if b > 2:
        lengths[2] = 0  # a sequence without response tokens (excluded from verl's sequence counts)
    mask = torch.arange(length)[None] < lengths[:, None]
    if holes:
        mask &= torch.rand(b, length) > 0.2
        mask[0, :2] = True
    lp = -4.0 * torch.rand(b, length) - 0.01
    old = lp + 0.35 * torch.randn(b, length)
    adv = torch.randn(b, length) * (torch.rand(b, length) > 0.1)
    old[0, 0], adv[0, 0] = lp[0, 0] - 25.0, 0.5  # ratio e^25 (clamped to e^20 where verl clamps), A > 0
    if length > 1:
        old[0, 1], adv[0, 1] = lp[0, 1] + 25.0, -0.7  # ratio e^-25, A < 0
    is_weights = 2.0 * torch.rand(b, length) * (torch.rand(b, length) > 0.1)
    return {k: v.to(dtype) for k, v in dict(lp=lp, old=old, adv=adv, is_weights=is_weights).items()} | {"mask": mask}


def run(fn, batch, agg, config, with_is, dtype=None):
    """fn's (loss, d loss / d log_prob, metrics) on the batch (in dtype, default the batch's)."""
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
    log_prob = cast(batch["lp"]).clone().requires_grad_()
    loss, metrics = fn(old_log_prob=cast(batch["old"]), log_prob=log_prob, advantages=cast(batch["adv"]),
                       response_mask=batch["mask"], loss_agg_mode=agg, config=config,
                       rollout_is_weights=cast(batch["is_weights"]) if with_is else None)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def assert_equals_verl(mode, batch, agg, config, with_is):
    expected = run(core_algos.get_policy_loss_fn(mode), batch, agg, config, with_is)
    actual = run(core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}"), batch, agg, config, with_is)
    assert_close(actual[0], expected[0], name="loss", rtol=1e-5, atol=1e-7)
    assert_close(actual[1], expected[1], name="grad", rtol=1e-5, atol=1e-6 * expected[1].abs().max().item())
    assert actual[2].keys() == expected[2].keys()
    for name, value in expected[2].items():
        assert isinstance(actual[2][name], float)
        assert actual[2][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("info", list(BATCH_INFOS))
@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("agg", gv.AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_loss_grad_and_metrics_equal_verls(mode, agg, with_is, info):
    assert_equals_verl(mode, make_batch(holes=info == "local"), agg, actor_config(BATCH_INFOS[info]), with_is)


@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("agg", gv.AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [3.0, 1.28, 1.1, math.inf], ids=["c3", "c_eq_high", "c_inside_clip", "off"])
def test_vanilla_dual_clip_equals_verls(clip_ratio_c, agg, with_is):
    """delta = clip_ratio_c reproduces verl's dual clip for c >= 1 + clip_ratio_high (one op call); c inside the
    clip range (1 < c < 1.28) takes the two-call route; c = inf is verl's dual clip off."""
    batch = make_batch(7, 11)
    batch["old"][:, 3] = batch["lp"][:, 3] - 2.0  # ratio e^2 = 7.4 > every c: the dual clip binds for A < 0
    assert_equals_verl("vanilla", batch, agg, actor_config(clip_ratio_c=clip_ratio_c), with_is)


@pytest.mark.parametrize("mode", MODES)
def test_log_ratio_clamp_at_20_equals_verls(mode):
    """A token with A < 0 and d = +25 without dual clip: verl's ratio is e^20 there, with no gradient."""
    batch = make_batch(3, 8)
    batch["old"][0, 2], batch["adv"][0, 2] = batch["lp"][0, 2] - 25.0, -0.3
    batch["old"][1, 0], batch["adv"][1, 0] = batch["lp"][1, 0] + 21.0, 0.8
    assert_equals_verl(mode, batch, "token-mean", actor_config(clip_ratio_c=math.inf), with_is=False)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_sequence_above_the_ratio_clamp_equals_verls(agg):
    """A sequence whose mean log-ratio exceeds verl's clamp at 10 has ratio e^10 and no gradient."""
    batch = make_batch(4, 9)
    batch["old"][1] = batch["lp"][1] - 12.0
    batch["adv"][1] = -1.0
    assert_equals_verl("gspo", batch, agg, actor_config(), with_is=True)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 1031)], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_odd_shapes_equal_verls(mode, shape):
    batch = make_batch(*shape)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert_equals_verl(mode, batch, agg, actor_config(), with_is=True)


def test_non_contiguous_inputs_equal_verls():
    batch = make_batch(6, 20)
    batch = {k: v[:, ::2] for k, v in batch.items()}
    assert not batch["lp"].is_contiguous()
    for mode in MODES:
        assert_equals_verl(mode, batch, "token-mean", actor_config(), with_is=True)


@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_no_worse_than_verls_bf16(mode, agg, with_is):
    """bf16 inputs: loss and gradient at least as close (x2) to verl run in fp64 on the same values as verl's own
    bf16 computation; the metrics as close to verl's fp64 metrics as verl's bf16 ones, give or take one token."""
    batch = {k: v.bfloat16() if v.is_floating_point() else v for k, v in make_batch(6, 17).items()}
    config = actor_config(BATCH_INFOS["global_ints"])
    verl_fn, ours_fn = core_algos.get_policy_loss_fn(mode), core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}")
    oracle = run(verl_fn, batch, agg, config, with_is, dtype=torch.float64)
    theirs = run(verl_fn, batch, agg, config, with_is)
    ours = run(ours_fn, batch, agg, config, with_is)
    assert ours[1].dtype == torch.bfloat16
    for i, name in enumerate(("loss", "grad")):  # floor: one bf16 rounding (verl's bf16 result may round luckily)
        assert_lowp_no_worse(ours[i], theirs[i], oracle[i], name=name, floor=2**-8 * oracle[i].abs().max().item())
    tokens = int(batch["mask"].sum())
    for name, value in oracle[2].items():  # a flag may flip near a clip boundary: one token's worth of slack
        assert abs(ours[2][name] - value) <= abs(theirs[2][name] - value) + 1.0 / tokens + 1e-3, name


# --------------------------------------------------------------------------------------------- registration
def test_registration_is_idempotent_and_leaves_verls_losses():
    verl_vanilla = core_algos.get_policy_loss_fn("vanilla")
    assert gv.register_verl_losses() == gv.register_verl_losses() == tuple(gv.LOSS_MODES)
    for name, fn in gv.LOSS_MODES.items():
        assert core_algos.get_policy_loss_fn(name) is fn
    assert core_algos.get_policy_loss_fn("vanilla") is verl_vanilla


def test_external_lib_module_registers_and_routes_the_fused_head():
    """verl imports actor_rollout_ref.model.external_lib with its own import_external_libs."""
    from verl.utils.import_utils import import_external_libs

    try:
        import_external_libs("grpo_kernels.integrations.verl_register")
        assert verl_tf.FusedLinearForPPO is gv.FusedLinearForPPO
        for name in gv.LOSS_MODES:
            assert core_algos.get_policy_loss_fn(name) is gv.LOSS_MODES[name]
    finally:
        gv.use_grpo_kernels_fused_linear(False)
    assert verl_tf.FusedLinearForPPO is not gv.FusedLinearForPPO


def test_grpo_kernels_imports_without_verl():
    code = (
        "import sys; sys.modules['verl'] = None\n"  # any import of verl now raises ImportError
        "import torch, grpo_kernels, grpo_kernels.integrations.verl as gv\n"
        "lp, ent = gv.fused_linear_for_ppo(torch.randn(3, 8), torch.randn(11, 8), torch.tensor([1, 2, 3]))\n"
        "assert lp.shape == ent.shape == (3,)\n"
        "try:\n    gv.register_verl_losses()\nexcept ImportError:\n    print('needs verl')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "needs verl"


def test_example_config_sets_real_verl_keys():
    """Every key the example sets exists in verl's generated PPO trainer config; its loss_mode and external_lib are
    ours."""
    example = OmegaConf.load(ROOT / "examples" / "verl_grpo_kernels.yaml")
    verl_dir = Path(core_algos.__file__).resolve().parents[1] / "config"
    defaults = OmegaConf.load(verl_dir / "_generated_ppo_trainer.yaml")

    def keys(node, prefix=""):
        for k, v in node.items():
            yield from keys(v, f"{prefix}{k}.") if OmegaConf.is_dict(v) and v else [f"{prefix}{k}"]

    for key in keys(OmegaConf.masked_copy(example, [k for k in example if k not in ("hydra", "defaults")])):
        assert OmegaConf.select(defaults, key, default="<missing>") != "<missing>", key
    assert example.hydra.searchpath == ["pkg://verl.trainer.config"]
    model, actor = example.actor_rollout_ref.model, example.actor_rollout_ref.actor
    assert model.external_lib == "grpo_kernels.integrations.verl_register"
    assert model.use_fused_kernels and model.fused_kernel_options.impl_backend == "torch"
    assert actor.policy_loss.loss_mode in gv.LOSS_MODES and actor.loss_agg_mode in gv.AGG_MODES


# --------------------------------------------------------------------------------------------- invalid input
def call(mode, batch=None, agg="token-mean", config=None, **overrides):
    batch = batch or make_batch()
    kwargs = dict(old_log_prob=batch["old"], log_prob=batch["lp"], advantages=batch["adv"],
                  response_mask=batch["mask"], loss_agg_mode=agg, config=config or actor_config(),
                  rollout_is_weights=None) | overrides  # fmt: skip
    return core_algos.get_policy_loss_fn(mode)(**kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_invalid_calls_raise_clear_errors(mode):
    ours = f"grpo_kernels_{mode}"
    batch = make_batch()
    with pytest.raises(ValueError, match="config"):
        gv.LOSS_MODES[ours](batch["old"], batch["lp"], batch["adv"], batch["mask"], "token-mean", None)
    with pytest.raises(NotImplementedError, match="rollout_is_weights"):
        call(ours, rollout_is_weights=torch.rand(5, 13, requires_grad=True))
    with pytest.raises(ValueError, match="shape"):
        call(ours, old_log_prob=torch.zeros(5, 12))
    with pytest.raises(TypeError, match="global_batch_info"):
        call(ours, config=actor_config({"dp_sizes": 2}))
    with pytest.raises(TypeError):  # verl too
        call(mode, config=actor_config({"dp_sizes": 2}))
    if mode != "sapo":  # sapo ignores loss_agg_mode, as verl's
        for fn in (mode, ours):
            with pytest.raises(ValueError, match="loss_agg_mode"):
                call(fn, agg="token-median")
    agg = "token-mean" if mode != "sapo" else "seq-mean-token-mean"
    for fn in (mode, ours):  # dp_size > 1 needs the global counts: verl refuses too
        with pytest.raises(ValueError, match="required"):
            call(fn, agg=agg, config=actor_config({"dp_size": 2}))


def test_invalid_options_raise_clear_errors():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        call("grpo_kernels_vanilla", config=actor_config(clip_ratio_c=1.0))
    with pytest.raises(AssertionError):  # verl's own refusal
        call("vanilla", config=actor_config(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="clip_ratio_low"):
        call("grpo_kernels_cispo", config=actor_config(clip_ratio_low=1.0))
    with pytest.raises(ValueError, match="tau_neg"):
        call("grpo_kernels_sapo", config=actor_config(tau_neg=0.0))
    with pytest.raises(ValueError, match="rollout_is_weights"):
        call("grpo_kernels_sapo", rollout_is_weights=-torch.ones(5, 13))
    batch = make_batch()
    with pytest.raises(ValueError, match="0/1 mask"):
        call("grpo_kernels_sapo", batch, response_mask=batch["mask"] * 0.1)


# --------------------------------------------------------------------------------------------- fused head
def fused_outputs(module, hidden, weight, ids, temperature, grads):
    """(log_probs, entropy, d/d hidden, d/d weight) of sum(g1 log_probs + g2 entropy)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs, entropy = module(h, w, ids, temperature)
    (grads[0] * log_probs.double() + grads[1] * entropy.double()).sum().backward()
    return log_probs.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("shape", [(11,), (2, 9), (1, 1)], ids=str)
def test_fused_head_equals_verls_torch_reference_fp32(shape):
    hidden, weight = torch.randn(*shape, 32), 0.3 * torch.randn(257, 32)
    ids, grads = torch.randint(0, 257, shape), (torch.randn(shape).double(), torch.randn(shape).double())
    expected = fused_outputs(verl_tf.FusedLinearForPPO(impl_backend="torch"), hidden, weight, ids, 0.7, grads)
    actual = fused_outputs(gv.FusedLinearForPPO(), hidden, weight, ids, 0.7, grads)
    for name, a, e in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), actual, expected, strict=True):
        assert a.dtype == e.dtype, name
        assert_close(a, e, name=name, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_fused_head_bf16_no_worse_than_verls_bf16():
    """bf16 hidden and weight: log-probs (fp32), entropy (bf16) and both gradients at least as close (x2) to verl's
    reference run in fp64 on the same values as verl's own bf16 run; the output dtypes are verl's."""
    shape = (3, 37)
    hidden, weight = torch.randn(*shape, 48).bfloat16(), (0.3 * torch.randn(1031, 48)).bfloat16()
    ids, grads = torch.randint(0, 1031, shape), (torch.randn(shape).double(), torch.randn(shape).double())
    verl_fn = verl_tf.FusedLinearForPPO(impl_backend="torch")
    oracle = fused_outputs(verl_fn, hidden.double(), weight.double(), ids, 0.9, grads)
    theirs = fused_outputs(verl_fn, hidden, weight, ids, 0.9, grads)
    ours = fused_outputs(gv.FusedLinearForPPO(chunk_size=16), hidden, weight, ids, 0.9, grads)
    for name, a, t, o in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), ours, theirs, oracle,
                             strict=True):  # fmt: skip
        assert a.dtype == t.dtype, name
        assert_lowp_no_worse(a, t, o, name=name)


def test_fused_head_rejects_bad_shapes():
    with pytest.raises(ValueError, match="input_ids"):
        gv.fused_linear_for_ppo(torch.randn(4, 8), torch.randn(11, 8), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_states"):
        gv.fused_linear_for_ppo(torch.randn(8), torch.randn(11, 8), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="impl_backend"):
        gv.FusedLinearForPPO(impl_backend="triton")


def test_verls_patched_model_forward_runs_grpo_kernels(monkeypatch):
    """verl's use_fused_kernels patch (torch backend) on a tiny Qwen2: with use_grpo_kernels_fused_linear() the
    forward's log-probs, entropy and the gradients of every parameter equal verl's own class, computed by
    grpo_kernels.fused_linear_logprobs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)  # restored after the test
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    calls, original = [], gv.fused_linear_logprobs

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gv, "fused_linear_logprobs", counted)
    ids = torch.randint(0, 101, (2, 9))
    results = []
    try:
        for enable in (False, True):
            gv.use_grpo_kernels_fused_linear(enable)
            model.zero_grad()
            out = model(input_ids=ids, return_dict=True, temperature=0.8, use_cache=False)
            (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
            results.append([out.log_probs.detach(), out.entropy.detach()] +
                           [p.grad.clone() for p in model.parameters()])  # fmt: skip
    finally:
        gv.use_grpo_kernels_fused_linear(False)
    assert len(calls) == 1
    for i, (a, e) in enumerate(zip(results[1], results[0], strict=True)):
        assert_close(a, e, name=f"output {i}", rtol=1e-5, atol=1e-5 * e.abs().max().item())
