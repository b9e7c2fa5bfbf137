// Sets TANDEM_CPU_ISA (tandem/cpu_isa/cpu_isa.h) for a scope and restores the value it had
// before (ctest runs the kernel tests once more under each forced set, so "unset" is not
// necessarily the value to go back to). An empty variant unsets it: the CPU's own best, capped by
// nothing. Tests only; not thread-safe (setenv).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace tandem::testing {

class ScopedCpuIsa {
 public:
  explicit ScopedCpuIsa(const char* variant) {
    if (const char* old = std::getenv(kVar); old != nullptr) saved_ = old;
    if (variant == nullptr || *variant == '\0') {
      unsetenv(kVar);
    } else {
      setenv(kVar, variant, 1);
    }
  }
  ~ScopedCpuIsa() {
    if (saved_.has_value()) {
      setenv(kVar, saved_->c_str(), 1);
    } else {
      unsetenv(kVar);
    }
  }
  ScopedCpuIsa(const ScopedCpuIsa&) = delete;
  ScopedCpuIsa& operator=(const ScopedCpuIsa&) = delete;

 private:
  static constexpr const char* kVar = "TANDEM_CPU_ISA";
  std::optional<std::string> saved_;
};

}  // namespace tandem::testing
