#include "tandem/cpu_attention/grpc_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "request_executor.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"
#include "tandem/rpc_message/raw_message.h"

namespace tandem::cpu_attention {
namespace {

using rpc_message::ParseRequest;
using rpc_message::SerializeReply;

// Runs `work` on the executor and finishes the unary reactor with its status. A call the
// client already cancelled is finished as CANCELLED without running.
template <typename Work>
grpc::ServerUnaryReactor* RunUnary(RequestExecutor& executor,
                                   grpc::CallbackServerContext* context, Work work) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  executor.Submit([reactor, context, work = std::move(work)]() mutable {
    if (context->IsCancelled()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before it ran"));
      return;
    }
    reactor->Finish(ToGrpcStatus(work()));
  });
  return reactor;
}

// Finishes a reactor at once with `status` (a caller refused before any work).
template <typename Reactor>
Reactor* Refused(Reactor* reactor, const absl::Status& status) {
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// A unary method of the raw service: parses the request (INVALID_ARGUMENT at once for bytes that
// do not parse), runs `work(const Request&, Response*)` on the executor and serializes the
// Response into `response_bytes`.
template <typename Request, typename Response, typename Work>
grpc::ServerUnaryReactor* RunParsed(RequestExecutor& executor,
                                    grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request_bytes,
                                    grpc::ByteBuffer* response_bytes, Work work) {
  auto request = std::make_shared<Request>();
  if (absl::Status parsed = ParseRequest(*request_bytes, request.get()); !parsed.ok()) {
    return Refused(context->DefaultReactor(), parsed);
  }
  return RunUnary(executor, context,
                  [request, response_bytes, work = std::move(work)]() -> absl::Status {
                    Response response;
                    TANDEM_RETURN_IF_ERROR(work(*request, &response));
                    return SerializeReply(response, response_bytes);
                  });
}

// A reactor that only reports a refusal (a caller that failed authentication).
template <typename Base>
class RefusedReactor final : public Base {
 public:
  explicit RefusedReactor(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

// Reads the stream one message at a time: the next read starts only after the previous message
// was applied on the executor, which keeps the stream's order and bounds its memory to one
// message.
class CpuAttentionGrpcService::AppendKvReactor final
    : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  AppendKvReactor(CpuAttentionNode* node, RequestExecutor* executor,
                  grpc::ByteBuffer* response_bytes, std::string caller)
      : node_(node),
        executor_(executor),
        response_bytes_(response_bytes),
        caller_(std::move(caller)) {
    StartRead(&request_bytes_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke): report the totals
      Finish(ToGrpcStatus(SerializeReply(response_, response_bytes_)));
      return;
    }
    if (absl::Status parsed = ParseRequest(request_bytes_, &request_); !parsed.ok()) {
      FinishAt(parsed);
      return;
    }
    executor_->Submit([this] {
      absl::Status s = node_->AppendKv(request_, &response_, caller_);
      if (!s.ok()) {
        FinishAt(s);
        return;
      }
      StartRead(&request_bytes_);
    });
  }

  void OnDone() override { delete this; }

 private:
  // Ends the stream with `s`, naming the message it failed at (0-based, as response_ counts).
  void FinishAt(const absl::Status& s) {
    Finish(ToGrpcStatus(
        absl::Status(s.code(), absl::StrCat("message ", response_.messages(), ": ", s.message()))));
  }

  CpuAttentionNode* node_;
  RequestExecutor* executor_;
  grpc::ByteBuffer* response_bytes_;
  const std::string caller_;
  grpc::ByteBuffer request_bytes_;
  v1::AppendKvRequest request_;
  v1::AppendKvResponse response_;
};

// Streams the chunks of one export: each is read on the executor (under the session's shared
// lock only), then written; the next read starts when the write is done, so the stream holds
// one chunk at a time and a slow client does not hold the session's lock.
class CpuAttentionGrpcService::ExportShardReactor final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ExportShardReactor(CpuAttentionNode* node, RequestExecutor* executor,
                     grpc::CallbackServerContext* context, v1::ExportShardRequest request,
                     uint64_t max_chunk_bytes, std::string caller)
      : node_(node), executor_(executor), context_(context), request_(std::move(request)) {
    executor_->Submit([this, max_chunk_bytes, caller = std::move(caller)] {
      if (context_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before it ran"));
        return;
      }
      absl::StatusOr<ShardExport> started = node_->StartExport(request_, max_chunk_bytes, caller);
      if (!started.ok()) {
        Finish(ToGrpcStatus(started.status()));
        return;
      }
      export_.emplace(std::move(*started));
      WriteNext();
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {  // the stream broke (client gone or cancelled): nothing more can be sent
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ExportShard stream broken"));
      return;
    }
    executor_->Submit([this] { WriteNext(); });
  }

  void OnDone() override { delete this; }

 private:
  // On the executor: reads the next chunk and starts its write, or finishes the stream.
  void WriteNext() {
    if (export_->done()) {
      Finish(grpc::Status::OK);
      return;
    }
    if (context_->IsCancelled()) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    absl::Status s = export_->Next(&chunk_);
    if (s.ok()) s = SerializeReply(chunk_, &chunk_bytes_);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartWrite(&chunk_bytes_);
  }

  CpuAttentionNode* node_;
  RequestExecutor* executor_;
  grpc::CallbackServerContext* context_;
  const v1::ExportShardRequest request_;
  std::optional<ShardExport> export_;
  v1::ExportShardChunk chunk_;
  grpc::ByteBuffer chunk_bytes_;   // chunk_ serialized, being written
};

CpuAttentionGrpcService::CpuAttentionGrpcService(CpuAttentionNode* node, unsigned executor_threads,
                                                 uint64_t max_message_bytes,
                                                 security::Authenticator authenticator)
    : node_(node),
      authenticator_(std::move(authenticator)),
      // Room for the chunk's framing (first_entry, held, tensor shapes and tags).
      max_chunk_bytes_(std::min<uint64_t>(
          CpuAttentionNode::kMaxExportChunkBytes,
          max_message_bytes > (64u << 10) ? max_message_bytes - (64u << 10) : 1)),
      executor_(std::make_unique<RequestExecutor>(executor_threads)) {}

CpuAttentionGrpcService::~CpuAttentionGrpcService() = default;

grpc::ServerUnaryReactor* CpuAttentionGrpcService::OpenSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::OpenSessionRequest, v1::OpenSessionResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->OpenSession(r, out, caller);
      });
}

