#include "tandem/cpu_isa/cpu_isa.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

constexpr const char* kEnvVar = "TANDEM_CPU_ISA";

CpuIsa DetectNative() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kPortable;
}

// oneDNN's name of the same cap (its DNNL_MAX_CPU_ISA values).
const char* OneDnnIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "AVX512_CORE_AMX";
    case CpuIsa::kAvx2:
      return "AVX2";
    case CpuIsa::kPortable:
      break;
  }
  return "SSE41";
}

// At load, before main: a process started with TANDEM_CPU_ISA below its CPU's best caps oneDNN
// the same way (DNNL_MAX_CPU_ISA, which oneDNN reads at its first primitive), unless that is set
// already, so the JIT kernels oneDNN picks match the forced path (an AVX-512 host then creates
// no bf16 matmul, as an AVX2-only host does). Changing TANDEM_CPU_ISA later in the process
// changes tandem's kernels only.
[[maybe_unused]] const bool kOneDnnCapped = [] {
  const char* value = std::getenv(kEnvVar);
  if (value == nullptr || std::getenv("DNNL_MAX_CPU_ISA") != nullptr) return false;
  const absl::StatusOr<CpuIsa> cap = ParseCpuIsa(value);
  if (!cap.ok() || *cap >= DetectNative()) return false;
  return setenv("DNNL_MAX_CPU_ISA", OneDnnIsaName(*cap), 0) == 0;
}();

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kPortable:
      break;
  }
  return "portable";
}

absl::StatusOr<CpuIsa> ParseCpuIsa(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(std::string(name));
  if (lower == "portable") return CpuIsa::kPortable;
  if (lower == "avx2") return CpuIsa::kAvx2;
  if (lower == "avx512") return CpuIsa::kAvx512;
  return absl::InvalidArgumentError(absl::StrCat(
      kEnvVar, "='", std::string(name), "' is not an instruction set: use portable, avx2 or avx512"));
}

CpuIsa NativeCpuIsa() {
  static const CpuIsa native = DetectNative();
  return native;
}

CpuIsa ActiveCpuIsa() {
  const CpuIsa native = NativeCpuIsa();
  const char* value = std::getenv(kEnvVar);
  if (value == nullptr || *value == '\0') return native;
  const absl::StatusOr<CpuIsa> cap = ParseCpuIsa(value);
  if (!cap.ok()) return native;
  return std::min(native, *cap);
}

bool CpuIsaForcedBelowNative() { return ActiveCpuIsa() < NativeCpuIsa(); }

absl::Status CheckCpuIsaEnvironment() {
  const char* value = std::getenv(kEnvVar);
  if (value == nullptr || *value == '\0') return absl::OkStatus();
  return ParseCpuIsa(value).status();
}

std::string CpuIsaSummary() {
  const char* value = std::getenv(kEnvVar);
  return absl::StrCat("CPU kernels: ", CpuIsaName(ActiveCpuIsa()),
                      " (this CPU: ", CpuIsaName(NativeCpuIsa()), "; ", kEnvVar, " ",
                      value == nullptr ? std::string("unset") : absl::StrCat("= ", value), ")");
}

}  // namespace tandem
