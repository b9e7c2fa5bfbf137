#include "tandem/gpu_worker/token_output.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/logprobs.h"

namespace tandem::gpu_worker {
namespace {

using Clock = Generation::Clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

absl::Status TokenOutput::Emit(Generation& g, const float* logits) {
  const SamplingOptions& sampling = g.request.sampling;
  SampleParams sp;
  sp.logits = logits;
  sp.vocab = vocab_;
  sp.temperature = sampling.temperature;
  sp.top_k = sampling.top_k;
  sp.top_p = sampling.top_p;
  sp.uniform = static_cast<float>(static_cast<double>(g.rng() >> 11) * 0x1.0p-53);
  if (sp.uniform >= 1.0f) sp.uniform = std::nextafter(1.0f, 0.0f);
  TANDEM_ASSIGN_OR_RETURN(const int32_t token, backend_.Sample(sp));

  const Clock::time_point now = Clock::now();
  GenerateSummary& summary = g.summary;
  const int64_t i = summary.completion_tokens;
  if (i == 0) {
    summary.time_to_first_token_s = Seconds(g.arrival, now);
  } else {
    g.latencies.push_back(Seconds(g.last_token, now));
  }
  g.last_token = now;
  g.first_token_sampled = true;
  summary.token_ids.push_back(token);
  summary.completion_tokens = i + 1;
  const std::vector<int32_t>& eos = tokenizer_.eos_ids();
  const bool is_eos = std::find(eos.begin(), eos.end(), token) != eos.end();
  TokenEvent event;
  event.token_id = token;
  event.index = i;
  if (g.request.logprobs) TANDEM_RETURN_IF_ERROR(AddLogprobs(g, logits, &event));
  std::optional<FinishReason> reason;
  if (is_eos && !g.request.ignore_eos) {
    reason = FinishReason::kEos;
  } else {
    event.text = g.stops.Push(g.decoder.Push(token));
    if (g.stops.stopped()) reason = FinishReason::kStop;
  }
  // Known before the token is reported: whether it is the last, so that its message carries
  // the text still held back (one message per token).
  if (!reason.has_value() && i + 1 == g.request.max_tokens) reason = FinishReason::kLength;
  if (!reason.has_value() && static_cast<int64_t>(g.seq->tokens.size()) + 1 >= max_context_) {
    reason = FinishReason::kContext;
  }
  if (reason.has_value() && *reason != FinishReason::kStop) {
    event.text += g.stops.Push(g.decoder.Flush());
    event.text += g.stops.Flush();
  }
  summary.text += event.text;
  const bool proceed = g.callbacks.on_token ? g.callbacks.on_token(event) : true;
  // The last sampled token is fed at the start of the session's next turn.
  g.seq->pending_token = token;
  if (!reason.has_value() && !proceed) reason = FinishReason::kCancelled;
  g.reason = reason;
  if (!reason.has_value()) {   // the next step feeds it
    g.seq->pending_token.reset();
    g.feed.assign(1, token);
    g.fed = 0;
  }
  return absl::OkStatus();
}

absl::Status TokenOutput::AddLogprobs(const Generation& g, const float* logits, TokenEvent* event) {
  const int64_t vocab = vocab_;
  logits_host_.resize(static_cast<size_t>(vocab));
  TANDEM_RETURN_IF_ERROR(
      backend_.CopyToHost(logits_host_.data(), logits, logits_host_.size() * sizeof(float)));
  // A vocabulary smaller than the request's top_logprobs (toy models) lists every token.
  const int32_t top_n = static_cast<int32_t>(std::min<int64_t>(g.request.top_logprobs, vocab));
  TANDEM_ASSIGN_OR_RETURN(StepLogprobs step, ComputeStepLogprobs(logits_host_.data(), vocab,
                                                                 event->token_id, top_n));
  event->logprob = step.sampled;
  event->top_logprobs.reserve(step.top.size());
  for (const LogprobCandidate& c : step.top) {
    TokenPiece piece = DescribeToken(tokenizer_, c.token_id);
    event->top_logprobs.push_back(
        TokenAlternative{c.token_id, c.logprob, std::move(piece.raw), std::move(piece.text)});
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
