// Torch binding of one round's tree build in one call (pool, scorer reach, lookup graft, throughput rule).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_round(pybind11::module& m);

}  // namespace taps_bind
