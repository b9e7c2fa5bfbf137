// Small helpers of every call the worker makes to a CPU node (node links, RemoteKv, the shard
// migrator): the wire dtype, per-call deadlines, and errors that name the node.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tandem/common/grpc_status.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/v1/common.pb.h"

namespace tandem::gpu_worker {

inline v1::DType WireType(DType dtype) {
  return dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32;
}

inline void SetDeadline(grpc::ClientContext& ctx, int ms) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

// "CPU node ADDRESS: WHAT: message", with the status's code.
inline absl::Status NodeError(const std::string& address, const char* what,
                              const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat("CPU node ", address, ": ", what, ": ", status.message()));
}
inline absl::Status NodeError(const std::string& address, const char* what,
                              const grpc::Status& status) {
  return NodeError(address, what, FromGrpcStatus(status));
}

// Whether a failed call says the node itself is unwell (gone, unreachable, too slow, answering
// garbage), as opposed to refusing this request (NOT_FOUND after a restart, a full pool, a bad
// argument): such a node is taken out of placement until it answers again.
inline bool IsNodeFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

}  // namespace tandem::gpu_worker
