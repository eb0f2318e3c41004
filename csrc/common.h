// Shared error handling and small utilities for the sapwood runtime.
#pragma once
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace sapwood {

// Bad input from the caller: becomes a Python ValueError naming the offending value.
struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Out of KV pages or context: becomes a Python MemoryError-like RuntimeError subclass.
struct CapacityError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

#define SW_CHECK(cond, ...) \
  do { if (!(cond)) throw ::sapwood::InputError(::sapwood::cat(__VA_ARGS__)); } while (0)

}  // namespace sapwood
