// Torch binding of the C++ edge scorer (score_edges.h).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_score(pybind11::module& m);

}  // namespace taps_bind
