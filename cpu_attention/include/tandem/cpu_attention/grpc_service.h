// The gRPC face of a CpuAttentionNode: tandem.v1.CpuAttention on the callback API. Handlers
// hand the work to a RequestExecutor and finish their reactor from there, so no gRPC thread
// blocks on attention. Every failure becomes a grpc::Status with the node's message.
#pragma once

#include <memory>

#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {

class RequestExecutor;

class CpuAttentionGrpcService final : public v1::CpuAttention::CallbackService {
 public:
  // `node` must outlive the service. executor_threads >= 1.
  CpuAttentionGrpcService(CpuAttentionNode* node, unsigned executor_threads);
  ~CpuAttentionGrpcService() override;

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionResponse* response) override;
  grpc::ServerReadReactor<v1::AppendKvRequest>* AppendKv(
      grpc::CallbackServerContext* context, v1::AppendKvResponse* response) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* Reselect(grpc::CallbackServerContext* context,
                                     const v1::ReselectRequest* request,
                                     v1::ReselectResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;

 private:
  class AppendKvReactor;

  CpuAttentionNode* node_;
  std::unique_ptr<RequestExecutor> executor_;
};

}  // namespace tandem::cpu_attention
