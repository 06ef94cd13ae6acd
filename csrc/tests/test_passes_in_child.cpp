// passes_in_child, which guards the AMX start-up check: a check that returns true passes, one that returns
// false or dies (an illegal instruction, as an AMX kernel would on a CPU or kernel that refuses it) does not,
// and this process goes on either way.
#include <csignal>

#include "check.h"
#include "gguf_linear.h"

namespace {

bool returns_true() { return true; }
bool returns_false() { return false; }
bool dies() {
  std::raise(SIGILL);
  return true;
}

}  // namespace

int main() {
#if defined(__linux__)
  CHECK(taps::gguf::passes_in_child(returns_true));
  CHECK(!taps::gguf::passes_in_child(returns_false));
  CHECK(!taps::gguf::passes_in_child(dies));
  CHECK(taps::gguf::passes_in_child(returns_true));  // and the parent still forks after a child died
#endif
  return g_failures != 0;
}
