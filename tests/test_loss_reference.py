"""The loss spec (reference.grpo_loss, reference.selective_logprobs) against the installed TRL's own code.

TRL's GRPOTrainer._compute_loss is called as it is, on a stand-in trainer object whose model forward returns
our log-probs, so its math and normalizers are used, not retyped.
"""

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import LOSS_TYPES, assert_close

from grpo_kernels import reference

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")


def trl_loss(logps, inputs, *, loss_type, beta, level, eps_low=0.2, eps_high=0.28, delta=None, bias_kl=False,
             max_completion_length=None, vespo=(2.0, 3.0, 3.0, 2.0), use_vllm=False):  # fmt: skip
    """Run TRL's _compute_loss on a stand-in trainer; returns (loss, TRL's logged metrics)."""
    metrics = {"train": defaultdict(list)}
    identity = lambda x, **_: x
    trainer = SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        importance_sampling_level=level, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=use_vllm, vllm_importance_sampling_correction=use_vllm, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, max_completion_length=max_completion_length or logps.shape[1],
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True), _metrics=metrics,
        accelerator=SimpleNamespace(num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity,
                                    sync_gradients=True),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, sapo_temperature_pos=1.0,
                             sapo_temperature_neg=1.05, steps_per_generation=1, vespo_k_pos=vespo[0],
                             vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3]),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        get_gamma_weights=trl_grpo.GRPOTrainer.get_gamma_weights,  # a staticmethod: VESPO's weight
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
    expected_keys = {"cispo": {"cispo_clip_ratio"}, "vespo": {"vespo/phi_seq_mean"}}.get(
        loss_type, {"clip_ratio/low_mean", "clip_ratio/high_mean"}
    )
    assert all(key in metrics for key in trl_metrics if key not in ("entropy", "clip_ratio/low_min",
                                                                     "clip_ratio/high_max")), set(trl_metrics)
    assert expected_keys <= set(metrics) and (beta == 0.0 or "kl" in metrics)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
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


@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vespo_sampler_ratio_gamma_options_and_per_token_advantages_match_trl(level, mode, adv_per_token):
    """VESPO folds TRL's vLLM importance-sampling ratio (truncated, or masked to 0) into its sequence weight instead
    of multiplying the loss by it; non-default k and lambda (lambda_neg = 0: TRL floors it at 1e-4); advantages per
    token (phi per token, by each advantage's sign); the bias-corrected KL at either level."""
    logps, old, ref, mask, adv = batch()
    sampler = old + 0.5 * torch.randn_like(old)
    if adv_per_token:
        adv = adv[:, None] * torch.randn_like(logps)
    inputs = {
        "prompt_ids": torch.zeros(5, 2, dtype=torch.long), "prompt_mask": torch.ones(5, 2, dtype=torch.long),
        "completion_ids": torch.zeros(5, 9, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    options = {}
    if mode is not None:  # TRL's own ratio, as its _generate_and_score_completions builds it (no lower clip)
        ratio = torch.nan_to_num((old - sampler) * mask, nan=0.0).exp()
        ratio = ratio.clamp(max=1.5) if mode == "token_truncate" else ratio.masked_fill(ratio > 1.5, 0.0)
        inputs["importance_sampling_ratio"] = ratio
        options = dict(sampler_logps=sampler, sampler_is_mode=mode, sampler_is_cap=1.5)
    vespo = (1.5, 0.5, 0.25, 0.0)
    lp_trl = logps.clone().requires_grad_()
    expected, trl_metrics = trl_loss(lp_trl, inputs, loss_type="vespo", beta=0.04, level=level, bias_kl=True,
                                     vespo=vespo, use_vllm=mode is not None)  # fmt: skip
    (g_trl,) = torch.autograd.grad(expected, lp_trl)
    lp = logps.clone().requires_grad_()
    loss, metrics = reference.grpo_loss(
        lp, old, adv, ref_logps=ref, mask=mask, loss_type="vespo", beta=0.04, importance_sampling_level=level,
        use_bias_correction_kl=True, vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2],
        vespo_lambda_neg=vespo[3], **options,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    assert_close(loss, expected, name="loss", dtype=torch.float64)
    assert_close(g * mask, g_trl * mask, name="grad", dtype=torch.float64)
    phi = trl_metrics["vespo/phi_seq_mean"][-1]
    assert 0.0 < phi and metrics["vespo/phi_seq_mean"].item() == pytest.approx(phi, rel=1e-6)
    assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"][-1], rel=1e-6)
    without = reference.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, loss_type="vespo", beta=0.04,
                                  importance_sampling_level=level, use_bias_correction_kl=True)[0]  # fmt: skip
    assert abs(loss.item() - without.item()) > 1e-6, "the options changed nothing: the test would prove nothing"


def test_luspo_sums_each_sequence_and_vespo_weight_is_one_on_policy():
    """By hand: luspo = mean over sequences of the masked sum (no division by the length); vespo on-policy has
    phi(1) = e^lam e^-lam = 1, so its gradient is -A / sum m per token, as dapo's."""
    logps, _, _, mask, adv = batch()
    lp = logps.clone().requires_grad_()
    loss, _ = reference.grpo_loss(lp, None, adv, mask=mask, loss_type="luspo")
    assert loss.item() == pytest.approx((-adv * mask.sum(-1)).mean().item())
    loss, metrics = reference.grpo_loss(lp, None, adv, mask=mask, loss_type="vespo")
    (g,) = torch.autograd.grad(loss, lp)
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(1.0)
    assert_close(g, -(adv[:, None] * mask) / mask.sum(), name="vespo on-policy grad", dtype=torch.float64)


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
    # vespo's phi is a stop-gradient weight (TRL computes it under no_grad): its analytic gradient is not the finite
    # difference by design, and is checked against TRL's autograd above instead.
    for loss_type in (t for t in LOSS_TYPES if t != "vespo"):
        kw = dict(ref_logps=ref, mask=mask, loss_type=loss_type, beta=0.1)
        f = lambda lp, kw=kw: reference.grpo_loss(lp, old, adv, **kw)[0]
        assert torch.autograd.gradcheck(f, (logps.clone().requires_grad_(),))
