// grpo_kernels._C: the C++ CPU kernels of grpo_kernels, one source file per op family. The spec of every op
// is grpo_kernels/reference.py; the Python side registers these functions as the CPU kernels of the
// torch.ops.grpo_kernels ops.

#include "grpo_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  init_advantages(m);
  init_logprobs(m);
  init_loss(m);
  init_packing(m);
}
