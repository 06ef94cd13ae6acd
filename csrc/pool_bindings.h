// Torch bindings of the candidate pool's ops (topk_stats, argmax_rows, best_first_pool, propagate_reach).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_pool(pybind11::module& m);

}  // namespace taps_bind
