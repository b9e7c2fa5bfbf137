// Request bytes -> message for the Generation service's raw-callback methods (Generate and
// Tokenize, the ones that carry free text). gRPC's generated handlers refuse a proto3 string
// that is not UTF-8 before the service sees the call, answering UNIMPLEMENTED with no message;
// parsing here instead answers INVALID_ARGUMENT naming the field. The wire format is unchanged.
//
// Thread-safe (no state).
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "google/protobuf/message.h"

namespace tandem::gpu_worker {

// Parses `src` into `dst` (cleared first). INVALID_ARGUMENT "<field> is not valid UTF-8 ..." for
// a top-level string field that protobuf's parser would refuse, "the request is not a valid
// <message type>" for bytes that do not parse at all.
absl::Status ParseRequest(const grpc::ByteBuffer& src, google::protobuf::Message* dst);

// Serializes `src` into `dst` for a raw method's reply or stream message. INTERNAL on failure.
absl::Status SerializeReply(const google::protobuf::Message& src, grpc::ByteBuffer* dst);

}  // namespace tandem::gpu_worker
