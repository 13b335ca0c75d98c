"""Token-budget micro-batch planning, balanced across data-parallel ranks: which samples each rank runs, in
how many micro-batches, and which samples go into each.

Design. The planner sees only integer weights: an item is one sample (its length in tokens) or, with
keep_groups=True, one whole GRPO group (the sum of its lengths), so a group never straddles micro-batches.

    step 1, ranks        partition the items into num_ranks parts minimizing the largest part's load;
    step 2, micro-batch  every rank gets the same number k of micro-batches (FSDP ranks must run the same
                         number of forward/backward passes): k = max over ranks of ceil(load / token_budget)
                         (at least 1) and of the number of the rank's items heavier than token_budget / 2 (no
                         two of them fit together: smaller k cannot work), capped at the most items a rank has
                         (every item alone, more would only add empty parts), each rank's items partitioned into
                         k parts; while a part holding more than one item exceeds token_budget, k += 1 and
                         step 2 is redone. An item heavier than the budget alone in its micro-batch is allowed
                         (it cannot be split here).

Both steps use one partitioning algorithm:
    "karmarkar_karp"  the multiway largest differencing method: every item starts as a k-tuple of subsets
                      (the item and k - 1 empty ones); the two tuples with the largest spread (max - min sum)
                      are merged, the largest subset of one with the smallest of the other and so on, until
                      one tuple is left. Near-perfect balance when there are many small items.
    "greedy"          LPT: items by weight descending, each to the currently least-loaded part.
Ties are broken by index so that the result is reproducible and both backends agree exactly: subsets are
ordered by (sum descending, smallest item index), empty ones last; tuples in the heap by (spread descending,
creation order, the items first); LPT takes items by (weight descending, index) and parts by (load, index).
The parts of either algorithm come out in that subset order, so rank 0 is the heaviest rank and a rank's
micro-batches are sorted by load, descending.

Backends: the C++ function `_C.plan_micro_batches` (csrc/planner.cpp; ranks planned in parallel) and the
pure-Python `_plan_items` below, the spec, selected by impl="reference". Both return item indices; the
group -> sample bookkeeping and the loads are computed here, once, for both.
"""

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

ALGORITHMS = {"karmarkar_karp": 0, "greedy": 1}
IMPLS = ("auto", "cpp", "reference")


