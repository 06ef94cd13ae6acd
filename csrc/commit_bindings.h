// Torch bindings of a verified round's commit: the round's acceptance (accept_round), KV compaction (compact_kv)
// and the whole commit in one call (commit_round: greedy tokens, acceptance walk, history append, compaction,
// lengths).
#pragma once

#include <torch/extension.h>

namespace taps_bind {

void register_commit(pybind11::module& m);

}  // namespace taps_bind
