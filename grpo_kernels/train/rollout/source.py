"""Where a run's rollouts come from, behind one interface: the trainer's loop holds one `RolloutSource` and never
asks which kind it is.

    rollouts.begin(policy, version=first, resumed=...)   # the policy built (and a checkpoint loaded)
    rollouts.start(first=..., last=..., group_size=...)  # the loop begins: batches may be sampled from now on
    batch = rollouts.batch(step)                          # every step
    metrics.update(rollouts.sync(policy, step + 1))       # after the optimizer step: the new weights out
    result = rollouts.evaluate()                          # the held-out evaluation
    rollouts.close()                                      # on every exit path

Two implementations: `Colocated` (train/rollout/colocated.py: the HF sampler or an in-process vLLM engine on every rank)
and `Decoupled` (train/rollout/decoupled.py: rollout servers, sampled by rank 0, staleness-bounded).
"""

from collections.abc import Callable
from typing import Protocol

from ..data.tasks import PromptStream
from .sampling import HeldOut

__all__ = ["RolloutSource"]


class RolloutSource(Protocol):
    """The batches of a run's steps, the sampler's weights, the held-out evaluation."""

    stream: PromptStream
    """The training prompts in their order; a batch carries the stream's state after it (its "prompt_state", what a
    checkpoint saves) and a resumed run loads that state here."""

    def begin(self, policy, *, version: int, resumed: bool) -> None:
        """Once the policy is built (sharded, a checkpoint loaded): the sampler gets its weights where they can
        differ from the model the sampler was made from; version: the optimizer steps done."""

    def start(self, *, first: int, last: int, group_size: Callable[[], int]) -> None:
        """The loop over steps first..last-1 begins; group_size() is the G of the next batch sampled."""

    def batch(self, step: int) -> dict:
        """Every rank: the batch of `step`: rollout (None: no group survived), sampled, rounds, tokens, group_size,
        prompt_state, reward_logged and timing (the step's metrics of the sampling)."""

    def sync(self, policy, version: int, *, changed: bool = True) -> dict:
        """After an optimizer step (version: the steps done; changed False: a step without an update): the new
        weights to the sampler; the metrics of the sync."""

    def evaluate(self) -> HeldOut:
        """Every rank: the held-out evaluation with the sampler's current weights."""

    def close(self) -> None:
        """Stop what the source started (engines, servers, threads); also when the run failed."""