@dataclass(frozen=True, slots=True)
class Plan:
    """A micro-batch plan: rank -> micro-batch -> sample indices (ascending within a micro-batch)."""

    micro_batches: list
    """list[list[list[int]]]: rank -> micro-batch -> sample indices; every rank has the same number of
    micro-batches (some may be empty), sorted by load, descending."""
    rank_loads: list
    """list[int]: the tokens of each rank."""
    micro_batch_loads: list
    """list[list[int]]: the tokens of each micro-batch, shaped like micro_batches."""
    imbalance: float
    """max rank load / mean rank load: 1.0 is perfect (and the value when every load is 0)."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.micro_batches[0])

    def __str__(self) -> str:
        flat = [x for loads in self.micro_batch_loads for x in loads]
        samples = sum(len(mb) for rank in self.micro_batches for mb in rank)
        return (
            f"Plan({samples} samples, {sum(self.rank_loads)} tokens, {len(self.rank_loads)} ranks x "
            f"{self.num_micro_batches} micro-batches; rank loads {min(self.rank_loads)}..{max(self.rank_loads)}, "
            f"imbalance {self.imbalance:.4f}; micro-batch loads {min(flat)}..{max(flat)})"
        )


def plan_micro_batches(
    lengths,
    *,
    token_budget: int,
    group_ids=None,
    keep_groups: bool = False,
    num_ranks: int = 1,
    algorithm: str = "karmarkar_karp",
    max_item_tokens: int | None = None,
    impl: str = "auto",
) -> Plan:
    """Split samples into token-budget micro-batches, the same number on every rank, balanced across ranks.

    Args:
        lengths: [N] token count of each sample (1-D int tensor, list or numpy array; >= 0).
        token_budget: tokens per micro-batch (>= 1); exceeded only by a micro-batch holding a single item.
        group_ids: [N] GRPO group of each sample (ints; a group's samples need not be adjacent).
        keep_groups: every group is one indivisible item (weight = the sum of its lengths): all of a group's
            samples land in the same micro-batch. Needs group_ids.
        num_ranks: data-parallel ranks (>= 1).
        algorithm: "karmarkar_karp" (largest differencing, best balance) or "greedy" (LPT).
        max_item_tokens: if given, an item (sample, or group with keep_groups) heavier than this is an error.
        impl: "auto" / "cpp" (C++, csrc/planner.cpp) or "reference" (pure Python, the spec).

    Returns:
        Plan(micro_batches, rank_loads, micro_batch_loads, imbalance).
    """
    lengths = _int_vector(lengths, "lengths")
    if lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {int(lengths.min())} at index {int(lengths.argmin())}")
    token_budget = _positive_int(token_budget, "token_budget")
    num_ranks = _positive_int(num_ranks, "num_ranks")
    # The planner sums weights in int64 (loads, load + budget, twice a weight): refuse what it cannot add exactly.
    fast = lengths.size == 0 or int(lengths.max()) * lengths.size <= MAX_TOTAL_TOKENS
    total = 0 if lengths.size == 0 else (int(lengths.sum()) if fast else sum(lengths.tolist()))
    if total + token_budget > MAX_TOTAL_TOKENS:
        raise ValueError(f"sum(lengths) + token_budget = {total + token_budget} is past what can be planned "
                         f"(2^62 = {MAX_TOTAL_TOKENS} tokens)")  # fmt: skip
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if group_ids is not None:
        group_ids = _int_vector(group_ids, "group_ids")
        if group_ids.shape != lengths.shape:
            raise ValueError(f"group_ids must have one entry per sample ({lengths.size}), got {group_ids.size}")
    if keep_groups and group_ids is None:
        raise ValueError("keep_groups=True needs group_ids")
    if max_item_tokens is not None and (
        isinstance(max_item_tokens, bool) or not isinstance(max_item_tokens, (int, np.integer))
    ):
        raise ValueError(f"max_item_tokens must be an int or None, got {max_item_tokens!r}")

    if keep_groups:
        # Items are the groups in order of first appearance, so item order = order of the smallest sample index.
        _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
        rank_of = np.empty(first.size, dtype=np.int64)
        rank_of[np.argsort(first, kind="stable")] = np.arange(first.size)
        item_of = rank_of[inverse.reshape(-1)]
        weights = np.zeros(first.size, dtype=np.int64)
        np.add.at(weights, item_of, lengths)  # exact in int64 (bincount would sum in float64)
        members = np.argsort(item_of, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(item_of, minlength=first.size))))
    else:
        weights = lengths
    if max_item_tokens is not None and weights.size and int(weights.max()) > max_item_tokens:
        i = int(np.argmax(weights > max_item_tokens))
        what = f"group {int(group_ids[members[bounds[i]]])}" if keep_groups else f"sample {i}"
        raise ValueError(f"item {i} ({what}) has {int(weights[i])} tokens > max_item_tokens={max_item_tokens}")

    if impl == "reference":
        items = _plan_items(weights.tolist(), token_budget, num_ranks, algorithm)
    else:
        from . import _C

        items = _C.plan_micro_batches(torch.from_numpy(weights), token_budget, num_ranks, ALGORITHMS[algorithm])

    if keep_groups:
        members, bounds = members.tolist(), bounds.tolist()
        batches = [[sorted(s for i in mb for s in members[bounds[i] : bounds[i + 1]]) for mb in rank] for rank in items]
    else:
        batches = items  # item = sample; both backends list a micro-batch's items in ascending order
    w = weights.tolist()
    mb_loads = [[sum(map(w.__getitem__, mb)) for mb in rank] for rank in items]
    rank_loads = [sum(loads) for loads in mb_loads]
    total = sum(rank_loads)
    imbalance = max(rank_loads) * num_ranks / total if total else 1.0
    return Plan(micro_batches=batches, rank_loads=rank_loads, micro_batch_loads=mb_loads, imbalance=imbalance)


MAX_TOTAL_TOKENS = 2**62


def _int_vector(x, name: str) -> np.ndarray:
    """x (tensor, numpy array or sequence) as a 1-D int64 numpy array, or ValueError naming `name`."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got a {x.dtype} tensor")
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} must be a 1-D sequence of integers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has values beyond int64")
    return np.array(arr, dtype=np.int64)  # a contiguous, writable copy: torch.from_numpy takes it as is


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    return int(x)


