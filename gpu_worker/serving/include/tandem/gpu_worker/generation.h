// Generation: one Generate request in flight, from admission to its summary. Engine::Begin
// creates it (validated, its session opened or continued, its feed built), Engine::Step
// advances any number of them in one batched forward pass, Engine::End closes it into a
// GenerateSummary. The scheduler (scheduler.h) holds them and decides what each step feeds.
//
// A generation is always in one of three phases:
//   prefill:  feed[fed..) still has prompt tokens (the pending token of a continued session
//             first); a step feeds a chunk of them
//   decode:   feed is the one token sampled last; a step feeds it and samples the next
//   finished: a finish reason is set (or a failure); End() reports it
//
// Not thread-safe: only the scheduler's thread touches it (callbacks run on that thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/gpu_worker/generate_request.h"
#include "tandem/gpu_worker/sequence.h"
#include "tandem/gpu_worker/stop_matcher.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {

class Generation {
 public:
  using Clock = std::chrono::steady_clock;

  Generation(GenerateRequest request, GenerateCallbacks callbacks, Clock::time_point arrival,
             const Tokenizer& tokenizer)
      : request(std::move(request)),
        callbacks(std::move(callbacks)),
        arrival(arrival),
        decoder(tokenizer, /*at_start=*/false),
        stops(this->request.stop) {}

  // Tokens the next step would feed: the rest of the prompt (prefill) or the sampled token.
  int64_t remaining() const { return static_cast<int64_t>(feed.size()) - fed; }
  bool prefilling() const { return !first_token_sampled; }
  bool finished() const { return reason.has_value() || !failure.ok(); }
  // The client cancelled (callbacks.cancelled) or the deadline passed: ended between steps.
  bool CancelledBy(Clock::time_point now) const;

  GenerateRequest request;
  GenerateCallbacks callbacks;
  Clock::time_point arrival;         // when the request was submitted (TTFT counts from here)

  // Set by Engine::Begin.
  Sequence* seq = nullptr;
  std::string session_id;            // the engine's key (generated for one-shot requests)
  bool keep_session = false;         // false: the session is closed by End()
  bool continues_session = false;    // the session was kept from an earlier turn (or cached)
  // Prefix cache: the scope key the session is cached under when this one-shot request ends
  // (empty: not cached), and the prompt's leading tokens a cached session already held.
  std::string cache_key;
  int64_t cached_tokens = 0;
  int64_t prompt_tokens = 0;
  std::vector<int32_t> feed;         // tokens to feed; feed[0..fed) are in the model
  int64_t fed = 0;
  std::mt19937_64 rng;
  uint64_t degraded_before = 0;

  // Advanced by Engine::Step.
  StreamDecoder decoder;
  StopMatcher stops;
  bool first_token_sampled = false;
  Clock::time_point last_token;
  std::vector<double> latencies;     // seconds between consecutive tokens
  GenerateSummary summary;
  std::optional<FinishReason> reason;
  absl::Status failure;              // a failed step or sample: End() returns it
};

}  // namespace tandem::gpu_worker
