// The one validator of a generation request and the one set of request limits, used by the
// Generation service (to refuse a bad request on the gRPC thread) and by the engine (for every
// caller, the CLI included). Checks what needs no model or session state; the engine adds the
// rest (token ids against the vocabulary, the window against its block size, the context left
// in a continued session).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "tandem/gpu_worker/generate_request.h"

namespace tandem::gpu_worker {

// Most tokens one request may ask for, whatever the context.
inline constexpr int64_t kMaxRequestTokens = int64_t{1} << 20;
inline constexpr size_t kMaxRequestStops = 16;
inline constexpr size_t kMaxRequestStopBytes = 256;
inline constexpr float kMaxRequestTemperature = 100.0f;
// Session ids: 1..kMaxSessionIdLength of [A-Za-z0-9._:-] (room is left for the worker's prefix
// on the CPU nodes, whose ids are at most 128 characters).
inline constexpr size_t kMaxSessionIdLength = 96;

// INVALID_ARGUMENT naming the field: an empty prompt, max_tokens outside
// 1..min(kMaxRequestTokens, max_context) (max_context <= 0: no context bound), temperature
// outside [0, kMaxRequestTemperature] or not finite, top_p outside (0, 1], top_k < 0, too many
// or bad stop strings, top_logprobs outside 0..kMaxTopLogprobs or > 0 without logprobs, beta
// not finite or < 0, window / sink < 0, select_tokens < 1,
// dense_layers < 0, a malformed session id.
absl::Status ValidateGenerateRequest(const GenerateRequest& request, int64_t max_context);

// The session id rule alone (empty = a one-shot request, allowed).
absl::Status ValidateSessionId(const std::string& id);

}  // namespace tandem::gpu_worker
