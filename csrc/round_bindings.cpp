// taps_kernels._C: one round's tree in one call on CPU tensors (taps_kernels.ops.build.build_tree): the drafter's
// candidate pool, the scorer's reach, the prompt-lookup chain grafted in, the batch throughput rule and the re-index
// of the kept subtree, each stage through the same C++ routine as its own op, so the result is the one the chain of
// public ops gives, bit for bit.
//
// Why it exists: in a decode round on a CPU the chain of public ops spent about twice its kernels' time in Python
// (argument checks, dispatch, small tensor ops between the stages: ~1 ms of a ~13 ms round here). Checks here are
// the ones memory safety needs; taps_kernels.ops.build checks the rest.
#include "round_bindings.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_common.h"
#include "lookup.h"
#include "score_bindings.h"
#include "select_bindings.h"
#include "topk_stats.h"
#include "tree_ops.h"

namespace py = pybind11;

namespace taps_bind {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point& t) {
  const Clock::time_point now = Clock::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

// The round's proposal before selection: a [B, N] tree with its log reach.
struct Proposal {
  at::Tensor tokens, parents, depth, num_nodes, log_reach;
};

// The drafter's best-first pool under root_tokens and its reach (scorer, or the pool's own log-mass without one).
// Positions whose logits are not usable raise, naming the first one (as taps_kernels.topk_stats).
Proposal draft_proposal(const at::Tensor& logits, const at::Tensor& vocab_ids, const at::Tensor& roots,
                        int32_t top_k, int32_t pool_size, const ScorerArgs* scorer, const taps::TokenTable* table,
                        const at::Tensor& hidden, double* pool_seconds, double* scoring_seconds) {
  Clock::time_point t = Clock::now();
  const int64_t B = logits.size(0), D = logits.size(1), V = logits.size(2), N = int64_t{pool_size} + 1;
  const int32_t K = static_cast<int32_t>(std::min<int64_t>(top_k, V));
  const int32_t K2 = static_cast<int32_t>(std::min<int64_t>(std::max<int32_t>(K, 2), V));  // margin needs two
  at::Tensor vals = at::empty({B, D, K2}, at::kFloat), ids = at::empty({B, D, K2}, at::kLong);
  at::Tensor entropy = at::empty({B, D}, at::kFloat), margin = at::empty({B, D}, at::kFloat),
             mass = at::empty({B, D}, at::kFloat);
  Proposal p{at::empty({B, N}, at::kLong), at::empty({B, N}, at::kInt), at::empty({B, N}, at::kInt),
             at::empty({B}, at::kInt), at::empty({B, N}, at::kFloat)};
  at::Tensor logq = at::empty({B, N}, at::kFloat), step_logq = at::empty({B, N}, at::kFloat),
             rank = at::empty({B, N}, at::kInt);
  const float* x = logits.data_ptr<float>();
  const int64_t* vid = vocab_ids.defined() ? vocab_ids.data_ptr<int64_t>() : nullptr;
  float *vp = vals.data_ptr<float>(), *ep = entropy.data_ptr<float>(), *mp = margin.data_ptr<float>(),
        *sp = mass.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  int64_t bad = B * D;
  for (int64_t r = 0; r < B * D && bad == B * D; ++r) {
    thread_local taps::TopKStatsWorkspace ws;
    if (!taps::position_stats(x + r * V, V, K, K2, vp + r * K2, ip + r * K2, ep + r, mp + r, sp + r, ws)) bad = r;
  }
  if (bad < B * D) {
    throw py::value_error("draft_logits[" + std::to_string(bad / D) + "," + std::to_string(bad % D) +
                          "]: a NaN or +inf logit, or every logit -inf; expected finite logits or -inf (an "
                          "impossible token) with at least one possible token per position");
  }
  // the pool reads the first K columns of each position, as token ids (the reduced vocabulary mapped back)
  std::vector<float> lp(static_cast<size_t>(D * K));
  std::vector<int64_t> tok(static_cast<size_t>(D * K));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t d = 0; d < D; ++d) {
      for (int32_t k = 0; k < K; ++k) {
        const int64_t src = (b * D + d) * K2 + k;
        lp[d * K + k] = vp[src];
        tok[d * K + k] = vid ? vid[ip[src]] : ip[src];
      }
    }
    thread_local taps::PoolWorkspace ws;
    p.num_nodes.data_ptr<int32_t>()[b] = taps::best_first_pool_one(
        lp.data(), tok.data(), roots.data_ptr<int64_t>()[b], static_cast<int32_t>(D), K, pool_size,
        p.tokens.data_ptr<int64_t>() + b * N, p.parents.data_ptr<int32_t>() + b * N,
        p.depth.data_ptr<int32_t>() + b * N, logq.data_ptr<float>() + b * N, step_logq.data_ptr<float>() + b * N,
        rank.data_ptr<int32_t>() + b * N, ws);
  }
  *pool_seconds = since(t);
  if (scorer == nullptr) {
    p.log_reach = logq;
    *scoring_seconds = 0.0;
    return p;
  }
  if (scorer->net.full) {  // pool tokens index the embedding table
    const int64_t* tk = p.tokens.data_ptr<int64_t>();
    for (int64_t k = 0; k < B * N; ++k) {
      if (tk[k] < 0 || tk[k] >= table->rows) {
        throw py::value_error("pool token " + std::to_string(tk[k]) + " (row " + std::to_string(k / N) +
                              ") is outside token_embeddings' " + std::to_string(table->rows) + " rows");
      }
    }
  }
  at::Tensor edge = at::empty({B, N}, at::kFloat), other = at::empty({B, N}, at::kFloat);
  const int64_t H = scorer->net.full ? scorer->net.H : 0;
  for (int64_t b = 0; b < B; ++b) {
    thread_local taps::ScoreWorkspace ws;
    taps::ScoreTree s;
    s.tokens = p.tokens.data_ptr<int64_t>() + b * N;
    s.parents = p.parents.data_ptr<int32_t>() + b * N;
    s.depth = p.depth.data_ptr<int32_t>() + b * N;
    s.N = static_cast<int32_t>(N);
    s.logq = logq.data_ptr<float>() + b * N;
    s.step_logq = step_logq.data_ptr<float>() + b * N;
    s.entropy = ep + b * D;
    s.margin = mp + b * D;
    s.topk_mass = sp + b * D;
    s.D = static_cast<int32_t>(D);
    const float* hid = scorer->net.full ? hidden.data_ptr<float>() + b * D * H : nullptr;
    taps::score_edges_one(s, &scorer->net, table, hid, edge.data_ptr<float>() + b * N,
                          other.data_ptr<float>() + b * N, p.log_reach.data_ptr<float>() + b * N, ws);
  }
  *scoring_seconds = since(t);
  return p;
}

