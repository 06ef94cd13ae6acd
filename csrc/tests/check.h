// The C++ unit tests' one assertion: a failed CHECK prints where and what, counts, and lets the test go on
// (so one run reports every failure); main() returns g_failures != 0.
#pragma once

#include <cstdio>

namespace {

int g_failures = 0;

}  // namespace

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)
