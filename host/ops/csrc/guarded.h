// The C ABI's error convention, shared by shim.cpp and cuda_graph.cpp:
// a function returns null on success or a malloc'd message (freed by the
// Rust side through the library's own free function).
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>

namespace hearth_abi {

inline char *message(const char *what) {
  return strdup(what && *what ? what : "a C++ error with no message");
}

// Runs `f`, turning any C++ exception into its message.
template <typename F> char *guarded(F &&f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception &e) {
    return message(e.what());
  } catch (...) {
    return message(nullptr);
  }
}

}  // namespace hearth_abi
