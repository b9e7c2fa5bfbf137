#include "tandem/gpu_worker/kv_recompute.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

// The temporary window: every position on the device (gpu mode), the sequence's sink and block.
WindowOptions RecomputeOptions(const Sequence& seq, int64_t tokens, int64_t max_chunk) {
  const WindowOptions& own = seq.window.options();
  WindowOptions wo;
  wo.sink = own.sink;
  wo.window = WindowOptions::kUnlimited;
  wo.block = own.block;
  wo.max_chunk = max_chunk;
  wo.max_context = own.sink + tokens;
  return wo;
}

}  // namespace

size_t RecomputeWindowBytes(const Sequence& seq, int64_t tokens, int64_t max_chunk) {
  return WindowCache::BytesFor(seq.window.geometry(), RecomputeOptions(seq, tokens, max_chunk));
}

absl::Status RecomputeOffloadedKv(ModelRunner& runner, const Sequence& seq, int64_t tokens,
                                  int64_t max_chunk, const RebuiltLayerSink& sink) {
  const int64_t first = seq.window.options().sink;
  const int64_t positions = first + tokens;
  if (tokens <= 0 || static_cast<int64_t>(seq.tokens.size()) < positions) {
    return absl::InvalidArgumentError(absl::StrCat("recomputing ", tokens, " offloaded entries of ",
                                                   seq.id, " needs ", positions, " tokens, it has ",
                                                   seq.tokens.size()));
  }
  const WindowGeometry& g = seq.window.geometry();
  TANDEM_ASSIGN_OR_RETURN(
      WindowCache window,
      WindowCache::Create(runner.backend(), g, RecomputeOptions(seq, tokens, max_chunk)));
  Sequence scratch(absl::StrCat(seq.id, "/recompute"), AttentionMode::kGpu, std::move(window));
  TANDEM_RETURN_IF_ERROR(runner.Forward(scratch, seq.tokens.data(), positions));
  // An unlimited window keeps position p in slot p (its ring covers the whole context).
  const std::vector<EvictedBlock> range = {{first, first, tokens}};
  const size_t bytes =
      static_cast<size_t>(g.num_kv_heads * tokens * g.head_dim) * DTypeBytes(g.dtype);
  std::vector<char> k(bytes), v(bytes);
  std::vector<float> maw(static_cast<size_t>(g.num_kv_heads * tokens));
  for (int64_t l = 0; l < g.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(scratch.window.ReadBlocks(l, range, k.data(), v.data(), maw.data()));
    TANDEM_RETURN_IF_ERROR(sink(l, k.data(), v.data(), tokens));
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker

namespace tandem::gpu_worker {

RecomputeKv MakeRecomputeKv(ModelRunner& runner, const Sequence& seq, int64_t max_chunk,
                            std::function<absl::Status(size_t bytes)> check_device) {
  return [&runner, &seq, max_chunk, check = std::move(check_device)](
             int64_t tokens, const RebuiltLayerSink& sink) -> absl::Status {
    if (check) TANDEM_RETURN_IF_ERROR(check(RecomputeWindowBytes(seq, tokens, max_chunk)));
    return RecomputeOffloadedKv(runner, seq, tokens, max_chunk, sink);
  };
}

bool RebuildLostKv(Sequence& seq) {
  if (seq.offload == nullptr || !seq.offload->needs_rebuild()) return false;
  absl::StatusOr<bool> rebuilt = seq.offload->Rebuild();
  if (!rebuilt.ok()) {
    spdlog::warn("session {}: {} (its steps stay degraded; retrying)", seq.id,
                 std::string(rebuilt.status().message()));
    return true;
  }
  return *rebuilt;
}

}  // namespace tandem::gpu_worker
