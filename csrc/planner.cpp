// plan_micro_batches on the CPU: token-budget micro-batches, the same number on every rank, balanced across ranks.
// Spec: _plan_items in grpo_kernels/planner.py (module docstring there); the results must be identical, so every
// tie is broken the same way.
//
//   step 1: items (integer weights) -> num_ranks parts, minimizing the largest part's sum;
//   step 2: each rank's items -> k parts, k the same on every rank: k starts at max(1, max over ranks of
//           ceil(load / budget), of the number of the rank's items heavier than budget / 2), at most the largest
//           item count of a rank, and grows by one while some part with more than one item exceeds the budget.
//   algorithm 0, Karmarkar-Karp (largest differencing, multiway): every item is a k-tuple of subsets; pop the
//       two tuples with the largest spread (ties: smaller id; items have ids 0..n-1, merged tuples n, n+1, ...),
//       pair the j-th largest subset of the first with the j-th smallest of the second, sort the k subsets by
//       (sum descending, smallest item index), push the result.
//   algorithm 1, greedy LPT: items by (weight descending, index), each to the part with the smallest
//       (load, part index).
//   Parts come out ordered by (sum descending, smallest item index), empty ones last, items ascending.
//
// Design
//   * A tuple stores only its non-empty subsets (sum, smallest index, head and tail of a singly linked list of
//     items in one shared `next` array), so a merge costs O(m log m) for m non-empty subsets and joining two
//     subsets is O(1); early merges of small tuples are cheap. The missing k - m subsets are empty.
//   * Most merges take a single item (measured: ~94% at 12.5k items into 205 parts), so a merge sorts only the
//     subsets it changed (at most the smaller tuple's count) and merges them into the untouched, still sorted
//     prefix: O(m) instead of O(m log m). Single items are not stored as tuples: they wait in one array sorted
//     by (weight descending, index), and only merged tuples go into the heap.
//   * Step 2 plans the ranks in parallel (at::parallel_for, one rank per task): the ranks are independent, so
//     the result does not depend on the thread count. The GIL is released while planning.
//   * 100k lognormal lengths (16..8192), budget 65536, 8 ranks (205 micro-batches each), 2 threads (Zen 4):
//     karmarkar_karp ~55 ms here, ~90 ms the whole Python call; greedy ~30 / ~60 ms (bench_planner.py).

#include "grpo_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

