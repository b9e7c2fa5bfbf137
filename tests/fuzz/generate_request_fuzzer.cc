// Fuzzes the Generation service's request path up to the scheduler: request bytes as gRPC hands
// them to the raw Generate handler -> ParseRequest (UTF-8 and wire checks naming the field) ->
// ToEngineRequest (mapping + ValidateGenerateRequest), for a worker with a 2048-token context
// and for one without a context bound. An accepted request must satisfy the validator's
// contract (request_validation.h); every refusal is INVALID_ARGUMENT with a message.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_check.h"
#include "tandem/gpu_worker/generation_service.h"
#include "tandem/gpu_worker/request_validation.h"
#include "tandem/rpc_message/raw_message.h"
#include "tandem/v1/generation.pb.h"

namespace gw = tandem::gpu_worker;

namespace {

void CheckAccepted(const gw::GenerateRequest& r, int64_t max_context) {
  FUZZ_CHECK(!r.prompt_text.empty() || !r.prompt_ids.empty(), "accepted an empty prompt");
  FUZZ_CHECK(r.max_tokens >= 1 && r.max_tokens <= gw::kMaxRequestTokens, "max_tokens");
  FUZZ_CHECK(max_context <= 0 || r.max_tokens <= max_context, "max_tokens past the context");
  FUZZ_CHECK(std::isfinite(r.sampling.temperature) && r.sampling.temperature >= 0 &&
                 r.sampling.temperature <= gw::kMaxRequestTemperature,
             "temperature");
  FUZZ_CHECK(r.sampling.top_p > 0 && r.sampling.top_p <= 1, "top_p");
  FUZZ_CHECK(r.sampling.top_k >= 0, "top_k");
  FUZZ_CHECK(r.stop.size() <= gw::kMaxRequestStops, "stop count");
  for (const std::string& stop : r.stop) {
    FUZZ_CHECK(!stop.empty() && stop.size() <= gw::kMaxRequestStopBytes, "stop length");
  }
  FUZZ_CHECK(r.top_logprobs >= 0 && (r.top_logprobs == 0 || r.logprobs), "top_logprobs");
  FUZZ_CHECK(!r.beta || (std::isfinite(*r.beta) && *r.beta >= 0), "beta");
  FUZZ_CHECK(!r.window || *r.window >= 0, "window");
  FUZZ_CHECK(!r.sink || *r.sink >= 0, "sink");
  FUZZ_CHECK(!r.select_tokens || *r.select_tokens >= 1, "select_tokens");
  FUZZ_CHECK(!r.dense_layers || *r.dense_layers >= 0, "dense_layers");
  FUZZ_CHECK(r.session_id.size() <= gw::kMaxSessionIdLength, "session id length");
  FUZZ_CHECK(gw::ValidateSessionId(r.session_id).ok(), "session id");
  // The engine runs the same validator again: it must agree.
  FUZZ_CHECK(gw::ValidateGenerateRequest(r, max_context).ok(), "validator disagrees with itself");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  grpc::Slice slice(data, size);
  grpc::ByteBuffer bytes(&slice, 1);
  tandem::v1::GenerateRequest request;
  const absl::Status parsed = tandem::rpc_message::ParseRequest(bytes, &request);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.code() == absl::StatusCode::kInvalidArgument, parsed.ToString());
    FUZZ_CHECK(!parsed.message().empty(), "a parse error without a message");
    return 0;
  }
  for (int64_t max_context : {int64_t{2048}, int64_t{0}}) {
    absl::StatusOr<gw::GenerateRequest> engine_request = gw::ToEngineRequest(request, max_context);
    if (!engine_request.ok()) {
      FUZZ_CHECK(engine_request.status().code() == absl::StatusCode::kInvalidArgument,
                 engine_request.status().ToString());
      FUZZ_CHECK(!engine_request.status().message().empty(), "a refusal without a message");
      continue;
    }
    CheckAccepted(*engine_request, max_context);
  }
  return 0;
}
