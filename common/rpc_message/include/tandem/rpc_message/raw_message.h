// Request bytes -> message for raw-callback gRPC methods (the worker's Generate and Tokenize,
// every method of the CPU node). gRPC's generated handlers refuse bytes that do not parse
// before the service sees the call: a unary call gets UNIMPLEMENTED with no message, and a
// client stream's read just ends, so a stream of garbage looked like a clean half-close (OK).
// Parsing here instead answers INVALID_ARGUMENT saying what is wrong (naming a string field that
// is not UTF-8). The wire format is unchanged.
//
// Thread-safe (no state).
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "google/protobuf/message.h"

namespace tandem::rpc_message {

// Parses `src` into `dst` (cleared first). INVALID_ARGUMENT "<field> is not valid UTF-8 ..." for
// a top-level string field that protobuf's parser would refuse, "the request is not a valid
// <message type>" for bytes that do not parse at all.
absl::Status ParseRequest(const grpc::ByteBuffer& src, google::protobuf::Message* dst);

// Serializes `src` into `dst` (replacing what it held) for a raw method's reply or stream
// message. INTERNAL on failure.
absl::Status SerializeReply(const google::protobuf::Message& src, grpc::ByteBuffer* dst);

}  // namespace tandem::rpc_message
