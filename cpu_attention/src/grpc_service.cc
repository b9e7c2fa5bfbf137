#include "tandem/cpu_attention/grpc_service.h"

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

}  // namespace

// Reads the stream one message at a time: the next read starts only after the previous message
// was applied on the executor, which keeps the stream's order and bounds its memory to one
// message.
class CpuAttentionGrpcService::AppendKvReactor final
    : public grpc::ServerReadReactor<v1::AppendKvRequest> {
 public:
  AppendKvReactor(CpuAttentionNode* node, RequestExecutor* executor,
                  v1::AppendKvResponse* response)
      : node_(node), executor_(executor), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke): report the totals
      Finish(grpc::Status::OK);
      return;
    }
    executor_->Submit([this] {
      absl::Status s = node_->AppendKv(request_, response_);
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
  v1::AppendKvRequest request_;
};

CpuAttentionGrpcService::CpuAttentionGrpcService(CpuAttentionNode* node,
                                                 unsigned executor_threads)
    : node_(node), executor_(std::make_unique<RequestExecutor>(executor_threads)) {}

CpuAttentionGrpcService::~CpuAttentionGrpcService() = default;

grpc::ServerUnaryReactor* CpuAttentionGrpcService::OpenSession(
    grpc::CallbackServerContext* context, const v1::OpenSessionRequest* request,
    v1::OpenSessionResponse* response) {
  return RunUnary(*executor_, context,
                  [this, request, response] { return node_->OpenSession(*request, response); });
}

grpc::ServerReadReactor<v1::AppendKvRequest>* CpuAttentionGrpcService::AppendKv(
    grpc::CallbackServerContext* context, v1::AppendKvResponse* response) {
  return new AppendKvReactor(node_, executor_.get(), response);
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Attend(grpc::CallbackServerContext* context,
                                                          const v1::AttendRequest* request,
                                                          v1::AttendResponse* response) {
  return RunUnary(*executor_, context,
                  [this, request, response] { return node_->Attend(*request, response); });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Reselect(
    grpc::CallbackServerContext* context, const v1::ReselectRequest* request,
    v1::ReselectResponse* response) {
  return RunUnary(*executor_, context,
                  [this, request, response] { return node_->Reselect(*request, response); });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::CloseSession(
    grpc::CallbackServerContext* context, const v1::CloseSessionRequest* request,
    v1::CloseSessionResponse* response) {
  return RunUnary(*executor_, context, [this, request, response] {
    return node_->CloseSession(*request, response);
  });
}

grpc::ServerUnaryReactor* CpuAttentionGrpcService::Stats(grpc::CallbackServerContext* context,
                                                         const v1::StatsRequest* request,
                                                         v1::StatsResponse* response) {
  // Stats only reads counters: answered inline on the gRPC thread.
  *response = node_->Stats();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace tandem::cpu_attention
