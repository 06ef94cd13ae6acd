// Torch bindings of the GGUF block kernels (gguf_linear.h) and the decoder forward (gguf_forward.h).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_gguf(pybind11::module& m);

}  // namespace taps_bind
