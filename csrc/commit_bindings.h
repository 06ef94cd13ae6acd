// Torch bindings of a verified round's commit: KV compaction (compact_kv) and the whole commit in one call
// (commit_round: greedy tokens, acceptance walk, history append, compaction, the per-row counters).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_commit(pybind11::module& m);

}  // namespace taps_bind
