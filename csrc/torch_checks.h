// Argument checks shared by the torch bindings: errors name the argument, what was expected and what arrived.
#pragma once

#include <torch/extension.h>

#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

namespace taps_bind {

namespace py = pybind11;

inline std::string dtype_name(at::ScalarType t) {
  std::string s = c10::toString(t);
  // c10 spells dtypes "Float", "Long", ...; the Python side says float32, int64: use torch's Python names.
  if (s == "Float") return "float32";
  if (s == "Double") return "float64";
  if (s == "Half") return "float16";
  if (s == "BFloat16") return "bfloat16";
  if (s == "Long") return "int64";
  if (s == "Int") return "int32";
  if (s == "Short") return "int16";
  if (s == "Char") return "int8";
  if (s == "Byte") return "uint8";
  if (s == "Bool") return "bool";
  return s;
}

inline std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  if (sizes.size() == 1) os << ",";
  os << ")";
  return os.str();
}

// Checks a CPU tensor's dtype and rank (and sizes where given, -1 = any); raises TypeError / ValueError.
inline void check_arg(const at::Tensor& t, const std::string& name, std::initializer_list<at::ScalarType> dtypes,
               std::vector<int64_t> sizes) {
  if (!t.defined()) throw py::type_error(name + ": expected a torch.Tensor, received None");
  bool ok = false;
  std::string want;
  for (auto d : dtypes) {
    ok = ok || t.scalar_type() == d;
    want += (want.empty() ? "" : " or ") + dtype_name(d);
  }
  if (!ok) throw py::type_error(name + ": expected dtype " + want + ", received " + dtype_name(t.scalar_type()));
  if (!t.device().is_cpu()) {
    throw py::value_error(name + ": the C++ backend needs a CPU tensor, received one on " + t.device().str());
  }
  if (t.dim() != static_cast<int64_t>(sizes.size())) {
    throw py::value_error(name + ": expected a " + std::to_string(sizes.size()) + "-D tensor, received shape " +
                          shape_str(t.sizes()));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] >= 0 && t.size(static_cast<int64_t>(i)) != sizes[i]) {
      std::string pretty = "(";
      for (size_t k = 0; k < sizes.size(); ++k) {
        pretty += (k ? ", " : "") + (sizes[k] >= 0 ? std::to_string(sizes[k]) : std::string("*"));
      }
      pretty += sizes.size() == 1 ? ",)" : ")";
      throw py::value_error(name + ": expected shape " + pretty + ", received " + shape_str(t.sizes()));
    }
  }
}

}  // namespace taps_bind
