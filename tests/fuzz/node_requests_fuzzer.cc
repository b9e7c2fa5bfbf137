// Fuzzes the CPU attention node's request handlers (CpuAttentionNode, the code behind both the
// gRPC service and the in-process node; node_requests.h validates every field) with one request
// against a small live session (node_fuzz_util.h).
//
// Input: byte 0 picks the base session's kind, byte 1 the method, the rest is that method's
// request message (protobuf wire format). Every call must return (a refusal names what is wrong);
// an Attend answer must hold as many bytes as its shapes say; afterwards all sessions are closed
// and the pool must be empty.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "node_fuzz_util.h"

namespace ca = tandem::cpu_attention;
namespace v1 = tandem::v1;

namespace {

enum Method : uint8_t {
  kOpenSession,
  kAppendKv,
  kAttend,
  kReselect,
  kReshard,
  kExport,
  kClose,
  kNumMethods
};

void CheckTensor(const v1::Tensor& t, const std::string& what) {
  int64_t elements = 1;
  for (int64_t d : t.shape()) {
    FUZZ_CHECK(d >= 0, what);
    elements *= d;
  }
  FUZZ_CHECK(t.data().size() == static_cast<size_t>(elements) * ca::DTypeSize(t.dtype()),
             absl::StrCat(what, ": ", t.data().size(), " bytes for ", elements, " elements"));
}

void CheckRefusal(const absl::Status& status) {
  FUZZ_CHECK(!status.message().empty(), absl::StrCat("refusal without a message: ", status.code()));
}

// Runs one request; returns the id of a session it may have opened ("" if none).
std::string Run(ca::CpuAttentionNode& node, Method method, const uint8_t* data, size_t size) {
  switch (method) {
    case kOpenSession: {
      v1::OpenSessionRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::OpenSessionResponse response;
      const absl::Status status = node.OpenSession(request, &response);
      if (!status.ok()) CheckRefusal(status);
      return request.session_id();
    }
    case kAppendKv: {
      v1::AppendKvRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::AppendKvResponse totals;
      const absl::Status status = node.AppendKv(request, &totals);
      if (!status.ok()) CheckRefusal(status);
      return "";
    }
    case kAttend: {
      v1::AttendRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::AttendResponse response;
      const absl::Status status = node.Attend(request, &response);
      if (!status.ok()) {
        CheckRefusal(status);
        return "";
      }
      FUZZ_CHECK(response.results_size() == request.queries_size(), "one result per query");
      for (const v1::AttendResult& r : response.results()) {
        CheckTensor(r.o(), "o");
        CheckTensor(r.lse(), "lse");
        FUZZ_CHECK(r.selected_size() == r.kv_heads_size() && r.held_size() == r.kv_heads_size(),
                   "per-head counters");
      }
      return "";
    }
    case kReselect: {
      v1::ReselectRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::ReselectResponse response;
      const absl::Status status = node.Reselect(request, &response);
      if (!status.ok()) CheckRefusal(status);
      return "";
    }
    case kReshard: {
      v1::ReshardSessionRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::ReshardSessionResponse response;
      const absl::Status status = node.ReshardSession(request, &response);
      if (!status.ok()) CheckRefusal(status);
      return "";
    }
    case kExport: {
      v1::ExportShardRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      const absl::Status status = node.ExportShard(
          request,
          [](const v1::ExportShardChunk& chunk) {
            CheckTensor(chunk.k(), "k");
            CheckTensor(chunk.v(), "v");
            CheckTensor(chunk.maw(), "maw");
            FUZZ_CHECK(chunk.selected().size() == chunk.num_entries(), "selected flags");
            return absl::OkStatus();
          },
          /*max_chunk_bytes=*/4096);
      if (!status.ok()) CheckRefusal(status);
      return "";
    }
    case kClose: {
      v1::CloseSessionRequest request;
      if (!request.ParseFromArray(data, static_cast<int>(size))) return "";
      v1::CloseSessionResponse response;
      const absl::Status status = node.CloseSession(request, &response);
      if (!status.ok()) CheckRefusal(status);
      return "";
    }
    case kNumMethods:
      break;
  }
  return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ca::CpuAttentionNode* node = ca::fuzz::MakeNode().release();  // lives for the process
  if (size < 2) return 0;
  const auto kind = static_cast<ca::fuzz::BaseKind>(data[0] % 3);
  const auto method = static_cast<Method>(data[1] % kNumMethods);
  ca::fuzz::OpenBase(*node, kind);
  const std::string opened = Run(*node, method, data + 2, size - 2);
  ca::fuzz::Close(*node, ca::fuzz::kSessionId);
  if (!opened.empty()) ca::fuzz::Close(*node, opened);
  ca::fuzz::CheckEmpty(*node);
  return 0;
}
