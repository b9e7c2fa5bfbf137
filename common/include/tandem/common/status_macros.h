// Status propagation helpers. Debian 12's abseil has no ABSL_RETURN_IF_ERROR, so tandem defines
// its own once, here.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TANDEM_STATUS_CONCAT_INNER_(a, b) a##b
#define TANDEM_STATUS_CONCAT_(a, b) TANDEM_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define TANDEM_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status tandem_status_ = (expr);          \
    if (!tandem_status_.ok()) return tandem_status_; \
  } while (0)

// `lhs = value of rexpr` where rexpr is an absl::StatusOr<T>; returns its status if not OK.
// lhs may declare a variable: TANDEM_ASSIGN_OR_RETURN(auto x, MakeX());
#define TANDEM_ASSIGN_OR_RETURN(lhs, rexpr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL_(TANDEM_STATUS_CONCAT_(tandem_statusor_, __LINE__), lhs, rexpr)

#define TANDEM_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()
