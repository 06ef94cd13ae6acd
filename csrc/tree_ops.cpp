// Tree ops on raw host pointers; see tree_ops.h for shapes. Float results are bit-identical to the
// PyTorch references because every float is produced by the same IEEE operation in the same order:
// keep this file free of -ffast-math and of reassociated sums.
#include "tree_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace taps {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Top-K order, "a ranks before b": NaN first (where torch.sort(descending=True) puts it), then the
// larger value, then the smaller index. Used as the std heap comparator, it keeps the kept element that
// ranks LAST at the front of the heap.
inline bool topk_before(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  const bool a_nan = std::isnan(a.first), b_nan = std::isnan(b.first);
  if (a_nan || b_nan) return a_nan && (!b_nan || a.second < b.second);
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Unsigned key increasing with the float; -0.0 is folded onto +0.0 first because the reference compares
// floats, for which they are equal (order between them then falls to the node index).
inline uint32_t float_order_key(float f) {
  f = f + 0.0f;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sorts the kept entries (best first) into vals/ids.
void finish_topk(std::vector<std::pair<float, int64_t>>& heap, int32_t K, float* vals, int64_t* ids) {
  std::sort_heap(heap.begin(), heap.end(), topk_before);
  for (int32_t k = 0; k < K; ++k) {
    vals[k] = heap[k].first;
    ids[k] = heap[k].second;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
void topk_row(const float* x, int64_t V, int32_t K, float* vals, int64_t* ids, TopKWorkspace& ws) {
  auto& heap = ws.heap;
  heap.clear();
  heap.reserve(static_cast<size_t>(K));
  int64_t i = 0;
  for (; i < V && static_cast<int32_t>(heap.size()) < K; ++i) {
    heap.emplace_back(x[i], i);
    std::push_heap(heap.begin(), heap.end(), topk_before);
  }
  // Indices ascend, so an entry met later never wins a tie: it enters only when strictly better than
  // the last kept one (a NaN beats any number; nothing beats a kept NaN).
  auto offer = [&](int64_t j) {
    const float v = x[j];
    const float last = heap.front().first;
    if (v > last || (std::isnan(v) && !std::isnan(last))) {
      std::pop_heap(heap.begin(), heap.end(), topk_before);
      heap.back() = {v, j};
      std::push_heap(heap.begin(), heap.end(), topk_before);
    }
  };
  // Almost no entry can enter once the heap is full: test a chunk with one branch-free (vectorisable)
  // pass, "any entry not <= the last kept" (true for larger ones and for NaN), and offer its entries
  // one by one only then. The chunk test never skips an entry that offer() would keep.
  constexpr int64_t kChunk = 32;
  for (; i + kChunk <= V; i += kChunk) {
    const float last = heap.front().first;
    if (std::isnan(last)) return finish_topk(heap, K, vals, ids);
    bool candidate = false;
    for (int64_t j = 0; j < kChunk; ++j) candidate |= !(x[i + j] <= last);
    if (!candidate) continue;
    for (int64_t j = 0; j < kChunk; ++j) offer(i + j);
  }
  for (; i < V; ++i) offer(i);
  finish_topk(heap, K, vals, ids);
}

// ---------------------------------------------------------------------------------------------------------
namespace {

// Binary min-heap on a vector, ordered by before(a, b) ("a comes out first"). replace_top walks the hole
// to a leaf along the better child and sifts the new element up from there (Floyd): about half the
// comparisons of a plain sift-down, which matters because each one is a mispredicted branch.
// Places x at hole i or above it, moving lower-priority ancestors down.
template <class T, class Before>
void sift_up(std::vector<T>& h, size_t i, const T& x, Before before) {
  while (i > 0) {
    const size_t p = (i - 1) / 2;
    if (!before(x, h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = x;
}

template <class T, class Before>
void heap_push(std::vector<T>& h, const T& x, Before before) {
  h.push_back(x);
  sift_up(h, h.size() - 1, x, before);
}

template <class T, class Before>
void heap_replace_top(std::vector<T>& h, const T& x, Before before) {
  const size_t n = h.size();
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && before(h[c + 1], h[c])) ++c;
    h[i] = h[c];
    i = c;
  }
  sift_up(h, i, x, before);
}

template <class T, class Before>
void heap_pop(std::vector<T>& h, Before before) {
  const T last = h.back();
  h.pop_back();
  if (!h.empty()) heap_replace_top(h, last, before);
}

// Candidate encodings; both give the order (score desc, parent asc, rank asc).
struct PackedCodec {
  using T = uint64_t;
  int rank_bits;
  T make(float score, int32_t parent, int32_t rank) const {
    return (static_cast<uint64_t>(~float_order_key(score)) << 32) |
           ((static_cast<uint64_t>(parent) << rank_bits) | static_cast<uint64_t>(rank));
  }
  int32_t parent(T k) const { return static_cast<int32_t>((k & 0xFFFFFFFFu) >> rank_bits); }
  int32_t rank(T k) const { return static_cast<int32_t>(k & ((uint64_t{1} << rank_bits) - 1)); }
  static bool before(T a, T b) { return a < b; }
};

struct RecordCodec {
  using T = PoolCandidate;
  T make(float score, int32_t parent, int32_t rank) const { return {score, parent, rank}; }
  int32_t parent(const T& c) const { return c.parent; }
  int32_t rank(const T& c) const { return c.rank; }
  static bool before(const T& a, const T& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.parent != b.parent) return a.parent < b.parent;
    return a.rank < b.rank;
  }
};

template <class Codec>
int32_t best_first_search(const float* topk_logp, const int64_t* topk_ids, int32_t D, int32_t K, int32_t N,
                          const Codec& codec, std::vector<typename Codec::T>& heap, int64_t* tokens,
                          int32_t* parents, int32_t* depth, float* logq, float* step_logq, int32_t* rank) {
  auto before = &Codec::before;
  heap.clear();
  // Every pop pushes at most two candidates, so the heap never exceeds N + 1 entries.
  heap.reserve(static_cast<size_t>(N) + 2);
  if (D > 0 && K > 0) heap.push_back(codec.make(0.0f + topk_logp[0], 0, 0));
  int32_t n = 1;
  while (!heap.empty() && n < N) {
    const auto top = heap[0];
    const int32_t parent = codec.parent(top);
    const int32_t r = codec.rank(top);
    const int32_t d = depth[parent] + 1;
    const float* row = topk_logp + static_cast<int64_t>(d - 1) * K;
    const float step = row[r];
    const float score = logq[parent] + step;
    tokens[n] = topk_ids[static_cast<int64_t>(d - 1) * K + r];
    parents[n] = parent;
    depth[n] = d;
    logq[n] = score;
    step_logq[n] = step;
    rank[n] = r;
    const bool sibling = r + 1 < K;
    const bool child = d < D;
    // The popped slot is reused for the first push: one heap pass instead of two.
    if (sibling) {
      heap_replace_top(heap, codec.make(logq[parent] + row[r + 1], parent, r + 1), before);
      if (child) heap_push(heap, codec.make(score + row[K], n, 0), before);
    } else if (child) {
      heap_replace_top(heap, codec.make(score + row[K], n, 0), before);
    } else {
      heap_pop(heap, before);
    }
    ++n;
  }
  return n;
}

}  // namespace

int32_t best_first_pool_one(const float* topk_logp, const int64_t* topk_ids, int64_t root_token, int32_t D,
                            int32_t K, int32_t pool_size, int64_t* tokens, int32_t* parents, int32_t* depth,
                            float* logq, float* step_logq, int32_t* rank, PoolWorkspace& ws, bool packed_keys) {
  const int32_t N = pool_size + 1;
  tokens[0] = root_token;
  parents[0] = -1;
  depth[0] = 0;
  logq[0] = 0.0f;
  step_logq[0] = 0.0f;
  rank[0] = -1;
  int rank_bits = 0;
  while (rank_bits < 31 && (int64_t{1} << rank_bits) < K) ++rank_bits;
  // Pushed parents go up to pool_size and ranks up to K - 1 < 2^rank_bits: both must fit in 32 bits.
  const bool fits = (static_cast<uint64_t>(pool_size) + 1) << rank_bits <= (uint64_t{1} << 32);
  int32_t n;
  if (packed_keys && fits) {
    n = best_first_search(topk_logp, topk_ids, D, K, N, PackedCodec{rank_bits}, ws.keys, tokens, parents, depth, logq,
                          step_logq, rank);
  } else {
    n = best_first_search(topk_logp, topk_ids, D, K, N, RecordCodec{}, ws.records, tokens, parents, depth, logq,
                          step_logq, rank);
  }
  for (int32_t i = n; i < N; ++i) {
    tokens[i] = 0;
    parents[i] = -1;
    depth[i] = 0;
    logq[i] = kNegInf;
    step_logq[i] = kNegInf;
    rank[i] = -1;
  }
  return n;
}

// ---------------------------------------------------------------------------------------------------------
void propagate_reach_one(const int32_t* parents, const float* edge_logq, int32_t N, float* log_reach) {
  if (N < 1) return;
  log_reach[0] = 0.0f;
  for (int32_t i = 1; i < N; ++i) {
    const int32_t p = parents[i];
    log_reach[i] = p >= 0 ? log_reach[p] + edge_logq[i] : kNegInf;
  }
}

// ---------------------------------------------------------------------------------------------------------
namespace {

// Reach rule: nodes ranked by (-e, index); e monotone along paths makes every top-n prefix-closed.
int32_t select_by_reach(const int32_t* parents, int32_t num_nodes, const float* log_reach, const SelectParams& params,
                        SelectWorkspace& ws) {
  const int32_t m = num_nodes - 1;  // non-root candidates
  auto& eff = ws.eff;
  eff.resize(static_cast<size_t>(num_nodes));
  eff[0] = 0.0f;
  for (int32_t i = 1; i < num_nodes; ++i) {
    const float a = log_reach[i];
    const float b = eff[parents[i]];
    eff[i] = b < a ? b : a;  // Python's min(a, b): b only when strictly smaller
  }
  int32_t n = std::min(params.max_nodes, m);
  if (params.latency != nullptr) n = std::min(n, params.latency_len - 1);
  auto& keys = ws.keys;
  keys.resize(static_cast<size_t>(m));
  for (int32_t i = 1; i < num_nodes; ++i) {
    keys[i - 1] = (static_cast<uint64_t>(~float_order_key(eff[i])) << 32) | static_cast<uint32_t>(i);
  }
  if (params.latency != nullptr) {
    if (n > 0 && n < m) std::nth_element(keys.begin(), keys.begin() + n, keys.end());
    std::sort(keys.begin(), keys.begin() + n);
    // Same double arithmetic, same order as reference/select.py::_throughput_size; first maximum wins.
    int32_t best_n = 0;
    double best_val = -std::numeric_limits<double>::infinity();
    double tau = 1.0;
    for (int32_t k = 0; k <= n; ++k) {
      if (k > 0) tau += std::exp(static_cast<double>(eff[static_cast<uint32_t>(keys[k - 1])]));
      const double val = tau / (params.t0 + params.latency[k]);
      if (val > best_val) {
        best_n = k;
        best_val = val;
      }
    }
    n = best_n;
  } else if (n > 0 && n < m) {
    std::nth_element(keys.begin(), keys.begin() + (n - 1), keys.end());
  }
  auto& kept = ws.kept;
  kept.assign(static_cast<size_t>(num_nodes), 0);
  for (int32_t k = 0; k < n; ++k) kept[static_cast<uint32_t>(keys[k])] = 1;
  return n;
}

// Published utility rule: visit nodes by (-u, index), add each with its missing ancestors when they fit.
int32_t select_by_utility(const int32_t* parents, const int32_t* depth, int32_t num_nodes, const float* log_reach,
                          const SelectParams& params, SelectWorkspace& ws) {
  auto& util = ws.util;
  util.resize(static_cast<size_t>(num_nodes - 1));
  for (int32_t i = 1; i < num_nodes; ++i) {
    util[i - 1] = {std::exp(static_cast<double>(log_reach[i])) /
                       (params.lambda_node + params.lambda_depth * static_cast<double>(depth[i])),
                   i};
  }
  // Max-heap on (u desc, index asc): pop only as many nodes as the walk visits.
  auto lower = [](const std::pair<double, int32_t>& a, const std::pair<double, int32_t>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  std::make_heap(util.begin(), util.end(), lower);
  auto& kept = ws.kept;
  kept.assign(static_cast<size_t>(num_nodes), 0);
  auto& missing = ws.missing;
  int32_t chosen = 0;
  auto end = util.end();
  while (end != util.begin()) {
    std::pop_heap(util.begin(), end, lower);
    --end;
    const double u = end->first;
    const int32_t i = end->second;
    if (u < params.min_utility) break;
    missing.clear();
    for (int32_t j = i; j > 0 && !kept[j]; j = parents[j]) missing.push_back(j);
    if (chosen + static_cast<int32_t>(missing.size()) <= params.max_nodes) {
      for (int32_t j : missing) kept[j] = 1;
      chosen += static_cast<int32_t>(missing.size());
    }
    if (chosen == params.max_nodes) break;
  }
  return chosen;
}

}  // namespace

int32_t select_subtree_one(const int32_t* parents, const int32_t* depth, int32_t num_nodes, const float* log_reach,
                           const SelectParams& params, int64_t* pool_index, SelectWorkspace& ws) {
  const int32_t count = params.rule == Rule::kReach ? select_by_reach(parents, num_nodes, log_reach, params, ws)
                                                    : select_by_utility(parents, depth, num_nodes, log_reach, params, ws);
  pool_index[0] = 0;
  int32_t out = 1;
  const auto& kept = ws.kept;
  for (int32_t i = 1; i < num_nodes && out <= count; ++i) {
    if (kept[i]) pool_index[out++] = i;
  }
  for (int32_t k = out; k <= params.max_nodes; ++k) pool_index[k] = -1;
  return count;
}

void select_throughput_batch(const float* log_reach, const double* reach, const int32_t* num_nodes, int64_t B,
                             int32_t N, const ThroughputParams& params, int64_t* pool_index, int32_t* num_selected,
                             float* expected, ThroughputWorkspace& ws) {
  const int64_t M = static_cast<int64_t>(params.max_nodes) + 1;
  const int32_t cap = std::max(0, std::min(params.max_nodes, N - 1));
  const int64_t C = B * cap;
  auto& keys = ws.keys;
  auto& node = ws.node;
  auto& cand = ws.cand;
  node.resize(static_cast<size_t>(C));
  cand.resize(static_cast<size_t>(C));
  keys.resize(static_cast<size_t>(N - 1));
  bool rows_descend = true;
  for (int64_t b = 0; b < B; ++b) {
    const float* lr = log_reach + b * N;
    const int32_t num = num_nodes[b];
    // Every non-root column competes, padding as -inf (what the reference's stable sort over the row sees).
    for (int32_t i = 1; i < N; ++i) {
      keys[i - 1] = (static_cast<uint64_t>(~float_order_key(i < num ? lr[i] : kNegInf)) << 32) |
                    static_cast<uint32_t>(i);
    }
    if (cap < N - 1) std::nth_element(keys.begin(), keys.begin() + cap, keys.end());
    std::sort(keys.begin(), keys.begin() + cap);
    for (int32_t r = 0; r < cap; ++r) {
      const int32_t i = static_cast<int32_t>(static_cast<uint32_t>(keys[r]));
      const int64_t f = b * cap + r;
      node[f] = i;
      cand[f] = {i < num ? reach[b * N + i] : 0.0, f};
      rows_descend = rows_descend && (r == 0 || cand[f].first <= cand[f - 1].first);
    }
  }
  const int64_t K = std::min<int64_t>(C, params.table_len - 1);
  // Merged order: the reference's stable sort of -reach over the flattened [B, cap] list (ties to the lower flat
  // index: lower row, then lower rank); for B == 1 the row's own order (its one-row branch).
  const auto after = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  const std::pair<double, int64_t>* order = cand.data();
  if (B > 1 && rows_descend) {
    // Each row's reaches descend (exp is monotone on its keys, as in practice): a B-way merge of the row lists
    // is that sort, in O(K log B).
    auto& heads = ws.heads;
    auto& merged = ws.merged;
    heads.clear();
    merged.resize(static_cast<size_t>(K));
    for (int64_t b = 0; b < B && cap > 0; ++b) heads.push_back(cand[b * cap]);
    std::make_heap(heads.begin(), heads.end(), after);
    for (int64_t j = 0; j < K; ++j) {
      std::pop_heap(heads.begin(), heads.end(), after);
      merged[j] = heads.back();
      heads.pop_back();
      const int64_t next = merged[j].second + 1;
      if (next % cap != 0) {
        heads.push_back(cand[next]);
        std::push_heap(heads.begin(), heads.end(), after);
      }
    }
    order = merged.data();
  } else if (B > 1) {
    std::partial_sort(cand.begin(), cand.begin() + K, cand.end(),
                      [&](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
                        return after(b, a);
                      });
  }
  // Same double operations in the same order as the reference's gain; first maximum wins (smaller batch tree).
  const double rate = static_cast<double>(params.rows) / params.plain_seconds;
  const double t0 = params.table[0];
  int64_t best_k = 0;
  double best = 0.0 - (t0 - t0) * rate;
  double total = 0.0;
  for (int64_t j = 1; j <= K; ++j) {
    total += order[j - 1].first;
    const double gain = total - (params.table[j] - t0) * rate;
    if (gain > best) {
      best_k = j;
      best = gain;
    }
  }
  auto& sizes = ws.sizes;
  auto& mass = ws.mass;
  sizes.assign(static_cast<size_t>(B), 0);
  mass.assign(static_cast<size_t>(B), 0.0);
  for (int64_t j = 0; j < best_k; ++j) {
    const int64_t b = order[j].second / cap;
    ++sizes[b];
    mass[b] += order[j].first;
  }
  for (int64_t b = 0; b < B; ++b) {
    const float* lr = log_reach + b * N;
    int64_t* out = pool_index + b * M;
    // The row's first n_b candidates, less those of reach -inf (padding, depth-capped), in ascending order.
    int32_t* first = node.data() + b * cap;
    int32_t* last = std::remove_if(first, first + sizes[b], [&](int32_t i) {
      return i >= num_nodes[b] || lr[i] == kNegInf;
    });
    std::sort(first, last);
    const int32_t count = static_cast<int32_t>(last - first);
    out[0] = 0;
    for (int32_t k = 0; k < count; ++k) out[k + 1] = first[k];
    for (int64_t k = count + 1; k < M; ++k) out[k] = -1;
    num_selected[b] = count;
    expected[b] = static_cast<float>(1.0 + mass[b]);
  }
}

void reindex_subtree_one(const int64_t* tokens, const int32_t* parents, const int32_t* depth, int32_t N,
                         const int64_t* pool_index, int32_t M, int64_t* out_tokens, int32_t* out_parents,
                         int32_t* out_depth, int32_t* new_of_old) {
  std::fill(new_of_old, new_of_old + N, -1);
  for (int32_t k = 0; k < M; ++k) {
    if (pool_index[k] >= 0) new_of_old[pool_index[k]] = k;
  }
  for (int32_t k = 0; k < M; ++k) {
    const int64_t src = pool_index[k];
    if (src < 0) {
      out_tokens[k] = 0;
      out_parents[k] = -1;
      out_depth[k] = 0;
      continue;
    }
    const int32_t p = parents[src];
    out_tokens[k] = tokens[src];
    out_parents[k] = p >= 0 ? new_of_old[p] : -1;
    out_depth[k] = depth[src];
  }
}

// ---------------------------------------------------------------------------------------------------------
void tree_mask_one(const int32_t* parents, const int32_t* depth, int32_t num_nodes, int32_t N, int64_t prefix_len,
                   int64_t* position_ids, int32_t* ancestor_bits) {
  const int64_t W = (static_cast<int64_t>(N) + 31) / 32;
  for (int32_t i = 0; i < N; ++i) position_ids[i] = prefix_len + depth[i];
  std::memset(ancestor_bits, 0, sizeof(int32_t) * static_cast<size_t>(W) * static_cast<size_t>(N));
  for (int32_t i = 0; i < N; ++i) {
    uint32_t* row = reinterpret_cast<uint32_t*>(ancestor_bits) + static_cast<int64_t>(i) * W;
    if (i > 0 && i < num_nodes) {
      // Parents precede children, so the parent's row is final: copy only its used words.
      const int32_t p = parents[i];
      const uint32_t* prow = reinterpret_cast<const uint32_t*>(ancestor_bits) + static_cast<int64_t>(p) * W;
      std::memcpy(row, prow, sizeof(uint32_t) * static_cast<size_t>(p / 32 + 1));
    }
    row[i / 32] |= 1u << (i % 32);
  }
}

// ---------------------------------------------------------------------------------------------------------
int64_t accept_greedy_one(const int64_t* tokens, const int32_t* parents, int32_t num_nodes, const int64_t* target,
                          int32_t path_len, int64_t* path, int64_t* next_token, AcceptWorkspace& ws) {
  auto& first = ws.first_child;
  auto& next = ws.next_sibling;
  first.assign(static_cast<size_t>(num_nodes), -1);
  next.resize(static_cast<size_t>(num_nodes));
  // Prepending in descending index order leaves every child list ascending: the first match is the
  // smallest index, as in the reference's scan.
  for (int32_t i = num_nodes - 1; i > 0; --i) {
    const int32_t p = parents[i];
    next[i] = first[p];
    first[p] = i;
  }
  int32_t cur = 0;
  int64_t n = 1;
  path[0] = 0;
  while (n < path_len) {
    const int64_t want = target[cur];
    int32_t child = first[cur];
    while (child >= 0 && tokens[child] != want) child = next[child];
    if (child < 0) break;
    cur = child;
    path[n++] = cur;
  }
  for (int64_t j = n; j < path_len; ++j) path[j] = -1;
  *next_token = target[cur];
  return n;
}

int64_t accept_round_one(const int64_t* tokens, const int32_t* parents, int32_t num_nodes, const int64_t* target,
                         bool active, int32_t path_len, int64_t* path, int64_t* next_token, int64_t* committed,
                         int64_t* history, int64_t* history_len, int64_t history_cap, AcceptWorkspace& ws) {
  int64_t n = accept_greedy_one(tokens, parents, num_nodes, target, path_len, path, next_token, ws);
  if (!active) {
    n = 0;
    std::fill(path + 1, path + path_len, int64_t{-1});
  }
  for (int64_t j = 0; j < path_len; ++j) {
    committed[j] = j < n - 1 ? tokens[path[j + 1]] : (j == n - 1 ? *next_token : -1);
  }
  if (history != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      if (*history_len + j >= 0 && *history_len + j < history_cap) history[*history_len + j] = committed[j];
    }
    *history_len += n;
  }
  return n;
}

// ---------------------------------------------------------------------------------------------------------
int64_t check_compact_path(const int64_t* path, int64_t B, int64_t P, const int64_t* prefix_lens, int64_t L) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = path + b * P;
    const int64_t prefix = prefix_lens[b];
    for (int64_t j = 0; j < P; ++j) {
      const int64_t v = row[j];
      if (v < -1) return b * P + j;
      if (j > 0 && v >= 0 && (row[j - 1] < 0 || v <= row[j - 1])) return b * P + j;
      // prefix + v < L without forming the sum (it can overflow): prefix in [0, L], then v <= L - 1 - prefix.
      if (v >= 0 && (prefix < 0 || prefix > L || v > L - 1 - prefix)) return b * P + j;
    }
  }
  return -1;
}

void compact_kv_row(const KVView& kv, int64_t b, int64_t prefix_len, const int64_t* path, int64_t n) {
  const bool rows_contiguous = kv.stride_d == 1;
  const size_t row_bytes = static_cast<size_t>(kv.Dh * kv.elem_size);
  for (int64_t h = 0; h < kv.H; ++h) {
    char* base = kv.data + (b * kv.stride_b + h * kv.stride_h) * kv.elem_size;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t src_row = prefix_len + path[j];
      const int64_t dst_row = prefix_len + j;
      if (src_row == dst_row) continue;
      char* dst = base + dst_row * kv.stride_l * kv.elem_size;
      const char* src = base + src_row * kv.stride_l * kv.elem_size;
      if (rows_contiguous) {
        std::memmove(dst, src, row_bytes);
      } else {
        for (int64_t d = 0; d < kv.Dh; ++d) {
          std::memmove(dst + d * kv.stride_d * kv.elem_size, src + d * kv.stride_d * kv.elem_size,
                       static_cast<size_t>(kv.elem_size));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
TreeCheck validate_tree(const int64_t* tokens, const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                        int64_t B, int64_t N, int64_t vocab_size) {
  TreeCheck out;
  auto fail = [&out](TreeFault kind, int64_t b, int64_t i) {
    out.kind = kind;
    out.b = b;
    out.i = i;
    return out;
  };
  // Phases in the order of layout.validate_tree; within a phase, row-major order.
  for (int64_t b = 0; b < B; ++b) {
    if (num_nodes[b] < 1 || num_nodes[b] > N) return fail(TreeFault::kNumNodes, b, -1);
  }
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* par = parents + b * N;
    for (int64_t i = 1; i < num_nodes[b]; ++i) {
      if (par[i] < 0 || par[i] >= i) return fail(TreeFault::kParent, b, i);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    if (parents[b * N] != -1) return fail(TreeFault::kRootParent, b, 0);
  }
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* par = parents + b * N;
    for (int64_t i = num_nodes[b]; i < N; ++i) {
      if (par[i] != -1) return fail(TreeFault::kPaddingParent, b, i);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* par = parents + b * N;
    const int32_t* dep = depth + b * N;
    if (dep[0] != 0) return fail(TreeFault::kDepth, b, 0);
    for (int64_t i = 1; i < num_nodes[b]; ++i) {
      if (static_cast<int64_t>(dep[i]) != static_cast<int64_t>(dep[par[i]]) + 1) return fail(TreeFault::kDepth, b, i);
    }
  }
  if (vocab_size >= 0) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* tok = tokens + b * N;
      for (int64_t i = 0; i < num_nodes[b]; ++i) {
        if (tok[i] < 0 || tok[i] >= vocab_size) return fail(TreeFault::kToken, b, i);
      }
    }
  }
  return out;
}

}  // namespace taps
