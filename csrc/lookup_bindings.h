// Torch bindings of the host prompt lookup (lookup.h).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_lookup(pybind11::module& m);

}  // namespace taps_bind
