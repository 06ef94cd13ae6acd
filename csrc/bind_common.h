// Helpers shared by the torch bindings' translation units: scalar and value checks whose errors name the
// argument, the batch loop, and the per-call timing of the timing harnesses.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "torch_checks.h"

namespace taps_bind {

inline int32_t check_count(const std::string& name, int64_t value, int64_t minimum) {
  if (value < minimum || value > std::numeric_limits<int32_t>::max() - 1) {
    throw py::value_error(name + ": expected an int in [" + std::to_string(minimum) + ", 2**31 - 2], received " +
                          std::to_string(value));
  }
  return static_cast<int32_t>(value);
}

// Where-string of a flat row-major index into a [d0, d1, ...] tensor: "[i,j,k]".
inline std::string index_str(int64_t flat, at::IntArrayRef sizes) {
  std::vector<int64_t> idx(sizes.size());
  for (int64_t k = static_cast<int64_t>(sizes.size()) - 1; k >= 0; --k) {
    idx[k] = sizes[k] > 0 ? flat % sizes[k] : 0;
    flat = sizes[k] > 0 ? flat / sizes[k] : 0;
  }
  std::string s = "[";
  for (size_t k = 0; k < idx.size(); ++k) s += (k ? "," : "") + std::to_string(idx[k]);
  return s + "]";
}

inline std::string float_str(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Log-probabilities of a contiguous float tensor: -inf allowed, NaN and +inf refused. Entries whose
// `parents` (same shape, int32) is -1 are ignored when `parents` is given (the root and padding).
inline void check_log_values(const at::Tensor& t, const std::string& name, const at::Tensor* parents = nullptr) {
  const float* x = t.data_ptr<float>();
  const int32_t* p = parents ? parents->data_ptr<int32_t>() : nullptr;
  const int64_t n = t.numel();
  for (int64_t k = 0; k < n; ++k) {
    if ((std::isnan(x[k]) || x[k] == std::numeric_limits<float>::infinity()) && (!p || p[k] >= 0)) {
      throw py::value_error(name + index_str(k, t.sizes()) + ": expected a log-probability (finite or -inf), received " +
                            float_str(x[k]));
    }
  }
}

inline void check_no_nan(const at::Tensor& t, const std::string& name) {
  const float* x = t.data_ptr<float>();
  for (int64_t k = 0; k < t.numel(); ++k) {
    if (std::isnan(x[k])) throw py::value_error(name + index_str(k, t.sizes()) + ": expected a number, received nan");
  }
}

inline double check_real(const std::string& name, double v, bool finite = true) {
  if (std::isnan(v)) throw py::value_error(name + ": expected a number, received nan");
  if (finite && std::isinf(v)) throw py::value_error(name + ": expected a finite float, received " + float_str(v));
  return v;
}

// Batch loop: run inline for small batches, where a thread hand-off costs more than the work.
template <typename F>
void for_batch(int64_t B, int64_t work_per_row, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, work_per_row));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fn(b);
  });
}

inline double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

inline void check_iters(int64_t iters) {
  if (iters < 1) throw py::value_error("iters: expected an int >= 1, received " + std::to_string(iters));
}

// (wall seconds, calling-thread CPU seconds) per call. On a shared machine the CPU time is the better
// estimate of the kernel's own cost (it leaves out time the thread waited to be scheduled); it counts
// only the calling thread, so it is meaningful when the batch runs inline (small B).
template <typename F>
std::pair<double, double> seconds_per_iter(int64_t iters, const F& fn) {
  fn();  // warm the workspaces and caches
  const double cpu_start = thread_cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) fn();
  const auto stop = std::chrono::steady_clock::now();
  const double cpu = thread_cpu_seconds() - cpu_start;
  const double n = static_cast<double>(iters);
  return {std::chrono::duration<double>(stop - start).count() / n, cpu / n};
}

inline void check_parent_range(const at::Tensor& parents, const std::string& name) {
  // Memory safety of the walks: every parent is -1 or a smaller index of the same row.
  const int64_t B = parents.size(0), N = parents.size(1);
  const int32_t* p = parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < N; ++i) {
      const int32_t v = p[b * N + i];
      if (v < -1 || v >= i) {
        throw py::value_error(name + "[" + std::to_string(b) + "," + std::to_string(i) + "]: parent index " +
                              std::to_string(v) + " must be -1 or smaller than " + std::to_string(i));
      }
    }
  }
}

struct TreeArgs {
  at::Tensor parents, depth, num_nodes;
  int64_t B, N;
};

// Checks tensors and the structure the walks index with (num_nodes range, parent < child); the full
// check with the public op's messages is taps_kernels.layout.validate_tree.
// ``depth`` may be undefined for ops that do not read it.
inline TreeArgs check_tree(const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& num_nodes) {
  check_arg(parents, "tree.parents", {at::kInt}, {-1, -1});
  const int64_t B = parents.size(0), N = parents.size(1);
  if (N < 1) throw py::value_error("tree.parents: expected at least one node, received shape " + shape_str(parents.sizes()));
  check_count("tree.parents.shape[1]", N, 1);
  if (depth.defined()) check_arg(depth, "tree.depth", {at::kInt}, {B, N});
  check_arg(num_nodes, "tree.num_nodes", {at::kInt}, {B});
  TreeArgs t{parents.contiguous(), depth.defined() ? depth.contiguous() : at::Tensor(), num_nodes.contiguous(), B, N};
  const int32_t* nn = t.num_nodes.data_ptr<int32_t>();
  const int32_t* p = t.parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (nn[b] < 1 || nn[b] > N) {
      throw py::value_error("tree.num_nodes[" + std::to_string(b) + "]: expected a value in [1, " + std::to_string(N) +
                            "], received " + std::to_string(nn[b]));
    }
    for (int64_t i = 1; i < nn[b]; ++i) {
      const int32_t v = p[b * N + i];
      if (v < 0 || v >= i) {
        throw py::value_error("tree.parents[" + std::to_string(b) + "," + std::to_string(i) + "]: parent index " +
                              std::to_string(v) + " is out of range or not smaller than the child's index; expected "
                              "0 <= parent < " + std::to_string(i));
      }
    }
  }
  return t;
}

}  // namespace taps_bind
