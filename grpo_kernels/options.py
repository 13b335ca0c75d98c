"""The options of the GRPO loss: one frozen type with their names, defaults, validation, the scalars the loss
kernels take and the metric names the loss reports.

`LossOptions` is what `grpo_loss`, `fused_linear_grpo_loss`, `LossConfig`, `FusedLinearGRPOLoss` and the TRL
integration build and check; its `kernel_scalars()` are the named scalar arguments of the custom op
`torch.ops.grpo_kernels.grpo_loss_fwd`. The per-call tensors that go with the options (ref_logps, sampler_logps,
num_items_in_batch) are checked in `_checks.check_loss_inputs`. No Triton import here (the reference may use it).
"""

import functools
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

from ._checks import check_number

__all__ = ["LOSS_TYPES", "SAMPLER_IS_MODES", "KernelScalars", "LossOptions", "loss_options"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# The kernels' encodings: the loss family (0: the clipped objective, 1: cispo, 2: sapo, 3: vespo's gamma weight) and
# the sampler mode. luspo is the clipped objective with its own normalizer.
LOSS_FAMILIES = {"grpo": 0, "bnpo": 0, "dr_grpo": 0, "dapo": 0, "cispo": 1, "sapo": 2, "luspo": 0, "vespo": 3}
VESPO_MIN_LAMBDA = 1e-4  # TRL's floor on VESPO's rate lambda
SAMPLER_MODES = {mode: i for i, mode in enumerate(SAMPLER_IS_MODES)}


class KernelScalars(NamedTuple):
    """The scalar arguments of `grpo_kernels::grpo_loss_fwd`, by the op schema's names."""

    loss_family: int
    seq_level: bool
    sampler_mode: int
    eps_low: float
    eps_high: float
    delta: float
    beta: float
    bias_kl: bool
    sampler_cap: float
    tau_pos: float
    tau_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LossOptions:
    """The loss's options (TRL/Liger names), validated at construction; each bad value raises a ValueError whose
    message starts with the option's name."""

    loss_type: str = "dapo"
    """Aggregation/objective: "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo" (the clipped objective
    summed per sequence, averaged over sequences: GSPO scaled by length, meant with importance_sampling_level=
    "sequence") or "vespo" (-phi A logp with VESPO's detached gamma weight phi of the whole sequence's ratio)."""
    epsilon_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - epsilon_low; 0 <= epsilon_low < 1."""
    epsilon_high: float = 0.2
    """Upper clip at 1 + epsilon_high (DAPO's clip-higher uses 0.28); cispo's cap on the ratio."""
    delta: float | None = None
    """Two-sided clip: the ratio is also capped at delta (> 0) for negative advantages; None = off."""
    beta: float = 0.0
    """Weight of the k3 KL to the reference model (0 = no KL term, no ref_logps needed)."""
    importance_sampling_level: str = "token"
    """One importance ratio per "token", or per "sequence" (GSPO)."""
    max_completion_length: int | None = None
    """dr_grpo's normalizing constant; None = the longest completion of the micro-batch."""
    sampler_is_mode: str | None = None
    """Correction for the trainer/sampler mismatch: None, "token_truncate", "token_mask", "sequence_truncate" or
    "sequence_mask" (sampler_logps are then given with each call)."""
    sampler_is_cap: float = 3.0
    """Where the sampler correction truncates or masks the ratio (> 0)."""
    use_bias_correction_kl: bool = False
    """Multiply the KL term by the importance ratio."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for positive advantages (> 0)."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for negative advantages (> 0)."""
    vespo_k_pos: float = 2.0
    """VESPO's power k for advantages >= 0 (>= 0): phi(w) = exp(lambda + k log w - lambda w)."""
    vespo_lambda_pos: float = 3.0
    """VESPO's decay rate lambda for advantages >= 0 (>= 0; floored at 1e-4, as TRL does)."""
    vespo_k_neg: float = 3.0
    """VESPO's power k for negative advantages (>= 0)."""
    vespo_lambda_neg: float = 2.0
    """VESPO's decay rate lambda for negative advantages (>= 0; floored at 1e-4)."""

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}, got {self.loss_type!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        check_number("epsilon_low", self.epsilon_low, low=0.0, high=1.0)
        check_number("epsilon_high", self.epsilon_high, low=0.0)
        check_number("delta", self.delta, low=0.0, low_open=True, allow_none=True)
        check_number("beta", self.beta, low=0.0)
        check_number("sampler_is_cap", self.sampler_is_cap, low=0.0, low_open=True)
        check_number("sapo_temperature_pos", self.sapo_temperature_pos, low=0.0, low_open=True)
        check_number("sapo_temperature_neg", self.sapo_temperature_neg, low=0.0, low_open=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_number(name, getattr(self, name), low=0.0)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        mcl = self.max_completion_length
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, int) or mcl < 1):
            raise ValueError(f"max_completion_length must be a positive int, got {mcl!r}")
        if self.sampler_is_mode is not None and self.sampler_is_mode not in SAMPLER_IS_MODES:
            raise ValueError(
                f"sampler_is_mode must be one of {', '.join(map(repr, SAMPLER_IS_MODES))}, got {self.sampler_is_mode!r}"
            )
        if self.loss_type == "vespo" and (self.sampler_is_mode or "").startswith("sequence"):
            raise ValueError(
                f"sampler_is_mode={self.sampler_is_mode!r} with loss_type='vespo': VESPO folds per-token sampler "
                "weights into its sequence weight (TRL: 'token_truncate' or 'token_mask' only)"
            )

    @property
    def seq_level(self) -> bool:
        """One importance ratio per sequence (GSPO)."""
        return self.importance_sampling_level == "sequence"

    @property
    def whole_sequence(self) -> bool:
        """Each token's loss needs a statistic of its whole sequence: GSPO, a sequence-level sampler mode, or vespo."""
        return self.seq_level or (self.sampler_is_mode or "").startswith("sequence") or self.loss_type == "vespo"

    def kwargs(self) -> dict:
        """{option name: value}, the keyword arguments of grpo_loss (and of the reference) for these options."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def kernel_scalars(self) -> KernelScalars:
        """The scalar arguments of the loss op (delta None -> +inf; sampler_mode 0 when no correction)."""
        return _kernel_scalars(self)

    def _kernel_scalars(self) -> KernelScalars:
        return KernelScalars(
            loss_family=LOSS_FAMILIES[self.loss_type], seq_level=self.seq_level,
            sampler_mode=SAMPLER_MODES.get(self.sampler_is_mode, 0), eps_low=float(self.epsilon_low),
            eps_high=float(self.epsilon_high), delta=math.inf if self.delta is None else float(self.delta),
            beta=float(self.beta), bias_kl=self.use_bias_correction_kl, sampler_cap=float(self.sampler_is_cap),
            tau_pos=float(self.sapo_temperature_pos), tau_neg=float(self.sapo_temperature_neg),
            vespo_k_pos=float(self.vespo_k_pos), vespo_lambda_pos=max(float(self.vespo_lambda_pos), VESPO_MIN_LAMBDA),
            vespo_k_neg=float(self.vespo_k_neg), vespo_lambda_neg=max(float(self.vespo_lambda_neg), VESPO_MIN_LAMBDA),
        )  # fmt: skip

    def metric_names(self, *, sampler: bool, entropy: bool = False) -> tuple[str, ...]:
        """The metrics the loss reports, in order, named as TRL logs them (sampler: sampler_logps are given)."""
        if self.loss_type in ("cispo", "vespo"):
            names = ("cispo_clip_ratio" if self.loss_type == "cispo" else "vespo/phi_seq_mean", "ratio_mean")
        else:
            names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean")
        return names + ("kl",) * (self.beta != 0.0) + ("sampler_logp_abs_diff",) * sampler + ("entropy",) * entropy


OPTION_NAMES = tuple(f.name for f in fields(LossOptions))


@functools.lru_cache(maxsize=64)
def _kernel_scalars(options: LossOptions) -> KernelScalars:
    return options._kernel_scalars()


@functools.lru_cache(maxsize=64, typed=True)  # typed: 1 and True (or 1.0) are different options
def _cached_options(*values) -> LossOptions:
    return LossOptions(**dict(zip(OPTION_NAMES, values, strict=True)))


def loss_options(**options) -> LossOptions:
    """LossOptions(**options), cached: a training loop passes the same options at every call, and building and
    validating them costs more Python time (~10 us) than the rest of a small loss call's checks."""
    defaults = LossOptions.__dataclass_fields__
    if not options.keys() <= defaults.keys():
        return LossOptions(**options)  # raises TypeError naming the unknown option
    values = tuple(options[name] if name in options else defaults[name].default for name in OPTION_NAMES)
    try:
        return _cached_options(*values)
    except TypeError:  # an unhashable value: build it uncached (its check raises the usual ValueError)
        return LossOptions(**options)
