// Torch bindings of subtree selection (select_subtree, select_throughput, reindex_subtree).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_select(pybind11::module& m);

}  // namespace taps_bind
