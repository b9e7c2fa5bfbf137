// What makes a SessionLease valid (cpu_attention.proto, "Leases"): the node checks every lease
// it is sent with CheckSessionLease, and a worker checks the lease it will send before it opens
// anything, so both hold one rule.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention {

inline constexpr uint32_t kMinLeasePeriodMs = 100;
inline constexpr uint32_t kMaxLeasePeriodMs = 3600 * 1000;

// INVALID_ARGUMENT naming the field for a malformed lease: a holder that is not 1..128 of
// [A-Za-z0-9._:-], incarnation 0, or period_ms outside kMinLeasePeriodMs..kMaxLeasePeriodMs.
absl::Status CheckSessionLease(const v1::SessionLease& lease);

}  // namespace tandem::cpu_attention