namespace grpo::packing {

using Parts = std::vector<std::vector<int64_t>>;  // part -> item indices (local to the call), ascending

struct Subset {
  int64_t sum;
  int32_t min;   // smallest item index: the tie-break, unique among non-empty subsets
  int32_t head;  // items: head, next[head], ..., tail
  int32_t tail;
};

inline bool before(const Subset& a, const Subset& b) {  // subset order: sum descending, then smallest index
  return a.sum != b.sum ? a.sum > b.sum : a.min < b.min;
}

// Sorts parts (with their sums) into subset order; empty parts (min = INT64_MAX) go last.
Parts ordered(Parts parts, const std::vector<int64_t>& sums) {
  const int64_t k = static_cast<int64_t>(parts.size());
  std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> keys(k);
  for (int64_t p = 0; p < k; ++p) {
    int64_t lo = std::numeric_limits<int64_t>::max();
    for (int64_t i : parts[p]) lo = std::min(lo, i);
    keys[p] = {{-sums[p], lo}, p};
  }
  std::sort(keys.begin(), keys.end());
  Parts out(k);
  for (int64_t p = 0; p < k; ++p) {
    out[p] = std::move(parts[keys[p].second]);
    std::sort(out[p].begin(), out[p].end());
  }
  return out;
}

Parts greedy(const std::vector<int64_t>& w, int64_t k) {
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
  using Load = std::pair<int64_t, int64_t>;  // (load, part)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (int64_t p = 0; p < k; ++p) heap.push({0, p});
  Parts parts(k);
  std::vector<int64_t> sums(k, 0);
  for (int64_t i : order) {
    auto [load, p] = heap.top();
    heap.pop();
    parts[p].push_back(i);
    sums[p] = load + w[i];
    heap.push({sums[p], p});
  }
  return ordered(std::move(parts), sums);
}

Parts karmarkar_karp(const std::vector<int64_t>& w, int64_t k) {
  const int64_t n = static_cast<int64_t>(w.size());
  Parts parts(k);
  if (n == 0) return parts;
  if (k == 1) {
    parts[0].resize(n);
    std::iota(parts[0].begin(), parts[0].end(), 0);
    return parts;
  }
  std::vector<int32_t> next(n, -1);
  // Tuples by (spread descending, id). A single item's spread is its weight, so the items form a sorted queue of
  // their own (no heap, nothing stored until merged); merged tuples (ids n, n + 1, ...) go into a heap. An item
  // wins a tie against a merged tuple: its id is smaller.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
  int64_t s = 0;  // items order[s..] are not merged yet
  std::vector<std::vector<Subset>> tuples(n - 1);  // merged tuple id: tuples[id - n]
  using Entry = std::pair<int64_t, int64_t>;       // (spread, id): largest spread first, then the smaller id
  auto cmp = [](const Entry& a, const Entry& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> heap(cmp);
  auto pop = [&](std::vector<Subset>& dst) {
    if (s < n && (heap.empty() || w[order[s]] >= heap.top().first)) {
      const auto i = static_cast<int32_t>(order[s++]);
      dst.assign(1, Subset{w[i], i, i, i});
    } else {
      dst = std::move(tuples[heap.top().second - n]);
      heap.pop();
    }
  };
  int64_t id = n;
  std::vector<Subset> a, b, tail;
  while (n - s + static_cast<int64_t>(heap.size()) > 1) {
    pop(a);
    pop(b);
    const int64_t la = static_cast<int64_t>(a.size()), lb = static_cast<int64_t>(b.size());
    // a[j] with b ascending: k - lb empty subsets first, then b[lb - 1], ..., b[0] (b[k - 1 - j] at j). The first
    // p = min(la, k - lb) subsets of a are untouched and stay sorted: sort the rest (at most lb) and merge.
    const int64_t p = std::min(la, k - lb);
    tail.clear();
    for (int64_t j = std::max(p, k - lb); j < k; ++j) {
      const Subset& y = b[k - 1 - j];
      if (j < la) {
        Subset x = a[j];
        next[x.tail] = y.head;
        x.tail = y.tail;
        x.sum += y.sum;
        x.min = std::min(x.min, y.min);
        tail.push_back(x);
      } else {
        tail.push_back(y);
      }
    }
    std::sort(tail.begin(), tail.end(), before);
    std::vector<Subset>& merged = a;
    merged.resize(p);
    merged.insert(merged.end(), tail.begin(), tail.end());
    std::inplace_merge(merged.begin(), merged.begin() + p, merged.end(), before);
    const int64_t m = static_cast<int64_t>(merged.size());
    const int64_t spread = merged.front().sum - (m == k ? merged.back().sum : 0);
    tuples[id - n] = std::move(merged);
    heap.push({spread, id});
    ++id;
  }
  pop(a);
  const std::vector<Subset>& last = a;
  for (size_t p = 0; p < last.size(); ++p) {
    for (int32_t i = last[p].head; i != -1; i = next[i]) parts[p].push_back(i);
    std::sort(parts[p].begin(), parts[p].end());
  }
  return parts;
}

Parts partition(const std::vector<int64_t>& w, int64_t k, int64_t algorithm) {
  return algorithm == 0 ? karmarkar_karp(w, k) : greedy(w, k);
}

// rank -> micro-batch -> item indices (global, ascending).
std::vector<Parts> plan(const std::vector<int64_t>& w, int64_t budget, int64_t num_ranks, int64_t algorithm) {
  const Parts ranks = partition(w, num_ranks, algorithm);
  int64_t k = 1, limit = 1;
  for (const auto& items : ranks) {
    int64_t load = 0, halves = 0;
    for (int64_t i : items) {
      load += w[i];
      halves += 2 * w[i] > budget;
    }
    k = std::max({k, (load + budget - 1) / budget, halves});
    limit = std::max(limit, static_cast<int64_t>(items.size()));
  }
  k = std::min(k, limit);  // limit parts put every item alone: more would only add empty ones
  std::vector<Parts> out(num_ranks);
  while (true) {
    std::vector<char> over(num_ranks, 0);
    at::parallel_for(0, num_ranks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto& items = ranks[r];
        std::vector<int64_t> local(items.size());
        for (size_t j = 0; j < items.size(); ++j) local[j] = w[items[j]];
        Parts parts = partition(local, k, algorithm);
        for (auto& part : parts) {
          int64_t load = 0;
          for (auto& j : part) {
            load += local[j];
            j = items[j];  // local -> global index; ascending stays ascending
          }
          over[r] |= part.size() > 1 && load > budget;
        }
        out[r] = std::move(parts);
      }
    });
    if (k >= limit || std::none_of(over.begin(), over.end(), [](char o) { return o != 0; })) return out;
    ++k;
  }
}

std::vector<std::vector<std::vector<int64_t>>> plan_micro_batches(const at::Tensor& weights, int64_t token_budget,
                                                                  int64_t num_ranks, int64_t algorithm) {
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kLong && weights.device().is_cpu(),
              "weights must be a 1-D int64 CPU tensor");
  TORCH_CHECK(token_budget >= 1 && num_ranks >= 1 && (algorithm == 0 || algorithm == 1),
              "token_budget and num_ranks must be >= 1, algorithm 0 or 1");
  TORCH_CHECK(weights.numel() < std::numeric_limits<int32_t>::max() / 2, "too many items");
  const at::Tensor c = weights.contiguous();
  std::vector<int64_t> w(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  for (int64_t x : w) TORCH_CHECK(x >= 0, "weights must be >= 0");
  return plan(w, token_budget, num_ranks, algorithm);  // the binding releases the GIL around the call
}

}  // namespace grpo::packing
