#include "tandem/gpu_worker/kv_recompute.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

// The temporary window: every position on the device (gpu mode), the sequence's sink and block.
WindowOptions RecomputeOptions(const Sequence& seq, int64_t positions, int64_t max_chunk) {
  const WindowOptions& own = seq.window.options();
  WindowOptions wo;
  wo.sink = own.sink;
  wo.window = WindowOptions::kUnlimited;
  wo.block = own.block;
  wo.max_chunk = max_chunk;
  wo.max_context = std::max(positions, own.sink);
  return wo;
}

// One past the last position of `runs`; INVALID_ARGUMENT unless they ascend without overlap.
absl::StatusOr<int64_t> RunsEnd(const std::vector<EvictedBlock>& runs) {
  int64_t end = 0;
  for (const EvictedBlock& r : runs) {
    if (r.count <= 0 || r.first_pos < end) {
      return absl::InvalidArgumentError(
          absl::StrCat("recompute positions must ascend without overlap; run at ", r.first_pos,
                       " of ", r.count, " after position ", end - 1));
    }
    end = r.first_pos + r.count;
  }
  return end;
}

// The temporary sequence's tier during a repair: it holds nothing and hands the layer inputs of
// positions >= from to the sequence's own tier, whose pending rows of those positions they
// replace (ExactRecompute::Take overwrites by position).
class LayerInputRelay final : public OffloadTier {
 public:
  LayerInputRelay(OffloadTier& target, int64_t from, int64_t hidden)
      : target_(target), from_(from), hidden_(hidden) {}
  int64_t offloaded_tokens() const override { return 0; }
  bool wants_maw() const override { return false; }
  double off_device_work() const override { return 0.0; }
  TierFootprint footprint() const override { return {}; }   // holds nothing of its own
  absl::Status BeginPass(TierContext&, size_t) override { return absl::OkStatus(); }
  bool wants_layer_inputs() const override { return target_.wants_layer_inputs(); }
  // xn: [rows, hidden] f32 (device) at positions first_pos, ...
  absl::Status TakeLayerInputs(TierContext& context, int64_t layer, const float* xn, int64_t rows,
                               int64_t first_pos) override {
    const int64_t skip = std::clamp<int64_t>(from_ - first_pos, 0, rows);
    if (skip == rows) return absl::OkStatus();
    return target_.TakeLayerInputs(context, layer, xn + skip * hidden_, rows - skip,
                                   first_pos + skip);
  }
  absl::Status PrepareAttend(TierContext&, const AttendRows&) override { return absl::OkStatus(); }
  absl::Status StartAttend(TierContext&, const AttendRows&) override { return absl::OkStatus(); }
  absl::StatusOr<bool> FinishAttend(TierContext&, const AttendRows&) override { return false; }
  void CancelAttend(TierContext&, const AttendRows&) override {}
  absl::Status Append(TierContext&, WindowCache&, const std::vector<EvictedBlock>&) override {
    return absl::FailedPreconditionError("the recompute window evicts nothing");
  }
  absl::Status Reserve(int64_t) override { return absl::OkStatus(); }
  absl::Status Maintain() override { return absl::OkStatus(); }
  absl::Status Close() override { return absl::OkStatus(); }
  std::vector<double> MeanSelectedShare() const override { return {}; }

 private:
  OffloadTier& target_;
  int64_t from_, hidden_;
};

