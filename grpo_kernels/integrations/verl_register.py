"""Importing this module registers grpo_kernels' policy losses in verl and routes verl's fused head to grpo_kernels.

It is the module to name in verl's `external_lib` (`actor_rollout_ref.model.external_lib`, imported by verl's model
config in every worker) or in `VERL_USE_EXTERNAL_MODULES`: it runs `register_verl_losses()` (loss_mode
grpo_kernels_vanilla / _gspo / _cispo / _sapo) and `use_grpo_kernels_fused_linear()` (what verl runs for
`use_fused_kernels=True` with `fused_kernel_options.impl_backend=torch`). See grpo_kernels.integrations.verl.
"""

from .verl import register_verl_losses, use_grpo_kernels_fused_linear

LOSS_MODES = register_verl_losses()
use_grpo_kernels_fused_linear()
