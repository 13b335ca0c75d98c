"""`sampling.placement = "colocated"`: rollouts sampled in the trainer's own processes, a `RolloutSource`
(train/rollout_source.py).

Every rank samples its share of the groups (grpo_kernels.train.fsdp), then all ranks hold the whole rollout. The
sampler is the HF one (the training model itself; a full copy per rank when the model is sharded) or an in-process
vLLM engine (`make_sampler` in train/build.py); after each optimizer step the full weights are copied into it,
unless it is the training model itself.
"""

import time

from .build import make_sampler
from .config import TrainConfig
from .fsdp import Dist, full_state_dict
from .sampling import HeldOut, collect, held_out
from .tasks import PromptStream

__all__ = ["Colocated"]


class Colocated:
    """The sampler of this process, the prompt stream, the held-out examples."""

    def __init__(self, config: TrainConfig, model, tok, task, train_set, eval_set, d: Dist):
        """Before the model is sharded: the sampler is made from it."""
        self.config, self.d, self.tok, self.task, self.eval_set = config, d, tok, task, eval_set
        self.stream = PromptStream(train_set, config.seed)
        self.sampler = make_sampler(config, model, tok, d)
        self.group_size = None

    def begin(self, policy, *, version: int, resumed: bool) -> None:
        if resumed:  # the checkpoint's weights (a new run's sampler was made from the model as it is)
            self.sync(policy, version)

    def start(self, *, first: int, last: int, group_size) -> None:
        self.group_size = group_size

    def batch(self, step: int) -> dict:
        g, start = self.group_size(), time.perf_counter()
        rollout, sampled, rounds, tokens = collect(self.config, self.sampler, self.tok, self.task, self.stream.take,
                                                   step, g, self.d)  # fmt: skip
        return {"rollout": rollout, "sampled": sampled, "rounds": rounds, "tokens": tokens, "group_size": g,
                "timing": {"rollout_generate_s": time.perf_counter() - start},
                "prompt_state": self.stream.state_dict(), "reward_logged": self.task.rewards.take_logged()}  # fmt: skip

    def sync(self, policy, version: int, *, changed: bool = True) -> dict:
        """The new weights to the sampler (the shared-model HF sampler needs nothing)."""
        if changed and (self.d.distributed or self.config.sampling.sampler == "vllm"):
            start = time.perf_counter()
            self.sampler.load_weights(full_state_dict(policy.model))
            return {"weight_sync_s": time.perf_counter() - start}
        return {}

    def evaluate(self) -> HeldOut:
        return held_out(self.sampler, self.tok, self.task, self.eval_set, seed=self.config.seed + 7, d=self.d)

    def close(self) -> None:
        if self.config.sampling.sampler == "vllm":
            self.sampler.close()  # vLLM's shutdown also destroys the default process group