# ----------------------------------------------------------------------------------------------------------------
# The reference implementation (the spec of csrc/planner.cpp).


def _plan_items(weights: list, token_budget: int, num_ranks: int, algorithm: str) -> list:
    """rank -> micro-batch -> item indices (ascending); see the module docstring."""
    partition = _karmarkar_karp if algorithm == "karmarkar_karp" else _greedy
    ranks = partition(weights, num_ranks)
    rank_items = [sorted(part) for part in ranks]
    loads = [sum(weights[i] for i in items) for items in rank_items]
    # Start at the first k that can work: ceil(load / budget), and no two items heavier than half the budget together;
    # but never above the most items a rank has (then every item is alone: more parts would all be empty).
    halves = [sum(2 * weights[i] > token_budget for i in items) for items in rank_items]
    limit = max(1, max(len(items) for items in rank_items))
    k = min(limit, max(1, max(-(-load // token_budget) for load in loads), max(halves)))
    while True:
        plan = []
        for items in rank_items:
            local = [weights[i] for i in items]
            parts = partition(local, k)
            plan.append([sorted(items[j] for j in part) for part in parts])
        over = any(len(mb) > 1 and sum(weights[i] for i in mb) > token_budget for rank in plan for mb in rank)
        if not over or k >= limit:
            return plan
        k += 1


def _order(parts: list) -> list:
    """Parts (lists of item indices, with their sums) in subset order: sum descending, smallest index, empty last."""
    return [p for _, _, p in sorted((-s, min(p) if p else math.inf, p) for s, p in parts)]


def _greedy(weights: list, k: int) -> list:
    """LPT: items by (weight descending, index), each to the part with the smallest (load, index)."""
    parts = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + weights[i], p))
    return _order([(sum(weights[i] for i in part), part) for part in parts])


def _karmarkar_karp(weights: list, k: int) -> list:
    """Multiway largest differencing. A tuple holds its non-empty subsets [sum, smallest index, items] in subset
    order; the k - len missing ones are empty (sum 0)."""
    n = len(weights)
    if n == 0:
        return [[] for _ in range(k)]
    if k == 1:
        return [list(range(n))]
    tuples = {}
    heap = []
    for i, w in enumerate(weights):
        tuples[i] = [[w, i, [i]]]
        heap.append((-w, i))
    heapq.heapify(heap)
    next_id = n
    while len(heap) > 1:
        a = tuples.pop(heapq.heappop(heap)[1])
        b = tuples.pop(heapq.heappop(heap)[1])
        # b ascending: k - len(b) empty subsets, then b's subsets from the last; pair a[j] with it.
        merged = []
        for j in range(k):
            x = a[j] if j < len(a) else None
            y = b[k - 1 - j] if j >= k - len(b) else None
            if x is None or y is None:
                if x is not None or y is not None:
                    merged.append(x if x is not None else y)
                continue
            if len(x[2]) < len(y[2]):
                x, y = y, x
            x[2].extend(y[2])
            merged.append([x[0] + y[0], min(x[1], y[1]), x[2]])
        merged.sort(key=lambda s: (-s[0], s[1]))
        spread = merged[0][0] - (merged[-1][0] if len(merged) == k else 0)
        tuples[next_id] = merged
        heapq.heappush(heap, (-spread, next_id))
        next_id += 1
    (last,) = tuples.values()
    return [s[2] for s in last] + [[] for _ in range(k - len(last))]
