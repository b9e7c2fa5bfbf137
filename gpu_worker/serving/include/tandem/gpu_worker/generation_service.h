// The gRPC face of the Engine: tandem.v1.Generation (proto/tandem/v1/generation.proto) on the
// callback API. Every handler validates its request on the gRPC thread and hands it to the
// Scheduler (Generate: Submit, batched with every other running request; the rest: a control
// job between steps) and returns; the scheduler finishes the call. No reactor blocks and the
// scheduler never waits on the network: Generate's callbacks queue its stream messages and the
// reactor writes them one at a time as the client takes them.
//
// Also the proto <-> engine conversions, shared with the `tandem` CLI (which runs the same
// requests on an in-process Engine).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/request_validation.h"
#include "tandem/gpu_worker/scheduler.h"
#include "tandem/security/authenticator.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gpu_worker {

class PromptEncoder;

namespace internal {
class SessionOwnership;
}  // namespace internal

// Who may call and how many kept sessions one caller may hold.
struct ServiceSecurity {
  // Tokens and client certificates (tandem/security/authenticator.h); the default lets every
  // caller in as security::kAnonymous.
  security::Authenticator authenticator;
  // Kept sessions one principal may hold; 0 = only EngineOptions::max_sessions bounds them.
  uint32_t max_sessions_per_principal = 0;
};

// Converts and validates (ValidateGenerateRequest with max_context: the one validator the
// engine also runs). INVALID_ARGUMENT with a message naming the field for an unknown mode or
// selection too. Token ids and the context left in a session are checked by the engine.
absl::StatusOr<GenerateRequest> ToEngineRequest(const v1::GenerateRequest& request,
                                                int64_t max_context);

v1::FinishReason ToProto(FinishReason reason);
// "length", "stop", "eos", "context", "cancelled" ("unspecified" for 0).
std::string_view FinishReasonName(v1::FinishReason reason);
void ToProto(const PrefillProgress& progress, v1::PrefillProgress* dst);
void ToProto(const TokenEvent& token, v1::TokenDelta* dst);
void ToProto(const GenerateSummary& summary, v1::GenerateFinal* dst);
void ToProto(const ModelInfo& info, v1::ModelInfoResponse* dst);

// Generate and Tokenize are raw-callback methods: their request bytes are parsed by the service
// (tandem/rpc_message/raw_message.h), so text that is not UTF-8 is INVALID_ARGUMENT naming the field instead of
// gRPC's bare UNIMPLEMENTED. The wire format is the proto's.
//
// Security: every method authenticates its caller first (UNAUTHENTICATED without a valid
// bearer token when the worker has --auth_token_file). A kept session belongs to the principal
// that created it; another principal's Generate or CloseSession on it is PERMISSION_DENIED
// (internal/session_ownership.h). The health service is separate and stays open.
class GenerationService final
    : public v1::Generation::WithRawCallbackMethod_Tokenize<
          v1::Generation::WithRawCallbackMethod_Generate<v1::Generation::CallbackService>> {
 public:
  // `scheduler` must outlive the service and keep accepting work until the gRPC server that
  // serves this service has shut down (calls in flight finish from the scheduler thread).
  // `info` is the engine's: max_context bounds max_tokens, vocab_size the ids to detokenize.
  // `tokenizer` (the engine's, outliving the service) tokenizes prompt texts off the scheduler
  // thread (PromptEncoder: Generate's and Tokenize's texts, bounded by the context first).
  GenerationService(Scheduler* scheduler, const ModelInfo& info, const Tokenizer& tokenizer,
                    ServiceSecurity security = {});
  ~GenerationService() override;

  // request: a serialized v1::GenerateRequest; the stream carries v1::GenerateResponse.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;
  // request / response: serialized v1::TokenizeRequest / v1::TokenizeResponse.
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseGenerationSessionRequest* request,
                                         v1::CloseGenerationSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfoResponse* response) override;
  // memory_plan.h AnswerCapacity, between steps.
  grpc::ServerUnaryReactor* GetCapacity(grpc::CallbackServerContext* context,
                                        const v1::GetCapacityRequest* request,
                                        v1::GetCapacityResponse* response) override;

 private:
  class GenerateReactor;

  // Generate's ownership step for a kept session: claims `id` for the caller; returns the
  // callback the call runs at its end (forgets a never-kept session and closes it in the
  // engine), or the refusal.
  absl::StatusOr<std::function<void(bool kept)>> ClaimSession(const std::string& id,
                                                              const std::string& principal);
  // Generate's text prompt: checked against the context, tokenized on encoder_'s threads, then
  // started on the scheduler (or finished with the refusal; on_end(false) then).
  void StartAfterEncoding(GenerateReactor* reactor, GenerateRequest request,
                          std::function<void(bool kept)> on_end);

  Scheduler* scheduler_;
  int64_t max_context_;
  int64_t vocab_size_;
  const security::Authenticator authenticator_;
  // Null when callers cannot be told apart and sessions per principal are unbounded (the
  // insecure default: nothing to enforce).
  std::unique_ptr<internal::SessionOwnership> owners_;
  std::unique_ptr<PromptEncoder> encoder_;
  const Tokenizer& tokenizer_;
};

}  // namespace tandem::gpu_worker
