// The x86-64 instruction sets tandem's hand-written CPU kernels are built for, and the one a
// process uses. Every kernel family (the node's bf16/f32/int8 scans, the softmax steps, the cpu
// backend's bf16 GEMM) asks ActiveCpuIsa() which of its variants to run, so one environment
// variable forces all of them at once:
//
//   TANDEM_CPU_ISA=portable|avx2|avx512   use at most this set (a cap: a CPU without it keeps
//                                         its own best; unset = this CPU's best)
//
// oneDNN has its own cap, DNNL_MAX_CPU_ISA, read once when oneDNN first runs: a process started
// with TANDEM_CPU_ISA below its CPU's best sets it to match (at load, unless it is set), so an
// AVX-512 host then behaves as an AVX2-only one, oneDNN's missing bf16 matmul included (the
// forced-path tests, cmake/TandemHelpers.cmake ISA_PATHS). The library code never calls exit or
// abort for a bad value: an unknown TANDEM_CPU_ISA is reported by CheckCpuIsaEnvironment() and
// otherwise ignored.
//
// Thread-safe. NativeCpuIsa() is detected once; ActiveCpuIsa() reads the variable at every call
// (tests change it between cases), a getenv of a few hundred nanoseconds: call it per request or
// per task list, not per row.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem {

// Ordered: a larger value is a superset.
enum class CpuIsa : int {
  kPortable = 0,  // baseline x86-64 (SSE2), or any non-x86 CPU: plain C++ loops
  kAvx2 = 1,      // AVX2 + FMA + F16C (x86-64-v3: Haswell, AMD Zen 1-3 and later)
  kAvx512 = 2,    // AVX-512 F/BW/DQ/VL (x86-64-v4: Skylake-SP, Zen 4 and later)
};

// "portable", "avx2" or "avx512".
const char* CpuIsaName(CpuIsa isa);

// INVALID_ARGUMENT naming the accepted values for anything else.
absl::StatusOr<CpuIsa> ParseCpuIsa(std::string_view name);

// The best set this CPU runs.
CpuIsa NativeCpuIsa();

// min(NativeCpuIsa(), TANDEM_CPU_ISA) when the variable names a set; else NativeCpuIsa().
CpuIsa ActiveCpuIsa();

// True when TANDEM_CPU_ISA caps the kernels below what this CPU runs.
bool CpuIsaForcedBelowNative();

// INVALID_ARGUMENT when TANDEM_CPU_ISA is set to an unknown value (processes check it at start
// and refuse to run with a typo that would silently test the wrong path).
absl::Status CheckCpuIsaEnvironment();

// One line for start-up logs: "CPU kernels: avx2 (this CPU: avx2; TANDEM_CPU_ISA unset)".
std::string CpuIsaSummary();

}  // namespace tandem
