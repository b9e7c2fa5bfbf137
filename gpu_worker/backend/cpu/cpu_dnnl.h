// oneDNN error handling for the cpu backend (private to backend/cpu).
#pragma once

#include <dnnl.hpp>
#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

// Runs the statement (oneDNN calls) in a function returning absl::Status; a dnnl::error or any
// other exception becomes INTERNAL naming the statement, file and line, so no exception leaves
// the backend.
#define TANDEM_CPU_DNNL_CALL(...)                                                                 \
  do {                                                                                            \
    try {                                                                                         \
      __VA_ARGS__;                                                                                \
    } catch (const ::dnnl::error& tandem_dnnl_e_) {                                               \
      return ::absl::InternalError(::absl::StrFormat(                                             \
          "oneDNN call `%s` failed at %s:%d: %s (dnnl_status_t %d)", #__VA_ARGS__, __FILE__,      \
          __LINE__, tandem_dnnl_e_.what(), static_cast<int>(tandem_dnnl_e_.status)));             \
    } catch (const std::exception& tandem_dnnl_e_) {                                              \
      return ::absl::InternalError(::absl::StrFormat("`%s` failed at %s:%d: %s", #__VA_ARGS__,    \
                                                     __FILE__, __LINE__, tandem_dnnl_e_.what())); \
    }                                                                                             \
  } while (0)

// Checks a dnnl_status_t returned by a C API call (dnnl_sgemm) the same way.
#define TANDEM_CPU_DNNL_STATUS(expr)                                                       \
  do {                                                                                     \
    const dnnl_status_t tandem_dnnl_s_ = (expr);                                           \
    if (tandem_dnnl_s_ != dnnl_success) {                                                  \
      return ::absl::InternalError(                                                        \
          ::absl::StrFormat("oneDNN call `%s` failed at %s:%d: "                           \
                            "dnnl_status_t %d",                                            \
                            #expr, __FILE__, __LINE__, static_cast<int>(tandem_dnnl_s_))); \
    }                                                                                      \
  } while (0)
