// Sample and TokenLogProbs of the cpu backend (private to backend/cpu), as specified in
// backend.h. Both validate their parameters (INVALID_ARGUMENT) and run on the calling thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

// The chosen token id. The softmax, the top-k / top-p cut and the cumulative search run in double
// so that the choice for a given `uniform` does not depend on f32 summation order. The top-p mass
// is measured on the distribution renormalised over the top-k tokens (as Hugging Face and vLLM
// apply top-k, then top-p).
absl::StatusOr<int32_t> RunSample(const SampleParams& p);

// out[t] = logits[t, target] - max - log Σ exp(logits[t, :] - max) with f32 exponentials and
// f32 sums (relative error ~1e-6).
absl::Status RunTokenLogProbs(const TokenLogProbParams& p);

}  // namespace tandem::gpu_worker::cpu
