"""grpo-kernels: fused kernels for GRPO training.

Importing the package loads the compiled extension `grpo_kernels._C` (the C++ CPU kernels), registers
every op in `torch.ops.grpo_kernels`, and registers the packed attention "grpo_varlen" with transformers (when
transformers is imported, before or after).
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

try:
    from . import _C  # noqa: F401
except ImportError as exc:  # a clear message instead of a later AttributeError
    raise ImportError(
        "grpo_kernels._C is not built for this torch; build it with `make build` or "
        f"`pip install --no-build-isolation -e .` ({exc})"
    ) from exc

from . import attention, ops, packing, reference, theory
from .advantages import group_advantages
from .fused_linear import fused_linear_grpo_loss, fused_linear_logprobs
from .liger_compat import FusedLinearGRPOLoss
from .logprobs import selective_logprobs
from .loss import GRPOLoss, grpo_loss, grpo_loss_from_logits
from .options import LossOptions
from .types import GroupAdvantages

attention.register_on_import()  # attn_implementation="grpo_varlen" for HF models, without importing transformers

__version__ = "0.1.0"

__all__ = [
    "FusedLinearGRPOLoss",
    "GRPOLoss",
    "GroupAdvantages",
    "LossOptions",
    "__version__",
    "attention",
    "fused_linear_grpo_loss",
    "fused_linear_logprobs",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_logits",
    "ops",
    "packing",
    "reference",
    "selective_logprobs",
    "theory",
]
