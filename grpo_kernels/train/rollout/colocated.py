"""`sampling.placement = "colocated"`: rollouts sampled in the trainer's own processes, a `RolloutSource`
(train/rollout/source.py).

Every rank samples its share of the groups (grpo_kernels.train.model.fsdp), then all ranks hold the whole rollout. The
sampler is the HF one (the training model itself; a full copy per rank when the model is sharded, gathered from the
shards when each rank loaded only its own: it generates alone, with no collective per token) or an in-process
vLLM engine (`make_sampler`); after each optimizer step the full weights are copied into it,
unless it is the training model itself.

The vLLM engine is started on the model's own directory (the built-in tiny model, which has none: its config.json
alone, in a temporary folder) with random weights (vLLM's load_format "dummy": no file but config.json is read,
no copy of the model is written), then given the trainer's weights in memory before it samples: so a model changed
since it was read (an SFT warm start, a converter, a checkpoint) samples as the trainer holds it, in the engine's
dtype. With sampling.vllm_sleep the engine sleeps while the policy trains (after each rollout) and wakes for the
weights and the next rollout; at level 2 its weights are given back at every sync, an update or not.
"""

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
from ..model.sharded_load import unsharded_copy
from .hf_sampler import HFSampler
from .sampling import HeldOut, collect, held_out

__all__ = ["Colocated", "make_sampler", "vllm_weights"]


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
        # The checkpoint's weights (a new run's sampler was made from the model as it is).
        self.sync(policy, version, changed=resumed)

    def start(self, *, first: int, last: int, group_size) -> None:
        self.group_size = group_size

    def batch(self, step: int) -> dict:
        g, start = self.group_size(), time.perf_counter()
        rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.rewards, self.stream.take,
                                                   step, g, self.d)  # fmt: skip
        self._rest()
        return {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "timing": {"rollout_generate_s": time.perf_counter() - start},
                "prompt_state": self.stream.state_dict(), "reward_logged": self.rewards.take_logged()}  # fmt: skip

    def sync(self, policy, version: int, *, changed: bool = True) -> dict:
        """The new weights to the sampler (the shared-model HF sampler needs nothing): vLLM gets the HF model's
        names (a converted model's are translated), the HF sampler's copy of the (converted) model its own. An
        engine whose weights a level-2 sleep discarded gets them whether they changed or not."""
        if (changed and (self.d.distributed or self.vllm)) or getattr(self.sampler, "needs_weights", False):
            start = time.perf_counter()
            self.sampler.load_weights(vllm_weights(policy.model) if self.vllm else full_state_dict(policy.model))
            return {"weight_sync_s": time.perf_counter() - start}
        return {}

    def evaluate(self) -> HeldOut:
        return held_out(self.sampler, self.tok, self.rewards, self.eval_set, seed=self.config.seed + 7, d=self.d)

    def _rest(self) -> None:
        """The vLLM engine to sleep (sampling.vllm_sleep) while the policy trains, after each rollout (a held-out
        evaluation is followed by a rollout, not by training); it wakes by itself."""
        if self.vllm and self.config.sampling.vllm_sleep:
            self.sampler.sleep()

    def close(self) -> None:
        if self.vllm:
            self.sampler.close()  # vLLM's shutdown also destroys the default process group


def make_sampler(config: TrainConfig, model, tok, d: Dist):
    """The HF sampler (the training model itself, or a full copy when the model is or will be sharded) or vLLM."""
    s = config.sampling
    if s.sampler == "hf":
        return HFSampler(unsharded_copy(model) if d.distributed else model, eos_id=tok.eos_id, pad_id=tok.pad_id,
                         stop_ids=tok.stop_ids,
                         max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                         max_batch_rows=s.hf_max_batch_rows)  # fmt: skip
    from .vllm_sampler import VLLMSampler, engine_enforce_eager, hf_weight_names, model_directory, write_engine_config

    dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
    if not torch.cuda.is_available():  # vLLM's CPU cache is VLLM_CPU_KVCACHE_SPACE GiB (VLLMSampler's default: 1)
        short = kv_cache_shortfall(model.config, group_size=s.group_size, dtype=dtype,
                                   max_model_len=model.generation_config.max_length,
                                   space_gib=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1))  # fmt: skip
        if short:
            warnings.warn(short, stacklevel=2)
    source = model_directory(config.model.name)
    with tempfile.TemporaryDirectory(prefix="grpo-sampler-config-") as scratch:  # (used by the tiny model only)
        directory = source if source is not None else write_engine_config(model, scratch)
        sampler = VLLMSampler(directory, eos_id=tok.eos_id, stop_ids=tok.stop_ids, max_new_tokens=s.max_new_tokens,
                              temperature=s.temperature, max_model_len=model.generation_config.max_length,
                              top_p=s.top_p, gpu_memory_utilization=s.vllm_gpu_memory_utilization,
                              dtype=dtype, external_launcher=d.distributed, load_format="dummy",
                              weight_names=hf_weight_names(model), sleep_level=s.vllm_sleep,
                              enforce_eager=engine_enforce_eager(s.vllm_enforce_eager,
                                                                 cuda=torch.cuda.is_available()))  # fmt: skip
    sampler.load_weights(vllm_weights(model))  # the model as it is now, whatever its files hold
    return sampler


def vllm_weights(model) -> dict:
    """The full weights of a (sharded, converted) model under the HF names a vLLM engine takes (a collective when
    the model is sharded: every rank calls it)."""
    return hf_state_dict(model, full_state_dict(model))