// The root alone per row, log reach 0 (an undrafted round).
Proposal root_proposal(const at::Tensor& roots) {
  const int64_t B = roots.size(0);
  return Proposal{roots.reshape({B, 1}).clone(), at::full({B, 1}, -1, at::kInt), at::zeros({B, 1}, at::kInt),
                  at::ones({B}, at::kInt), at::zeros({B, 1}, at::kFloat)};
}

// p with chain [B, K] grafted in (taps::graft_chain): width N + K; nodes [B, K] receives each chain token's node.
Proposal graft(const Proposal& p, const at::Tensor& chain, const at::Tensor& chain_len, const at::Tensor& chain_reach,
               at::Tensor& nodes) {
  const int64_t B = p.tokens.size(0), N = p.tokens.size(1), K = chain.size(1), W = N + K;
  const at::Tensor ch = chain.contiguous();
  Proposal g{at::empty({B, W}, at::kLong), at::empty({B, W}, at::kInt), at::empty({B, W}, at::kInt),
             at::empty({B}, at::kInt), at::empty({B, W}, at::kFloat)};
  taps::graft_chain(p.tokens.data_ptr<int64_t>(), p.parents.data_ptr<int32_t>(), p.depth.data_ptr<int32_t>(),
                    p.num_nodes.data_ptr<int32_t>(), p.log_reach.data_ptr<float>(), B, N, ch.data_ptr<int64_t>(),
                    chain_len.data_ptr<int64_t>(), chain_reach.data_ptr<float>(), K, g.tokens.data_ptr<int64_t>(),
                    g.parents.data_ptr<int32_t>(), g.depth.data_ptr<int32_t>(), g.num_nodes.data_ptr<int32_t>(),
                    g.log_reach.data_ptr<float>(), nodes.data_ptr<int64_t>());
  return g;
}

