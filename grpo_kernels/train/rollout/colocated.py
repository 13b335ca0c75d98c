"""`sampling.placement = "colocated"`: rollouts sampled in the trainer's own processes, a `RolloutSource`
(train/rollout/source.py).

Every rank samples its share of the groups (grpo_kernels.train.model.fsdp), then all ranks hold the whole rollout. The
sampler is the HF one (the training model itself; a full copy per rank when the model is sharded) or an in-process
vLLM engine (`make_sampler`); after each optimizer step the full weights are copied into it,
unless it is the training model itself.
"""

import copy
import os
import tempfile
import time
import warnings

import torch

from ..config import TrainConfig
from ..data.tasks import PromptStream
from ..model.converters import hf_state_dict
from ..model.fsdp import Dist, full_state_dict
from ..model.lengths import kv_cache_shortfall
from .hf_sampler import HFSampler
from .sampling import HeldOut, collect, held_out

__all__ = ["Colocated", "make_sampler"]


class Colocated:
    """The sampler of this process, the prompt stream, the held-out examples."""

    def __init__(self, config: TrainConfig, model, inputs, d: Dist):
        """Before the model is sharded: the sampler is made from it. inputs: the run's `Loaded` (its tokenizer,
        examples and rewards)."""
        self.config, self.d, self.tok, self.rewards = config, d, inputs.tok, inputs.rewards
        self.stream, self.eval_set = PromptStream(inputs.train_set, config.seed), inputs.eval_set
        self.sampler = make_sampler(config, model, self.tok, d)
        self.vllm = config.sampling.sampler == "vllm"
        self.group_size = None

    def begin(self, policy, *, version: int, resumed: bool) -> None:
        if resumed:  # the checkpoint's weights (a new run's sampler was made from the model as it is)
            self.sync(policy, version)

    def start(self, *, first: int, last: int, group_size) -> None:
        self.group_size = group_size

    def batch(self, step: int) -> dict:
        g, start = self.group_size(), time.perf_counter()
        rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.rewards, self.stream.take,
                                                   step, g, self.d)  # fmt: skip
        return {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "timing": {"rollout_generate_s": time.perf_counter() - start},
                "prompt_state": self.stream.state_dict(), "reward_logged": self.rewards.take_logged()}  # fmt: skip

    def sync(self, policy, version: int, *, changed: bool = True) -> dict:
        """The new weights to the sampler (the shared-model HF sampler needs nothing): vLLM gets the HF model's
        names (a converted model's are translated), the HF sampler's copy of the (converted) model its own."""
        if changed and (self.d.distributed or self.vllm):
            start = time.perf_counter()
            weights = full_state_dict(policy.model)
            self.sampler.load_weights(hf_state_dict(policy.model, weights) if self.vllm else weights)
            return {"weight_sync_s": time.perf_counter() - start}
        return {}

    def evaluate(self) -> HeldOut:
        return held_out(self.sampler, self.tok, self.rewards, self.eval_set, seed=self.config.seed + 7, d=self.d)

    def close(self) -> None:
        if self.vllm:
            self.sampler.close()  # vLLM's shutdown also destroys the default process group


def make_sampler(config: TrainConfig, model, tok, d: Dist):
    """The HF sampler (the training model itself, or a full copy when the model will be sharded) or vLLM."""
    s = config.sampling
    if s.sampler == "hf":
        return HFSampler(copy.deepcopy(model) if d.distributed else model, eos_id=tok.eos_id, pad_id=tok.pad_id,
                         stop_ids=tok.stop_ids,
                         max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                         max_batch_rows=s.hf_max_batch_rows)  # fmt: skip
    from ..model.hf import save_hf_model
    from .vllm_sampler import VLLMSampler

    dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
    if not torch.cuda.is_available():  # vLLM's CPU cache is VLLM_CPU_KVCACHE_SPACE GiB (VLLMSampler's default: 1)
        short = kv_cache_shortfall(model.config, group_size=s.group_size, dtype=dtype,
                                   max_model_len=model.generation_config.max_length,
                                   space_gib=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1))  # fmt: skip
        if short:
            warnings.warn(short, stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="grpo-sampler-") as directory:  # vLLM loads from a directory
        save_hf_model(model, directory)
        return VLLMSampler(directory, eos_id=tok.eos_id, stop_ids=tok.stop_ids, max_new_tokens=s.max_new_tokens,
                           temperature=s.temperature, max_model_len=model.generation_config.max_length,
                           top_p=s.top_p, gpu_memory_utilization=s.vllm_gpu_memory_utilization,
                           dtype=dtype, external_launcher=d.distributed)  # fmt: skip
