// The gRPC face of the Engine: tandem.v1.Generation (proto/tandem/v1/generation.proto) on the
// callback API. Every handler validates its request on the gRPC thread, posts one job to the
// EngineExecutor and returns; the job finishes the call. No reactor blocks and the executor
// never waits on the network: Generate's job queues its stream messages and the reactor writes
// them one at a time as the client takes them.
//
// Also the proto <-> engine conversions, shared with the `tandem` CLI (which runs the same
// requests on an in-process Engine).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/engine_executor.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gpu_worker {

// Most tokens one request may ask for, whatever the context.
inline constexpr int64_t kMaxRequestTokens = int64_t{1} << 20;
inline constexpr int kMaxRequestStops = 16;
inline constexpr size_t kMaxRequestStopBytes = 256;
inline constexpr float kMaxRequestTemperature = 100.0f;

// Checks what the engine does not (ranges of the sampling and tandem fields, a non-empty
// prompt, max_tokens <= min(kMaxRequestTokens, max_context) when max_context > 0) and converts.
// INVALID_ARGUMENT with a message naming the field. Token ids, the context length and the
// session id are checked by the engine.
absl::StatusOr<GenerateRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                int64_t max_context);

v1::FinishReason ToProto(FinishReason reason);
// "length", "stop", "eos", "context", "cancelled" ("unspecified" for 0).
std::string_view FinishReasonName(v1::FinishReason reason);
void ToProto(const PrefillProgress& progress, v1::PrefillProgress* dst);
void ToProto(const TokenEvent& token, v1::TokenDelta* dst);
void ToProto(const GenerateSummary& summary, v1::GenerateFinal* dst);
void ToProto(const ModelInfo& info, v1::ModelInfoResponse* dst);

class GenerationService final : public v1::Generation::CallbackService {
 public:
  // `executor` must outlive the service and keep accepting jobs until the gRPC server that
  // serves this service has shut down (calls in flight finish from executor jobs).
  // `info` is the engine's: max_context bounds max_tokens, vocab_size the ids to detokenize.
  GenerationService(EngineExecutor* executor, const ModelInfo& info);
  ~GenerationService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseGenerationSessionRequest* request,
                                         v1::CloseGenerationSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfoResponse* response) override;

 private:
  class GenerateReactor;

  EngineExecutor* executor_;
  int64_t max_context_;
  int64_t vocab_size_;
};

}  // namespace tandem::gpu_worker