// tokens [B] i64, depth_cap [B] i64 or None; the draft (logits [B,D,V] f32, vocab_ids [V] i64 or None, top_k,
// pool_size, scorer fields or None, ln_eps, token_embeddings [V',E], drafter_hidden [B,D,H] f32) or logits None;
// the lookup (history [B,C] i64, lengths [B] i64, num_tokens, max_ngram, log_q [max_ngram+1] f32, log_s
// [max_ngram+1] f32 or None: no sibling grafted) or history None; the throughput rule (max_nodes, table,
// plain_seconds, rows).
// -> ([tokens [B,M] i64, parents [B,M] i32, depth [B,M] i32, num_nodes [B] i32, pool_index [B,M] i64,
//      num_selected [B] i32, expected [B] f32, chain [B, 5+K] i64 (match length, chain length, chain nodes kept,
//      sibling (-1: none), sibling kept, the chain; [B,0] without lookup)], [seconds of pool, scoring, lookup,
//      selection]), M = max_nodes + 1. The seconds are host floats, not a tensor: reading them back is no device
//      read.
using RoundOut = std::pair<std::vector<at::Tensor>, std::vector<double>>;

RoundOut build_round(const at::Tensor& root_tokens, const std::optional<at::Tensor>& depth_cap,
                     const std::optional<at::Tensor>& draft_logits, const std::optional<at::Tensor>& vocab_ids,
                     int64_t top_k, int64_t pool_size, const std::optional<std::map<std::string, at::Tensor>>& weights,
                     double ln_eps, const std::optional<at::Tensor>& token_embeddings,
                     const std::optional<at::Tensor>& drafter_hidden, const std::optional<at::Tensor>& history,
                     const std::optional<at::Tensor>& lengths, int64_t num_tokens, int64_t max_ngram,
                     const std::optional<at::Tensor>& log_q, const std::optional<at::Tensor>& log_s,
                     int64_t max_nodes, const at::Tensor& table,
                     double plain_seconds, int64_t rows) {
  check_arg(root_tokens, "root_tokens", {at::kLong}, {-1});
  const int64_t B = root_tokens.size(0);
  if (B < 1) throw py::value_error("root_tokens: expected at least one row, received shape (0,)");
  const at::Tensor roots = root_tokens.contiguous();
  const int64_t* rt = roots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (rt[b] < 0) {
      throw py::value_error("root_tokens[" + std::to_string(b) + "]: expected a token id >= 0, received " +
                            std::to_string(rt[b]));
    }
  }
  at::Tensor cap;
  if (depth_cap.has_value() && depth_cap->defined()) {
    check_arg(*depth_cap, "depth_cap", {at::kLong}, {B});
    cap = depth_cap->contiguous();
  }
  at::Tensor table_f64;
  const taps::ThroughputParams params = check_throughput_params(max_nodes, table, plain_seconds, rows, table_f64);

  // the draft's inputs
  const bool drafted = draft_logits.has_value() && draft_logits->defined();
  at::Tensor logits, vids, hidden;
  std::optional<ScorerArgs> scorer;
  taps::TokenTable emb_table;
  if (drafted) {
    check_arg(*draft_logits, "draft_logits", {at::kFloat}, {B, -1, -1});
    logits = draft_logits->contiguous();
    const int64_t D = logits.size(1), V = logits.size(2);
    if (D < 1 || V < 1) {
      throw py::value_error("draft_logits: expected at least one draft position and one vocabulary column, "
                            "received shape " + shape_str(logits.sizes()));
    }
    check_count("top_k", top_k, 1);
    check_count("pool_size", pool_size, 1);
    if (vocab_ids.has_value() && vocab_ids->defined()) {
      check_arg(*vocab_ids, "vocab_ids", {at::kLong}, {V});
      vids = vocab_ids->contiguous();
    }
    if (weights.has_value()) {
      scorer = check_scorer(*weights, ln_eps);
      if (scorer->net.full) {
        if (!token_embeddings.has_value() || !token_embeddings->defined()) {
          throw py::type_error("token_embeddings: the full scorer needs a [V, E] tensor, received None");
        }
        check_arg(*token_embeddings, "token_embeddings", {at::kFloat, at::kHalf, at::kBFloat16},
                  {-1, scorer->embed_dim});
        if (!drafter_hidden.has_value() || !drafter_hidden->defined()) {
          throw py::type_error("drafter_hidden: the full scorer needs a [B, D, H] tensor, received None");
        }
        check_arg(*drafter_hidden, "drafter_hidden", {at::kFloat}, {B, D, scorer->net.H});
        hidden = drafter_hidden->contiguous();
        emb_table = token_table(*token_embeddings);  // pool tokens are checked against its rows once built
      }
    }
  }

  // the lookup's inputs
  const bool lookup = history.has_value() && history->defined();
  at::Tensor hist, lens, logq_n, logs_n;
  if (lookup) {
    check_arg(*history, "history", {at::kLong}, {B, -1});
    hist = history->contiguous();
    if (!lengths.has_value() || !lengths->defined()) {
      throw py::type_error("lengths: expected [B] int64, received None");
    }
    check_arg(*lengths, "lengths", {at::kLong}, {B});
    lens = lengths->contiguous();
    const int64_t* ln = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = ln[b];
      if (n < 0 || n > hist.size(1)) {
        throw py::value_error("lengths[" + std::to_string(b) + "]: expected a history length in [0, " +
                              std::to_string(hist.size(1)) + "], received " + std::to_string(n));
      }
    }
    check_count("num_tokens", num_tokens, 0);
    check_count("max_ngram", max_ngram, 1);
    if (!log_q.has_value() || !log_q->defined()) {
      throw py::type_error("log_q: expected [max_ngram + 1] float32, received None");
    }
    check_arg(*log_q, "log_q", {at::kFloat}, {max_ngram + 1});
    logq_n = log_q->contiguous();
    if (log_s.has_value() && log_s->defined()) {
      check_arg(*log_s, "log_s", {at::kFloat}, {max_ngram + 1});
      logs_n = log_s->contiguous();
    }
  }

  py::gil_scoped_release no_gil;
  double seconds[4] = {0.0, 0.0, 0.0, 0.0};  // pool, scoring, lookup, selection
  Proposal p = drafted ? draft_proposal(logits, vids, roots, static_cast<int32_t>(top_k),
                                        static_cast<int32_t>(pool_size), scorer ? &*scorer : nullptr, &emb_table,
                                        hidden, &seconds[0], &seconds[1])
                       : root_proposal(roots);
  Clock::time_point t = Clock::now();
  const int64_t K = lookup ? num_tokens : 0;
  at::Tensor chain, chain_nodes, ngram, chain_len, sibling, sibling_node;
  if (lookup) {
    chain = at::empty({B, K}, at::kLong);
    chain_len = at::empty({B}, at::kLong);
    ngram = at::empty({B}, at::kLong);
    sibling = at::empty({B}, at::kLong);
    taps::lookup_chain(hist.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), B, hist.size(1), K, max_ngram,
                       chain.data_ptr<int64_t>(), chain_len.data_ptr<int64_t>(), ngram.data_ptr<int64_t>(),
                       sibling.data_ptr<int64_t>());
    // chain token k of a row matched on n tokens: (k + 1) * log q_n in float32 (LookupChain's rule)
    at::Tensor chain_reach = at::empty({B, K}, at::kFloat);
    const float* lq = logq_n.data_ptr<float>();
    const int64_t* ng = ngram.data_ptr<int64_t>();
    float* cr = chain_reach.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < K; ++k) cr[b * K + k] = lq[ng[b]] * static_cast<float>(k + 1);
    }
    chain_nodes = at::empty({B, K}, at::kLong);
    p = graft(p, chain, chain_len, chain_reach, chain_nodes);
    if (logs_n.defined()) {  // the sibling: a one-token chain under the root with log reach log s_n
      at::Tensor one = sibling.clamp_min(0).view({B, 1}), one_len = sibling.ge(0).to(at::kLong),
                 one_reach = at::empty({B, 1}, at::kFloat);
      const float* ls = logs_n.data_ptr<float>();
      float* sr = one_reach.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) sr[b] = ls[ng[b]];
      sibling_node = at::empty({B, 1}, at::kLong);
      p = graft(p, one, one_len, one_reach, sibling_node);
    }
    seconds[2] = since(t);
  }

  // nodes deeper than their row's cap are never kept
  const int64_t N = p.tokens.size(1), M = max_nodes + 1;
  at::Tensor reach = cap.defined() || !p.log_reach.is_contiguous() ? p.log_reach.clone() : p.log_reach;
  if (cap.defined()) {
    float* r = reach.data_ptr<float>();
    const int32_t* dp = p.depth.data_ptr<int32_t>();
    const int64_t* cp = cap.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < N; ++i) {
        if (dp[b * N + i] > cp[b]) r[b * N + i] = -std::numeric_limits<float>::infinity();
      }
    }
  }
  at::Tensor pool_index = at::empty({B, M}, at::kLong), num_selected = at::empty({B}, at::kInt),
             expected = at::empty({B}, at::kFloat);
  run_throughput_rule(reach, p.num_nodes.data_ptr<int32_t>(), params, pool_index.data_ptr<int64_t>(),
                      num_selected.data_ptr<int32_t>(), expected.data_ptr<float>());
  at::Tensor out_tokens = at::empty({B, M}, at::kLong), out_parents = at::empty({B, M}, at::kInt),
             out_depth = at::empty({B, M}, at::kInt), out_num = at::empty({B}, at::kInt);
  std::vector<int32_t> new_of_old(static_cast<size_t>(N));
  const int64_t* pi = pool_index.data_ptr<int64_t>();
  const int32_t* ns = num_selected.data_ptr<int32_t>();
  int64_t* ot = out_tokens.data_ptr<int64_t>();
  int32_t *op = out_parents.data_ptr<int32_t>(), *od = out_depth.data_ptr<int32_t>(), *on = out_num.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    taps::reindex_subtree_one(p.tokens.data_ptr<int64_t>() + b * N, p.parents.data_ptr<int32_t>() + b * N,
                              p.depth.data_ptr<int32_t>() + b * N, static_cast<int32_t>(N), pi + b * M,
                              static_cast<int32_t>(M), ot + b * M, op + b * M, od + b * M, new_of_old.data());
    on[b] = ns[b] + 1;
  }
  constexpr int64_t H = 5;  // the aux header: match length, chain length, chain kept, sibling, sibling kept
  at::Tensor aux = at::empty({B, lookup ? H + K : 0}, at::kLong);
  if (lookup) {
    int64_t* a = aux.data_ptr<int64_t>();
    const int64_t *cn = chain_nodes.data_ptr<int64_t>(), *ch = chain.data_ptr<int64_t>(),
                  *ng = ngram.data_ptr<int64_t>(), *cl = chain_len.data_ptr<int64_t>(),
                  *sb = sibling.data_ptr<int64_t>();
    const int64_t* sn = sibling_node.defined() ? sibling_node.data_ptr<int64_t>() : nullptr;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* kept_row = pi + b * M;
      auto kept = [&](int64_t node) { return node >= 0 && std::find(kept_row, kept_row + M, node) != kept_row + M; };
      int64_t chain_kept = 0;
      for (int64_t k = 0; k < K; ++k) chain_kept += kept(cn[b * K + k]);
      int64_t* row = a + b * (H + K);
      row[0] = ng[b];
      row[1] = cl[b];
      row[2] = chain_kept;
      row[3] = sb[b];
      row[4] = sn != nullptr && kept(sn[b]);
      for (int64_t k = 0; k < K; ++k) row[H + k] = ch[b * K + k];
    }
  }
  seconds[3] = since(t);
  return {{out_tokens, out_parents, out_depth, out_num, pool_index, num_selected, expected, aux},
          std::vector<double>(seconds, seconds + 4)};
}

