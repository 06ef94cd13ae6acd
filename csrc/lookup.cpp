// Prompt lookup on the host (see lookup.h).
#include "lookup.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace taps {

void lookup_chain(const int64_t* tokens, const int64_t* lengths, int64_t B, int64_t C, int64_t K, int64_t max_ngram,
                  int64_t* chain, int64_t* chain_len, int64_t* ngram, int64_t* sibling) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = tokens + b * C;
    const int64_t L = lengths[b];
    int64_t cont = -1, n_hit = 0, sib = -1;
    for (int64_t n = std::min(max_ngram, C - 1); n >= 1 && n_hit == 0; --n) {
      if (L < n + 1) continue;  // an occurrence needs s >= 0 with s + n < L
      const int64_t* suffix = row + L - n;
      // the latest window first: the first hit going down is the latest occurrence; the scan goes on to the
      // latest one whose next token differs (the sibling), which in text usually sits a few occurrences back
      for (int64_t s = L - n - 1; s >= 0; --s) {
        if (std::memcmp(row + s, suffix, static_cast<size_t>(n) * sizeof(int64_t)) != 0) continue;
        if (n_hit == 0) {
          cont = s + n;
          n_hit = n;
        } else if (row[s + n] != row[cont]) {
          sib = row[s + n];
          break;
        }
      }
    }
    int64_t len = 0;
    for (int64_t k = 0; k < K; ++k) {
      const bool valid = n_hit > 0 && cont + k < L;
      chain[b * K + k] = valid ? row[cont + k] : 0;
      len += valid;
    }
    chain_len[b] = len;
    ngram[b] = n_hit;
    sibling[b] = sib;
  }
}

void graft_chain(const int64_t* tokens, const int32_t* parents, const int32_t* depth, const int32_t* num_nodes,
                 const float* log_reach, int64_t B, int64_t N, const int64_t* chain, const int64_t* chain_len,
                 const float* chain_log_reach, int64_t K, int64_t* out_tokens, int32_t* out_parents,
                 int32_t* out_depth, int32_t* out_num_nodes, float* out_reach, int64_t* chain_nodes) {
  const int64_t W = N + K;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t b = 0; b < B; ++b) {
    int64_t* tok = out_tokens + b * W;
    int32_t* par = out_parents + b * W;
    int32_t* dep = out_depth + b * W;
    float* reach = out_reach + b * W;
    std::copy(tokens + b * N, tokens + (b + 1) * N, tok);
    std::copy(parents + b * N, parents + (b + 1) * N, par);
    std::copy(depth + b * N, depth + (b + 1) * N, dep);
    std::copy(log_reach + b * N, log_reach + (b + 1) * N, reach);
    std::fill(tok + N, tok + W, 0);
    std::fill(par + N, par + W, -1);
    std::fill(dep + N, dep + W, 0);
    std::fill(reach + N, reach + W, -std::numeric_limits<float>::infinity());
    int64_t num = num_nodes[b], cur = 0;
    const int64_t live = std::min(chain_len[b], K);
    for (int64_t k = 0; k < K; ++k) {
      if (k >= live) {
        chain_nodes[b * K + k] = -1;
        continue;
      }
      const int64_t t = chain[b * K + k];
      int64_t child = num;
      for (int64_t i = 0; i < num; ++i) {
        if (par[i] == cur && tok[i] == t) {
          child = i;
          break;
        }
      }
      if (child == num) {
        tok[num] = t;
        par[num] = static_cast<int32_t>(cur);
        dep[num] = static_cast<int32_t>(k + 1);
        ++num;
      }
      const float r = chain_log_reach[b * K + k];
      reach[child] = (std::isnan(reach[child]) || std::isnan(r)) ? nan : std::max(reach[child], r);
      chain_nodes[b * K + k] = child;
      cur = child;
    }
    out_num_nodes[b] = static_cast<int32_t>(num);
  }
}

}  // namespace taps
