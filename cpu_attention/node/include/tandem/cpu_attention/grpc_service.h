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

// Every method is raw (request bytes in, reply bytes out) and parses its request with
// rpc_message::ParseRequest: bytes that do not parse are INVALID_ARGUMENT with a message on
// every method (gRPC's generated handlers answered UNIMPLEMENTED with none, and a garbage
// AppendKv message ended the stream as if the client had half-closed: OK). The wire format is
// tandem.v1.CpuAttention's, unchanged for clients.
using RawCpuAttentionService = v1::CpuAttention::WithRawCallbackMethod_OpenSession<
    v1::CpuAttention::WithRawCallbackMethod_AppendKv<
        v1::CpuAttention::WithRawCallbackMethod_Attend<
            v1::CpuAttention::WithRawCallbackMethod_Reselect<
                v1::CpuAttention::WithRawCallbackMethod_CloseSession<
                    v1::CpuAttention::WithRawCallbackMethod_Stats<
                        v1::CpuAttention::WithRawCallbackMethod_ReshardSession<
                            v1::CpuAttention::WithRawCallbackMethod_ExportShard<
                                v1::CpuAttention::WithRawCallbackMethod_RenewLease<
                                    v1::CpuAttention::CallbackService>>>>>>>>>;

class CpuAttentionGrpcService final : public RawCpuAttentionService {
 public:
  // `node` must outlive the service. executor_threads >= 1. `max_message_bytes` is the server's
  // send limit: ExportShard chunks stay below it (and below 16 MiB). `authenticator` decides
  // who may call (default: everyone, as security::kAnonymous).
  CpuAttentionGrpcService(CpuAttentionNode* node, unsigned executor_threads,
                          uint64_t max_message_bytes = 64 << 20,
                          security::Authenticator authenticator = {});
  ~CpuAttentionGrpcService() override;

  // Requests and replies: serialized tandem.v1 messages of the method's types.
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* AppendKv(grpc::CallbackServerContext* context,
                                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Reselect(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReshardSession(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ExportShard(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

 private:
  class AppendKvReactor;
  class ExportShardReactor;

  CpuAttentionNode* node_;
  const security::Authenticator authenticator_;
  uint64_t max_chunk_bytes_;
  std::unique_ptr<RequestExecutor> executor_;
};

}  // namespace tandem::cpu_attention
