// A start-up check that the attention kernels this process will run work on this CPU: a small
// problem per KV dtype (bf16, f32, int8; decode and a few-token prefill, GQA 4, head_dim 64)
// through SparseAttention, against the double-precision reference. A node or worker runs it
// before it reports SERVING, so a CPU or library the kernels cannot serve stops the process with
// one readable message instead of failing every request.
//
// Costs ~1 ms. Thread-safe.
#pragma once

#include "absl/status/status.h"
#include "tandem/cpu_attention/thread_pool.h"

namespace tandem::cpu_attention {

// OK, or FAILED_PRECONDITION saying which dtype and path failed on this CPU (with the active
// instruction set, tandem/cpu_isa) and what to do.
absl::Status CheckAttentionKernels(ThreadPool& pool);

}  // namespace tandem::cpu_attention
