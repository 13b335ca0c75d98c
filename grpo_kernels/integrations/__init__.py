"""Integrations with other training stacks.

`grpo_kernels.integrations.hf.compute_logprobs`: per-token log-probs of an HF causal LM without logits (padded
or packed). `grpo_kernels.integrations.trl`: `FusedGRPOTrainer`, a drop-in for `trl.GRPOTrainer` whose loss is
`fused_linear_grpo_loss`, and `use_grpo_kernels(trainer)` for an existing trainer instance. The TRL names are
imported on first use, so this package does not need TRL installed until then.

The other trainers' drop-ins are submodules (their names would clash, and neither imports its trainer at import):
`grpo_kernels.integrations.verl` (verl's policy-loss registry and fused log-prob/entropy head;
`grpo_kernels.integrations.verl_register` is the module for verl's `external_lib`) and
`grpo_kernels.integrations.openrlhf` (OpenRLHF's `PolicyLoss` and the Actor's fused log-probs).
"""

from .hf import compute_logprobs

__all__ = ["FusedGRPOTrainer", "compute_logprobs", "use_grpo_kernels"]


def __getattr__(name):
    if name in ("FusedGRPOTrainer", "use_grpo_kernels"):
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
