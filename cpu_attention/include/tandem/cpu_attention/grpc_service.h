// The gRPC face of a CpuAttentionNode: tandem.v1.CpuAttention on the callback API. Handlers
// hand the work to a RequestExecutor and finish their reactor from there, so no gRPC thread
// blocks on attention. Every failure becomes a grpc::Status with the node's message.
// ExportShard reads each chunk on the executor and writes it before reading the next, so a
// stream holds one chunk in memory and the session's lock only while a chunk is read.
// Every method but the health service (separate, open) first authenticates its caller
// (security::Authenticator: with --allowed_peers only those certificate identities pass,
// PERMISSION_DENIED otherwise) and passes the principal to the node, which keys session
// ownership by it.
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/security/authenticator.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {

class RequestExecutor;

class CpuAttentionGrpcService final : public v1::CpuAttention::CallbackService {
 public:
  // `node` must outlive the service. executor_threads >= 1. `max_message_bytes` is the server's
  // send limit: ExportShard chunks stay below it (and below 16 MiB). `authenticator` decides
  // who may call (default: everyone, as security::kAnonymous).
  CpuAttentionGrpcService(CpuAttentionNode* node, unsigned executor_threads,
                          uint64_t max_message_bytes = 64 << 20,
                          security::Authenticator authenticator = {});
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
  grpc::ServerUnaryReactor* ReshardSession(grpc::CallbackServerContext* context,
                                           const v1::ReshardSessionRequest* request,
                                           v1::ReshardSessionResponse* response) override;
  grpc::ServerWriteReactor<v1::ExportShardChunk>* ExportShard(
      grpc::CallbackServerContext* context, const v1::ExportShardRequest* request) override;

 private:
  class AppendKvReactor;
  class ExportShardReactor;

  CpuAttentionNode* node_;
  const security::Authenticator authenticator_;
  uint64_t max_chunk_bytes_;
  std::unique_ptr<RequestExecutor> executor_;
};

}  // namespace tandem::cpu_attention
