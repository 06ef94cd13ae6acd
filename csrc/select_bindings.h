// Torch bindings of subtree selection (select_subtree, select_throughput, reindex_subtree), and the throughput
// rule's argument check and run step, which the fused round build shares.
#pragma once

#include <torch/extension.h>

#include "tree_ops.h"

namespace taps_bind {

// The rule's scalars and table checked (errors name the argument); table_f64 keeps the float64 copy params points to.
taps::ThroughputParams check_throughput_params(int64_t max_nodes, const at::Tensor& table, double plain_seconds,
                                               int64_t rows, at::Tensor& table_f64);

// select_throughput_batch over log_reach [B, N] float32 (contiguous; reach = torch's float64 exp of it) and
// num_nodes [B]: pool_index [B, max_nodes + 1], num_selected [B], expected [B].
void run_throughput_rule(const at::Tensor& log_reach, const int32_t* num_nodes, const taps::ThroughputParams& params,
                         int64_t* pool_index, int32_t* num_selected, float* expected);

void register_select(pybind11::module& m);

}  // namespace taps_bind