// ------------------------------------------------------------------------------ the drafter's kept context
// Copies each row's accepted features into the drafter state's kept rows and advances its counters, in place:
// for b < B, r = row0 + b, j < T: dst[r, fill[r] + j] = src[b, max(path[b, j], 0)]; then fill[r] += counts[b] and
// lengths[r] += counts[b]. All T rows are copied (what DrafterInference.append_context's torch path writes; rows
// past counts[b] are scratch a later round overwrites). Why: in Python the gather, the index copy and the counter
// updates were ~10 small torch ops, ~0.13 ms of every decode round; here one call. Everything is checked before
// anything is written, so a bad call leaves the state as it was.
void stash_rows(const at::Tensor& src, const at::Tensor& path, const at::Tensor& counts, const at::Tensor& dst,
                const at::Tensor& fill, const at::Tensor& lengths, int64_t row0) {
  check_arg(src, "ctx_features", {at::kFloat}, {-1, -1, -1});
  const int64_t B = src.size(0), N = src.size(1), F = src.size(2);
  check_arg(path, "path", {at::kLong}, {B, -1});
  const int64_t T = path.size(1);
  check_arg(counts, "counts", {at::kLong}, {B});
  check_arg(dst, "pending_features", {at::kFloat}, {-1, -1, F});
  const int64_t R = dst.size(0), S = dst.size(1);
  check_arg(fill, "pending", {at::kLong}, {R});
  check_arg(lengths, "lengths", {at::kLong}, {R});
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{src, "ctx_features"}, {path, "path"},
                                {counts, "counts"}, {dst, "pending_features"}, {fill, "pending"},
                                {lengths, "lengths"}}) {
    if (!t.is_contiguous()) throw py::value_error(std::string(name) + ": expected a contiguous tensor");
  }
  if (row0 < 0 || row0 + B > R) {
    throw py::value_error("rows: expected " + std::to_string(B) + " state rows from row " + std::to_string(row0) +
                          " inside [0, " + std::to_string(R) + ")");
  }
  const int64_t* pa = path.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  int64_t* fl = fill.data_ptr<int64_t>();
  int64_t* ln = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const std::string at_b = "[" + std::to_string(b) + "]";
    if (cn[b] < 0 || cn[b] > T) {
      throw py::value_error("counts" + at_b + ": expected 0 <= count <= " + std::to_string(T) + " (path's columns), "
                            "received " + std::to_string(cn[b]));
    }
    if (fl[row0 + b] < 0 || fl[row0 + b] + T > S) {
      throw py::value_error("pending[" + std::to_string(row0 + b) + "]: " + std::to_string(fl[row0 + b]) +
                            " kept rows + " + std::to_string(T) + " new ones do not fit the " + std::to_string(S) +
                            " kept-row slots (flush first)");
    }
    for (int64_t j = 0; j < T; ++j) {
      const int64_t node = pa[b * T + j];
      if (node < -1 || node >= N) {
        throw py::value_error("path" + at_b + "[" + std::to_string(j) + "]: expected a node in [0, " +
                              std::to_string(N) + ") or -1, received " + std::to_string(node));
      }
    }
  }
  const float* sp = src.data_ptr<float>();
  float* dp = dst.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = row0 + b;
    for (int64_t j = 0; j < T; ++j) {
      const int64_t node = std::max<int64_t>(pa[b * T + j], 0);
      std::memcpy(dp + (r * S + fl[r] + j) * F, sp + (b * N + node) * F, sizeof(float) * F);
    }
    fl[r] += cn[b];
    ln[r] += cn[b];
  }
}

}  // namespace

