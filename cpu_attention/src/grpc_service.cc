#include "tandem/cpu_attention/grpc_service.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "request_executor.h"
#include "tandem/common/grpc_status.h"

namespace tandem::cpu_attention {
namespace {

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
    : public grpc::ServerReadReactor<v1::AppendKvRequest> {
 public:
  AppendKvReactor(CpuAttentionNode* node, RequestExecutor* executor,
                  v1::AppendKvResponse* response, std::string caller)
      : node_(node), executor_(executor), response_(response), caller_(std::move(caller)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke): report the totals
      Finish(grpc::Status::OK);
      return;
    }
    executor_->Submit([this] {
      absl::Status s = node_->AppendKv(request_, response_, caller_);
      if (!s.ok()) {
        Finish(ToGrpcStatus(absl::Status(
            s.code(), absl::StrCat("message ", response_->messages(), ": ", s.message()))));
        return;
      }
      StartRead(&request_);
    });
  }

  void OnDone() override { delete this; }

 private:
  CpuAttentionNode* node_;
  RequestExecutor* executor_;
  v1::AppendKvResponse* response_;
  const std::string caller_;
  v1::AppendKvRequest request_;
};

// Streams the chunks of one export: each is read on the executor (under the session's shared
// lock only), then written; the next read starts when the write is done, so the stream holds
// one chunk at a time and a slow client does not hold the session's lock.
class CpuAttentionGrpcService::ExportShardReactor final
    : public grpc::ServerWriteReactor<v1::ExportShardChunk> {
 public:
  ExportShardReactor(CpuAttentionNode* node, RequestExecutor* executor,
                     grpc::CallbackServerContext* context, const v1::ExportShardRequest* request,
                     uint64_t max_chunk_bytes, std::string caller)
      : node_(node), executor_(executor), context_(context) {
    executor_->Submit([this, request, max_chunk_bytes, caller = std::move(caller)] {
      if (context_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before it ran"));
        return;
      }
      absl::StatusOr<ShardExport> started = node_->StartExport(*request, max_chunk_bytes, caller);
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
    const absl::Status s = export_->Next(&chunk_);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartWrite(&chunk_);
  }

  CpuAttentionNode* node_;
  RequestExecutor* executor_;
  grpc::CallbackServerContext* context_;
  std::optional<ShardExport> export_;
  v1::ExportShardChunk chunk_;
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
    grpc::CallbackServerContext* context, const v1::OpenSessionRequest* request,
    v1::OpenSessionResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunUnary(*executor_, context, [this, request, response, caller = *std::move(caller)] {
    return node_->OpenSession(*request, response, caller);
  });
}

grpc::ServerReadReactor<v1::AppendKvRequest>* CpuAttentionGrpcService::AppendKv(
    grpc::CallbackServerContext* context, v1::AppendKvResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerReadReactor<v1::AppendKvRequest>>(caller.status());
  }
  return new AppendKvReactor(node_, executor_.get(), response, *std::move(caller));
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Attend(grpc::CallbackServerContext* context,
                                                          const v1::AttendRequest* request,
                                                          v1::AttendResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunUnary(*executor_, context, [this, request, response, caller = *std::move(caller)] {
    return node_->Attend(*request, response, caller);
  });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Reselect(
    grpc::CallbackServerContext* context, const v1::ReselectRequest* request,
    v1::ReselectResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunUnary(*executor_, context, [this, request, response, caller = *std::move(caller)] {
    return node_->Reselect(*request, response, caller);
  });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::CloseSession(
    grpc::CallbackServerContext* context, const v1::CloseSessionRequest* request,
    v1::CloseSessionResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunUnary(*executor_, context, [this, request, response, caller = *std::move(caller)] {
    return node_->CloseSession(*request, response, caller);
  });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Stats(grpc::CallbackServerContext* context,
                                                         const v1::StatsRequest* request,
                                                         v1::StatsResponse* response) {
  // Stats only reads counters: answered inline on the gRPC thread.
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  *response = node_->Stats();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::ReshardSession(
    grpc::CallbackServerContext* context, const v1::ReshardSessionRequest* request,
    v1::ReshardSessionResponse* response) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) return Refused(context->DefaultReactor(), caller.status());
  return RunUnary(*executor_, context, [this, request, response, caller = *std::move(caller)] {
    return node_->ReshardSession(*request, response, caller);
  });
}

grpc::ServerWriteReactor<v1::ExportShardChunk>* CpuAttentionGrpcService::ExportShard(
    grpc::CallbackServerContext* context, const v1::ExportShardRequest* request) {
  absl::StatusOr<std::string> caller = authenticator_.Authenticate(*context);
  if (!caller.ok()) {
    return new RefusedReactor<grpc::ServerWriteReactor<v1::ExportShardChunk>>(caller.status());
  }
  return new ExportShardReactor(node_, executor_.get(), context, request, max_chunk_bytes_,
                                *std::move(caller));
}

}  // namespace tandem::cpu_attention
