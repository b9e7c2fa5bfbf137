// The row-wise operations of the cpu backend (private to backend/cpu): Embed, RmsNorm, Rope,
// SwiGlu and WriteKv, as specified in backend.h. Each validates its parameters (INVALID_ARGUMENT
// naming the operation and the broken rule) and then runs on the calling thread; these are
// memory-bound loops over at most a few MB, where an OpenMP team would cost more than it saves.
#pragma once

#include "absl/status/status.h"
#include "cpu_scratch.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

absl::Status RunEmbed(const EmbedParams& p);
// `scratch` holds the weights converted to f32 when they are bf16 or f16.
absl::Status RunRmsNorm(const RmsNormParams& p, ScratchBuffer& scratch);
// `scratch` holds one token's cos/sin table.
absl::Status RunRope(const RopeParams& p, ScratchBuffer& scratch);
absl::Status RunSwiGlu(const SwiGluParams& p);
absl::Status RunWriteKv(const WriteKvParams& p);

}  // namespace tandem::gpu_worker::cpu
