"""The loss spec (reference.grpo_loss, reference.selective_logprobs) against the installed TRL's own code.

TRL's GRPOTrainer._compute_loss is called as it is, on a stand-in trainer object whose model forward returns
our log-probs, so its math and normalizers are used, not retyped.
"""

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close

from grpo_kernels import reference

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


def trl_loss(logps, inputs, *, loss_type, beta, level, eps_low=0.2, eps_high=0.28, delta=None, bias_kl=False,
             max_completion_length=None):  # fmt: skip
    """Run TRL's _compute_loss on a stand-in trainer; returns (loss, TRL's logged metrics)."""
    metrics = {"train": defaultdict(list)}
    identity = lambda x, **_: x
    trainer = SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        importance_sampling_level=level, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, max_completion_length=max_completion_length or logps.shape[1],
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True), _metrics=metrics,
        accelerator=SimpleNamespace(num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity,
                                    sync_gradients=True),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, sapo_temperature_pos=1.0,
                             sapo_temperature_neg=1.05, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )  # fmt: skip
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, metrics["train"]


def batch(b=5, length=9, dtype=torch.float64):
    logps = -torch.rand(b, length, dtype=dtype) * 3
    old = logps + 0.3 * torch.randn(b, length, dtype=dtype)  # ratios on both sides of the clip range
    ref = logps + 0.2 * torch.randn(b, length, dtype=dtype)
    lengths = torch.randint(1, length + 1, (b,))
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)
    adv = torch.randn(b, dtype=dtype)
    return logps, old, ref, mask, adv


@pytest.mark.parametrize(
    "loss_type,level,beta", list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))
)
def test_loss_and_gradient_match_trl(loss_type, level, beta):
    logps, old, ref, mask, adv = batch()
    num_items = mask.sum() * 1.5  # as if the generation batch were larger than this micro-batch
    inputs = {
        "prompt_ids": torch.zeros(5, 2, dtype=torch.long), "prompt_mask": torch.ones(5, 2, dtype=torch.long),
        "completion_ids": torch.zeros(5, 9, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": num_items,
    }  # fmt: skip
    lp_trl = logps.clone().requires_grad_()
    expected, trl_metrics = trl_loss(lp_trl, inputs, loss_type=loss_type, beta=beta, level=level)
    (g_trl,) = torch.autograd.grad(expected, lp_trl)

    lp = logps.clone().requires_grad_()
    loss, metrics = reference.grpo_loss(
        lp, old, adv, ref_logps=ref, mask=mask, loss_type=loss_type, beta=beta, importance_sampling_level=level,
        epsilon_low=0.2, epsilon_high=0.28, num_items_in_batch=num_items,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    assert_close(loss, expected, name="loss", dtype=torch.float64)
    assert_close(g * mask, g_trl * mask, name="d loss / d logps", dtype=torch.float64)
    for key, values in trl_metrics.items():
        if key in metrics:
            assert metrics[key].item() == pytest.approx(values[-1], abs=1e-6), key  # TRL counts in fp32
    expected_keys = {"clip_ratio/low_mean", "clip_ratio/high_mean"} if loss_type != "cispo" else {"cispo_clip_ratio"}
    assert expected_keys <= set(metrics) and (beta == 0.0 or "kl" in metrics)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_sided_delta_and_bias_corrected_kl_match_trl(loss_type):
    logps, old, ref, mask, adv = batch()
    inputs = {
        "prompt_ids": torch.zeros(5, 1, dtype=torch.long), "prompt_mask": torch.ones(5, 1, dtype=torch.long),
        "completion_ids": torch.zeros(5, 9, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    lp_trl = logps.clone().requires_grad_()
    expected, _ = trl_loss(lp_trl, inputs, loss_type=loss_type, beta=0.04, level="token", delta=1.1, bias_kl=True)
    (g_trl,) = torch.autograd.grad(expected, lp_trl)
    lp = logps.clone().requires_grad_()
    loss, _ = reference.grpo_loss(
        lp, old, adv, ref_logps=ref, mask=mask, loss_type=loss_type, beta=0.04, delta=1.1,
        use_bias_correction_kl=True, epsilon_high=0.28,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    assert_close(loss, expected, name="loss", dtype=torch.float64)
    assert_close(g * mask, g_trl * mask, name="grad", dtype=torch.float64)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_equals_padded(loss_type):
    logps, old, ref, mask, adv = batch()
    lengths = mask.sum(1).long()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    keep = mask.bool()
    kw = dict(loss_type=loss_type, beta=0.04, epsilon_high=0.28)
    padded, _ = reference.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, **kw)
    packed, _ = reference.grpo_loss(logps[keep], old[keep], adv, ref_logps=ref[keep], cu_seqlens=cu, **kw)
    if loss_type == "dr_grpo":  # normalizes by B * max_completion_length: give the padded length explicitly
        packed, _ = reference.grpo_loss(
            logps[keep], old[keep], adv, ref_logps=ref[keep], cu_seqlens=cu, max_completion_length=9, **kw
        )
    assert_close(packed, padded, name="packed vs padded", dtype=torch.float64)


def test_on_policy_ratio_is_one_and_gradient_flows():
    logps, _, _, mask, adv = batch()
    lp = logps.clone().requires_grad_()
    loss, metrics = reference.grpo_loss(lp, None, adv, mask=mask, loss_type="bnpo")
    (g,) = torch.autograd.grad(loss, lp)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    expected = -(adv[:, None] * mask) / mask.sum()  # d/dlogp of -exp(logp - sg(logp)) A at ratio 1
    assert_close(g, expected, name="on-policy grad", dtype=torch.float64)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_importance_correction_by_hand(mode):
    logps = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.zeros(2, 3, dtype=torch.float64)
    sampler = torch.tensor([[0.0, -2.0, 0.5], [0.1, 0.0, 0.0]], dtype=torch.float64)  # exp(2) > cap 3
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = reference.grpo_loss(logps, old, adv, sampler_logps=sampler, sampler_is_mode=mode, loss_type="bnpo")
    per_token = -adv[:, None] * torch.ones(2, 3, dtype=torch.float64)  # ratio 1, unclipped
    diff = old - sampler
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = diff.exp()
    r = r.clamp(max=3.0) if mode.endswith("truncate") else torch.where(r > 3.0, 0.0, r)
    assert loss.item() == pytest.approx((per_token * r).mean().item())
    assert metrics["sampler_logp_abs_diff"].item() == pytest.approx(sampler.abs().mean().item())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_logprobs_and_entropy_match_trl(temperature):
    logits = torch.randn(3, 7, 1001, dtype=torch.float64) * 4  # vocab not a power of two
    ids = torch.randint(0, 1001, (3, 7))
    logps, entropy = reference.selective_logprobs(logits, ids, temperature=temperature, return_entropy=True)
    assert_close(logps, trl_utils.selective_log_softmax(logits / temperature, ids), name="logps", dtype=torch.float64)
    assert_close(entropy, trl_utils.entropy_from_logits(logits / temperature), name="entropy", dtype=torch.float64)


def test_reference_loss_gradcheck():
    logps, old, ref, mask, adv = batch(3, 4)
    for loss_type in LOSS_TYPES:
        kw = dict(ref_logps=ref, mask=mask, loss_type=loss_type, beta=0.1)
        f = lambda lp, kw=kw: reference.grpo_loss(lp, old, adv, **kw)[0]
        assert torch.autograd.gradcheck(f, (logps.clone().requires_grad_(),))
