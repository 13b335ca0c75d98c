"""Adaptive group size: raise G when too many groups carry no gradient (all right or all wrong).

A group of G binary rewards with pass rate p is invalid with probability p^G + (1 - p)^G. Given the pass rates
observed per prompt, `group_size_for` picks the smallest G (between the current one and a maximum) whose
expected invalid rate over those prompts is at most the target; `AdaptiveGroupSize` does so when the invalid
rate measured over the last `window` steps exceeds the threshold (G never shrinks: it is raised when needed).
"""

from collections import deque

from ..theory import invalid_group_rate

__all__ = ["AdaptiveGroupSize", "expected_invalid_rate", "group_size_for"]


def expected_invalid_rate(group_size: int, pass_rates) -> float:
    """mean over prompts of p^G + (1 - p)^G."""
    rates = [min(max(float(p), 0.0), 1.0) for p in pass_rates]
    if not rates:
        raise ValueError("pass_rates is empty")
    return sum(invalid_group_rate(group_size, p) for p in rates) / len(rates)


def group_size_for(pass_rates, *, target: float, minimum: int, maximum: int) -> int:
    """Smallest G in [minimum, maximum] with expected_invalid_rate(G) <= target (maximum if none reaches it)."""
    if not 2 <= minimum <= maximum:
        raise ValueError(f"need 2 <= minimum <= maximum, got {minimum}, {maximum}")
    for g in range(minimum, maximum + 1):
        if expected_invalid_rate(g, pass_rates) <= target:
            return g
    return maximum


class AdaptiveGroupSize:
    """Tracks the measured invalid-group rate; `update` returns the group size for the next step."""

    def __init__(self, start: int, *, maximum: int, threshold: float, window: int):
        if not 2 <= start <= maximum:
            raise ValueError(f"need 2 <= start <= maximum, got {start}, {maximum}")
        if not 0.0 < threshold < 1.0 or window < 1:
            raise ValueError(f"threshold must be in (0, 1) and window >= 1, got {threshold}, {window}")
        self.group_size, self.maximum, self.threshold = start, maximum, threshold
        self.rates: deque = deque(maxlen=window)
        self.pass_rates: deque = deque(maxlen=window)

    def update(self, invalid_rate: float, pass_rates) -> int:
        """Record one step (its measured invalid-group rate and per-prompt pass rates); the next step's G."""
        self.rates.append(float(invalid_rate))
        self.pass_rates.append([float(p) for p in pass_rates])
        full = len(self.rates) == self.rates.maxlen
        if full and sum(self.rates) / len(self.rates) > self.threshold and self.group_size < self.maximum:
            observed = [p for step in self.pass_rates for p in step]
            self.group_size = max(self.group_size + 1, group_size_for(
                observed, target=self.threshold, minimum=self.group_size, maximum=self.maximum))  # fmt: skip
            self.rates.clear()
            self.pass_rates.clear()
        return self.group_size

    def state_dict(self) -> dict:
        """The controller's state (JSON-serializable), for checkpoints."""
        return {"group_size": self.group_size, "rates": list(self.rates), "pass_rates": list(self.pass_rates)}

    def load_state_dict(self, state: dict) -> None:
        self.group_size = state["group_size"]
        self.rates.clear()
        self.rates.extend(state["rates"])
        self.pass_rates.clear()
        self.pass_rates.extend(state["pass_rates"])