grpc::ServerReadReactor<grpc::ByteBuffer>* CpuAttentionGrpcService::AppendKv(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerReadReactor<grpc::ByteBuffer>>(caller.status());
  }
  return new AppendKvReactor(node_, executor_.get(), response, *std::move(caller));
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Attend(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::AttendRequest, v1::AttendResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->Attend(r, out, caller);
      });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Reselect(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::ReselectRequest, v1::ReselectResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->Reselect(r, out, caller);
      });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::CloseSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->CloseSession(r, out, caller);
      });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::RenewLease(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::RenewLeaseRequest, v1::RenewLeaseResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->RenewLease(r, out, caller);
      });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Stats(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  // Stats only reads counters: answered inline on the gRPC thread.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(reactor, caller.status());
  v1::StatsRequest parsed;
  if (absl::Status s = ParseRequest(*request, &parsed); !s.ok()) return Refused(reactor, s);
  reactor->Finish(ToGrpcStatus(SerializeReply(node_->Stats(), response)));
  return reactor;
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::ReshardSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunParsed<v1::ReshardSessionRequest, v1::ReshardSessionResponse>(
      *executor_, context, request, response,
      [this, caller = *std::move(caller)](const auto& r, auto* out) {
        return node_->ReshardSession(r, out, caller);
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* CpuAttentionGrpcService::ExportShard(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  using Refusal = RefusedReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>>;
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return new Refusal(caller.status());
  v1::ExportShardRequest parsed;
  if (absl::Status s = ParseRequest(*request, &parsed); !s.ok()) return new Refusal(s);
  return new ExportShardReactor(node_, executor_.get(), context, std::move(parsed),
                                max_chunk_bytes_, *std::move(caller));
}

}  // namespace tandem::cpu_attention