// Rewrites the K/V of positions [from, end) in `dst` (the sequence's window; they must be on the
// device) with those of `src` (the recompute's unlimited window: position p in slot p), every
// layer. One copy per (layer, K/V, kv head, run of consecutive slots): a few for the positions
// of a step or two.
absl::Status RewriteWindow(Backend& backend, WindowCache& src, WindowCache& dst, int64_t from,
                           int64_t end) {
  const int64_t n = end - from;
  if (n <= 0) return absl::OkStatus();
  // Slot of each position in [from, end) from the window's slot -> position table.
  std::vector<int32_t> slot_pos(static_cast<size_t>(dst.capacity()));
  TANDEM_RETURN_IF_ERROR(
      backend.CopyToHost(slot_pos.data(), dst.slot_pos(), slot_pos.size() * sizeof(int32_t)));
  std::vector<int64_t> slot_of(static_cast<size_t>(n), -1);
  for (int64_t s = 0; s < dst.scan_slots(); ++s) {
    const int64_t p = slot_pos[s];
    if (p >= from && p < end) slot_of[p - from] = s;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (slot_of[i] < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("repair from position ", from, ": position ", from + i, " left the window"));
    }
  }
  const WindowGeometry& g = dst.geometry();
  const size_t row = static_cast<size_t>(g.head_dim) * DTypeBytes(g.dtype);
  const size_t bytes = static_cast<size_t>(g.num_kv_heads * n) * row;
  std::vector<char> k(bytes), v(bytes);
  std::vector<float> maw(static_cast<size_t>(g.num_kv_heads * n));
  const std::vector<EvictedBlock> range = {{from, from, n}};
  for (int64_t l = 0; l < g.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(src.ReadBlocks(l, range, k.data(), v.data(), maw.data()));
    for (int side = 0; side < 2; ++side) {
      const char* host = side == 0 ? k.data() : v.data();
      char* cache = static_cast<char*>(side == 0 ? dst.k(l) : dst.v(l));
      for (int64_t h = 0; h < g.num_kv_heads; ++h) {
        for (int64_t i = 0; i < n;) {
          int64_t j = i + 1;  // [i, j): consecutive slots
          while (j < n && slot_of[j] == slot_of[j - 1] + 1) ++j;
          TANDEM_RETURN_IF_ERROR(
              backend.CopyToDevice(cache + (h * dst.capacity() + slot_of[i]) * row,
                                   host + (h * n + i) * row, (j - i) * row));
          i = j;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

size_t RecomputeWindowBytes(const Sequence& seq, int64_t tokens, int64_t max_chunk) {
  return RecomputeWindowBytesAt(seq, seq.window.options().sink + tokens, max_chunk);
}

size_t RecomputeWindowBytesAt(const Sequence& seq, int64_t positions, int64_t max_chunk) {
  return WindowCache::BytesFor(seq.window.geometry(), RecomputeOptions(seq, positions, max_chunk));
}

absl::Status RecomputeOffloadedKv(ModelRunner& runner, Sequence& seq, int64_t tokens,
                                  int64_t max_chunk, const RebuiltLayerSink& sink) {
  if (tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("recomputing ", tokens, " offloaded entries of ", seq.id));
  }
  const int64_t first = seq.window.options().sink;
  return RecomputeKvAt(runner, seq, {{{first, first, tokens}}, -1}, max_chunk, sink);
}

absl::StatusOr<int64_t> RecomputePositions(const Sequence& seq, const RecomputeAtRequest& request) {
  TANDEM_ASSIGN_OR_RETURN(int64_t positions, RunsEnd(request.runs));
  const int64_t fed = static_cast<int64_t>(seq.tokens.size());
  if (request.repair_from >= 0) positions = std::max(positions, fed);
  if (positions == 0 || fed < positions || request.repair_from > fed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recomputing K/V up to position ", positions - 1, " (repair from ", request.repair_from,
        ") of ", seq.id, " needs ", positions, " tokens, it has ", fed));
  }
  return positions;
}

absl::Status RecomputeKvAt(ModelRunner& runner, Sequence& seq, const RecomputeAtRequest& request,
                           int64_t max_chunk, const RebuiltLayerSink& sink) {
  TANDEM_ASSIGN_OR_RETURN(const int64_t positions, RecomputePositions(seq, request));
  const WindowGeometry& g = seq.window.geometry();
  TANDEM_ASSIGN_OR_RETURN(
      WindowCache window,
      WindowCache::Create(runner.backend(), g, RecomputeOptions(seq, positions, max_chunk)));
  Sequence scratch(absl::StrCat(seq.id, "/recompute"), AttentionMode::kGpu, std::move(window));
  const bool repair = request.repair_from >= 0;
  if (repair && seq.offload != nullptr) {
    scratch.offload = std::make_unique<LayerInputRelay>(*seq.offload, request.repair_from,
                                                        runner.model().config().hidden_size);
  }
  TANDEM_RETURN_IF_ERROR(runner.Forward(scratch, seq.tokens.data(), positions));
  if (repair) {
    TANDEM_RETURN_IF_ERROR(RewriteWindow(runner.backend(), scratch.window, seq.window,
                                         request.repair_from, positions));
  }
  if (request.runs.empty()) return absl::OkStatus();
  // An unlimited window keeps position p in slot p (its ring covers the whole context).
  std::vector<EvictedBlock> slots = request.runs;
  int64_t tokens = 0;
  for (EvictedBlock& r : slots) {
    r.first_slot = r.first_pos;
    tokens += r.count;
  }
  const size_t bytes =
      static_cast<size_t>(g.num_kv_heads * tokens * g.head_dim) * DTypeBytes(g.dtype);
  std::vector<char> k(bytes), v(bytes);
  std::vector<float> maw(static_cast<size_t>(g.num_kv_heads * tokens));
  for (int64_t l = 0; l < g.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(scratch.window.ReadBlocks(l, slots, k.data(), v.data(), maw.data()));
    TANDEM_RETURN_IF_ERROR(sink(l, k.data(), v.data(), tokens));
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker

namespace tandem::gpu_worker {

RecomputeKv MakeRecomputeKv(ModelRunner& runner, Sequence& seq, int64_t max_chunk,
                            std::function<absl::Status(size_t bytes)> check_device) {
  return [&runner, &seq, max_chunk, check = std::move(check_device)](
             int64_t tokens, const RebuiltLayerSink& sink) -> absl::Status {
    if (check) TANDEM_RETURN_IF_ERROR(check(RecomputeWindowBytes(seq, tokens, max_chunk)));
    return RecomputeOffloadedKv(runner, seq, tokens, max_chunk, sink);
  };
}

RecomputeAt MakeRecomputeAt(ModelRunner& runner, Sequence& seq, int64_t max_chunk,
                            std::function<absl::Status(size_t bytes)> check_device) {
  return [&runner, &seq, max_chunk, check = std::move(check_device)](
             const RecomputeAtRequest& request, const RebuiltLayerSink& sink) -> absl::Status {
    if (check) {
      TANDEM_ASSIGN_OR_RETURN(const int64_t positions, RecomputePositions(seq, request));
      TANDEM_RETURN_IF_ERROR(check(RecomputeWindowBytesAt(seq, positions, max_chunk)));
    }
    return RecomputeKvAt(runner, seq, request, max_chunk, sink);
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