void register_round(py::module& m) {
  m.def("build_round", &build_round,
        "one round's tree: pool -> scorer reach -> lookup graft -> throughput rule -> re-index (see "
        "taps_kernels.ops.build) -> ([tokens, parents, depth, num_nodes, pool_index, num_selected, expected, chain "
        "[B, 5+K] i64], [seconds of pool, scoring, lookup, selection])",
        py::arg("root_tokens"), py::arg("depth_cap"), py::arg("draft_logits"), py::arg("vocab_ids"), py::arg("top_k"),
        py::arg("pool_size"), py::arg("weights"), py::arg("ln_eps"), py::arg("token_embeddings"),
        py::arg("drafter_hidden"), py::arg("history"), py::arg("lengths"), py::arg("num_tokens"),
        py::arg("max_ngram"), py::arg("log_q"), py::arg("log_s"), py::arg("max_nodes"), py::arg("table"),
        py::arg("plain_seconds"), py::arg("rows"));
  m.def("stash_rows", &stash_rows,
        "the drafter's kept context in place: pending_features[row0 + b, pending + j] = ctx_features[b, path[b, j] "
        "(-1: 0)] for j < T, then pending and lengths += counts (DrafterInference.append_context)",
        py::arg("ctx_features"), py::arg("path"), py::arg("counts"), py::arg("pending_features"), py::arg("pending"),
        py::arg("lengths"), py::arg("row0"));
}

}  // namespace taps_bind
