"""The intervals and tests the learning benchmarks report with: a mean's t-interval, the Welch interval of a difference
of two means, a permutation test of that difference, the seeds a difference needs to be found (a power calculation),
a binomial rate's exact (Clopper-Pearson) interval and Fisher's exact test of two rates. Pure Python: the benchmarks
need no SciPy."""

import math
import random
import statistics
from statistics import NormalDist

from benchmarks.common import t975


def mean_ci(values: list[float]) -> tuple:
    """(mean, half-width of the 95 % t-interval; nan for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, t975(n - 1) * (var / n) ** 0.5


def welch_difference(a: list[float], b: list[float]) -> tuple:
    """(mean(a) - mean(b), half-width of its 95 % Welch interval; degrees of freedom rounded down), nan with fewer
    than two values on a side."""
    diff = sum(a) / len(a) - sum(b) / len(b)
    if min(len(a), len(b)) < 2:
        return diff, float("nan")
    var = [sum((x - sum(v) / len(v)) ** 2 for x in v) / (len(v) - 1) / len(v) for v in (a, b)]
    se2 = var[0] + var[1]
    if se2 == 0:
        return diff, 0.0
    dof = se2**2 / (var[0] ** 2 / (len(a) - 1) + var[1] ** 2 / (len(b) - 1))
    return diff, t975(max(1, math.floor(dof))) * se2**0.5


def permutation_p(a: list, b: list, rounds: int = 20_000, seed: int = 0) -> float:
    """Two-sided permutation test of mean(a) - mean(b): the share of `rounds` random relabellings (seeded) whose
    difference is at least as far from 0 as the observed one."""
    if min(len(a), len(b)) < 1:
        raise ValueError(f"permutation_p needs a value on each side, got {len(a)} and {len(b)}")
    observed, pool, rng, hits = abs(statistics.mean(a) - statistics.mean(b)), list(a) + list(b), random.Random(seed), 0
    for _ in range(rounds):
        rng.shuffle(pool)
        hits += abs(statistics.mean(pool[: len(a)]) - statistics.mean(pool[len(a) :])) >= observed - 1e-12
    return hits / rounds


def seeds_needed(sd_a: float, sd_b: float, gap: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """Seeds per arm for a two-sided test at alpha to find a true difference `gap` between two means with probability
    `power` (normal approximation, equal arms): n = (z_(1 - alpha / 2) + z_power)^2 (sd_a^2 + sd_b^2) / gap^2."""
    if not (gap > 0 and sd_a >= 0 and sd_b >= 0 and 0 < power < 1 and 0 < alpha < 1):
        raise ValueError(f"seeds_needed needs gap > 0, sds >= 0 and power, alpha in (0, 1); got gap {gap}, sds "
                         f"{sd_a} and {sd_b}, power {power}, alpha {alpha}")  # fmt: skip
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return math.ceil(z**2 * (sd_a**2 + sd_b**2) / gap**2)


def smallest_gap(sd_a: float, sd_b: float, n_a: int, n_b: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The true difference that n_a and n_b seeds find with probability `power` (the inverse of seeds_needed)."""
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return z * (sd_a**2 / n_a + sd_b**2 / n_b) ** 0.5


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the decreasing f(p) crosses target (bisection to 1e-12)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a binomial rate from k successes in n trials: each end excludes at
    most (1 - level) / 2 of the probability."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson needs 0 <= k <= n and n >= 1, got k = {k}, n = {n}")
    tail = (1 - level) / 2
    low = 0.0 if k == 0 else _solve(lambda p: _binomial_cdf(k - 1, n, p), 1 - tail)  # P(X >= k) = tail
    high = 1.0 if k == n else _solve(lambda p: _binomial_cdf(k, n, p), tail)  # P(X <= k) = tail
    return low, high


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test that k1 of n1 and k2 of n2 come from one rate: the probability, given the
    margins, of every table no more likely than the one observed."""
    if min(n1, n2) < 1 or not (0 <= k1 <= n1 and 0 <= k2 <= n2):
        raise ValueError(f"fisher_exact needs 0 <= k <= n and n >= 1 on each side, got {k1}/{n1} and {k2}/{n2}")
    total = k1 + k2
    probability = {x: math.comb(n1, x) * math.comb(n2, total - x) / math.comb(n1 + n2, total)
                   for x in range(max(0, total - n2), min(total, n1) + 1)}  # fmt: skip
    observed = probability[k1]
    return min(1.0, sum(p for p in probability.values() if p <= observed * (1 + 1e-9)))
