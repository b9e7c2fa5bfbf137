#include "tandem/rpc_message/raw_message.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/unknown_field_set.h"

namespace tandem::rpc_message {

absl::Status ParseRequest(const grpc::ByteBuffer& src, google::protobuf::Message* dst) {
  dst->Clear();
  std::vector<grpc::Slice> slices;
  if (!src.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("the request's bytes cannot be read");
  }
  std::string bytes;
  bytes.reserve(src.Length());
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  const google::protobuf::Descriptor* type = dst->GetDescriptor();
  const absl::Status malformed = absl::InvalidArgumentError(
      absl::StrCat("the request is not a valid ", type->full_name(), " message"));
  // First the wire structure alone (no UTF-8 rule), to name a bad string field before the real
  // parse refuses it (which would also log a protobuf error per request).
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromString(bytes)) return malformed;
  for (int i = 0; i < fields.field_count(); ++i) {
    const google::protobuf::UnknownField& field = fields.field(i);
    if (field.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const google::protobuf::FieldDescriptor* known = type->FindFieldByNumber(field.number());
    if (known == nullptr || known->type() != google::protobuf::FieldDescriptor::TYPE_STRING) {
      continue;
    }
    // The check protobuf's parser applies to proto3 strings.
    if (!google::protobuf::internal::IsStructurallyValidUTF8(field.length_delimited())) {
      return absl::InvalidArgumentError(absl::StrCat(
          known->name(), " is not valid UTF-8 (proto3 strings must be)",
          known->name() == "prompt_text" ? "; send other bytes as token ids in prompt_ids" : ""));
    }
  }
  if (!dst->ParseFromString(bytes)) return malformed;
  return absl::OkStatus();
}

absl::Status SerializeReply(const google::protobuf::Message& src, grpc::ByteBuffer* dst) {
  dst->Clear();   // gRPC's writer serializes only into an empty buffer (a stream reuses one)
  bool own_buffer = false;
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(src, dst, &own_buffer);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot serialize ", src.GetTypeName(), ": ", status.error_message()));
  }
  return absl::OkStatus();
}

}  // namespace tandem::rpc_message
