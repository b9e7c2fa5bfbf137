// oneDNN error handling for every tandem library that calls oneDNN (cpu_attention, the cpu
// backend). Include only where DNNL::dnnl is linked.
//
// A failure becomes an absl::Status that says what tandem was doing (`context`: the operation with
// its shapes and data types, built only on failure), oneDNN's own message and status, and for
// an unimplemented primitive what it means; never the source text of the call.
#pragma once

#include <dnnl.hpp>
#include <exception>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem {

inline absl::Status DnnlStatusToStatus(const std::string& what, dnnl_status_t status,
                                       const char* message) {
  std::string text = absl::StrCat(what, ": oneDNN failed (", message, ", dnnl_status_t ",
                                  static_cast<int>(status), ")");
  if (status == dnnl_unimplemented) {
    absl::StrAppend(&text,
                    "; oneDNN has no kernel for these data types on this CPU (e.g. bf16 needs "
                    "AVX-512 in oneDNN 2.6, or DNNL_MAX_CPU_ISA caps it): this is a tandem bug "
                    "if it reaches you, please report it with the output of lscpu");
    return absl::UnimplementedError(text);
  }
  if (status == dnnl_out_of_memory) return absl::ResourceExhaustedError(text);
  return absl::InternalError(text);
}

// Whether oneDNN creates a bf16 · bf16 -> f32 matmul on this CPU (oneDNN 2.6: AVX-512 only, and
// not under DNNL_MAX_CPU_ISA=AVX2). Probed once, by creating one; thread-safe.
inline bool OneDnnHasBf16Matmul() {
  static const bool available = [] {
    try {
      using dt = dnnl::memory::data_type;
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const dnnl::memory::desc src({16, 64}, dt::bf16, {64, 1});
      const dnnl::memory::desc wei({64, 8}, dt::bf16, {1, 64});
      const dnnl::memory::desc dst({16, 8}, dt::f32, {8, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), engine);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return available;
}

}  // namespace tandem

// Runs the statement(s) in a function returning absl::Status; a dnnl::error or any other
// exception returns a status built from `context` (a string expression, evaluated on failure only).
// No exception leaves the caller.
#define TANDEM_DNNL_CALL(context, ...)                                                           \
  do {                                                                                        \
    try {                                                                                     \
      __VA_ARGS__;                                                                            \
    } catch (const ::dnnl::error& tandem_dnnl_e_) {                                           \
      return ::tandem::DnnlStatusToStatus((context), tandem_dnnl_e_.status, tandem_dnnl_e_.what()); \
    } catch (const std::exception& tandem_dnnl_e_) {                                          \
      return ::absl::InternalError(::absl::StrCat((context), ": ", tandem_dnnl_e_.what()));      \
    }                                                                                         \
  } while (0)

// Checks a dnnl_status_t returned by a C API call (dnnl_sgemm) the same way.
#define TANDEM_DNNL_STATUS(context, expr)                                                 \
  do {                                                                                 \
    const dnnl_status_t tandem_dnnl_s_ = (expr);                                       \
    if (tandem_dnnl_s_ != dnnl_success) {                                              \
      return ::tandem::DnnlStatusToStatus((context), tandem_dnnl_s_, "C API call failed"); \
    }                                                                                  \
  } while (0)
