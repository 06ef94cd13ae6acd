// Torch binding of the C++ edge scorer (score_edges.h), and the scorer argument checks other bindings share.
#pragma once

#include <torch/extension.h>

#include <map>
#include <string>
#include <vector>

#include "score_edges.h"

namespace taps_bind {

// The ScorerWeights fields (ScorerWeights.tensors(), float32) checked one by one so that an error names the field;
// net points into the contiguous copies kept alive in `held`.
struct ScorerArgs {
  taps::ScorerNet net;
  int64_t embed_dim = 0;  // E, the width token_proj_weight expects of token_embeddings
  std::vector<at::Tensor> held;
};
ScorerArgs check_scorer(const std::map<std::string, at::Tensor>& weights, double ln_eps);

// A [V, E] float32 / float16 / bfloat16 table read in place (any strides), rows widened to float32.
taps::TokenTable token_table(const at::Tensor& emb);

void register_score(pybind11::module& m);

}  // namespace taps_bind
