#include "tandem/gpu_worker/exact_rebuild.h"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/exact_tier.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

// Whether a RemoteKv::RebuildLost that failed before asking for the recompute found no node for
// the lost shards: its placement's verdict (none accepts: INVALID_ARGUMENT from the planner or
// UNAVAILABLE; none has room: RESOURCE_EXHAUSTED) or the chosen node refusing the shards.
bool NoNodeTakesThem(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kResourceExhausted ||
         s.code() == absl::StatusCode::kInvalidArgument;
}

// Moves every node entry into the host pages: recomputes them, appends them layer by layer,
// then closes the node session. NOTE: OffloadedKv cannot drop entries, so a failure after the
// first layer was appended (a device read error, a host allocation that the check below did
// not foresee) leaves the layers uneven; the check makes the likely failure happen before.
absl::Status MoveToHost(RemoteKv& remote, OffloadedKv& host, ExactNodeRecovery& recovery,
                        int64_t repair_from) {
  const int64_t tokens = recovery.positions.size();
  const WindowGeometry& g = host.geometry();
  const double bytes = static_cast<double>(
      OffloadedKv::HostBytesFor(g, host.page_tokens(), host.tokens(0) + tokens) -
      OffloadedKv::HostBytesFor(g, host.page_tokens(), host.tokens(0)));
  const long avail_pages = sysconf(_SC_AVPHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (avail_pages > 0 && page_size > 0 &&
      bytes > static_cast<double>(avail_pages) * static_cast<double>(page_size)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no CPU node can take the shards of the lost node and the host pages lack ",
                     static_cast<int64_t>(bytes / (1 << 20)), " MiB for the node entries"));
  }
  if (tokens > 0 || repair_from >= 0) {
    int64_t appended_layers = 0;
    const absl::Status moved = recovery.recompute(
        {recovery.positions.runs(), repair_from},
        [&](int64_t layer, const void* k, const void* v, int64_t count) -> absl::Status {
          if (count != tokens || layer != appended_layers) {
            return absl::InternalError(absl::StrCat("recomputed ", count, " entries of layer ",
                                                    layer, ", expected ", tokens, " of layer ",
                                                    appended_layers));
          }
          TANDEM_RETURN_IF_ERROR(host.Append(layer, k, v, count));
          ++appended_layers;
          return absl::OkStatus();
        });
    if (!moved.ok()) {
      if (appended_layers == 0) return moved;
      // The host pages of the first layers now hold the node entries too (pages cannot drop
      // entries): a retry would append them again. The session stays as it is, flagged
      // degraded on every step from now on, and is not rebuilt again.
      recovery.inexact = true;
      recovery.recompute = nullptr;
      return absl::InternalError(
          absl::StrCat("moving the node entries to the host pages failed after ", appended_layers,
                       " layers (the session's steps are flagged degraded from now on): ",
                       moved.message()));
    }
  }
  recovery.on_host = true;
  recovery.positions.Clear();
  // The surviving nodes' sessions are of no use now; a failure to close one is only logged.
  if (absl::Status closed = remote.Close(); !closed.ok()) {
    spdlog::warn("session {}: closing the node session after moving its entries to the host: {}",
                 remote.options().session_id, std::string(closed.message()));
  }
  return absl::OkStatus();
}

}  // namespace

void EntryPositions::Add(int64_t first_pos, int64_t count) {
  if (count <= 0) return;
  size_ += count;
  if (!runs_.empty() && runs_.back().first_pos + runs_.back().count == first_pos) {
    runs_.back().count += count;
    return;
  }
  runs_.push_back({first_pos, first_pos, count});
}

void EntryPositions::AddFromBatch(const std::vector<EvictedBlock>& blocks, int64_t from,
                                  int64_t count) {
  int64_t offset = 0;  // index of blocks[i]'s first entry in the batch
  for (const EvictedBlock& b : blocks) {
    if (count <= 0) return;
    const int64_t begin = std::max(from, offset), end = std::min(from + count, offset + b.count);
    if (end > begin) Add(b.first_pos + (begin - offset), end - begin);
    offset += b.count;
  }
}

void ExactNodeRecovery::NoteEvicted(const std::vector<EvictedBlock>& blocks, int64_t from,
                                    int64_t count) {
  positions.AddFromBatch(blocks, from, count);
  for (const EvictedBlock& b : blocks) evicted_end = std::max(evicted_end, b.first_pos + b.count);
}

absl::Status ExactNodeRecovery::NoteAttend(Backend& backend, const int32_t* q_pos, bool degraded) {
  last_attend_degraded = degraded;
  if (!degraded || first_tainted >= 0 || inexact) return absl::OkStatus();
  int32_t first = 0;
  TANDEM_RETURN_IF_ERROR(backend.CopyToHost(&first, q_pos, sizeof(first)));
  first_tainted = first;
  return absl::OkStatus();
}

absl::StatusOr<bool> RebuildExactNodes(RemoteKv& remote, OffloadedKv& host,
                                       ExactNodeRecovery& recovery) {
  if (!recovery.recompute || Clock::now() < recovery.next_try) return false;
  const bool lost = !recovery.on_host && remote.needs_rebuild();
  // With a rebuild, or once the nodes answer again (a node still missing answers would taint
  // the next steps again).
  const bool repair = recovery.needs_repair() && (lost || !recovery.last_attend_degraded);
  if (!lost && !repair) return false;
  int64_t repair_from = -1;
  if (recovery.needs_repair()) {
    if (recovery.first_tainted < recovery.evicted_end) {
      spdlog::warn(
          "session {}: positions from {} were computed from degraded attention and left the "
          "window before a repair: its steps are flagged degraded from now on",
          remote.options().session_id, recovery.first_tainted);
      recovery.inexact = true;
    } else if (repair) {
      repair_from = recovery.first_tainted;
    }
  }
  const auto failed = [&](absl::Status s) -> absl::StatusOr<bool> {
    recovery.next_try = Clock::now() + ExactNodeRecovery::kRetry;
    return s;
  };
  // Whether the forward pass ran (the repair is done before the first layer reaches a sink).
  bool recomputed = false;
  const auto run = [&](const std::vector<EvictedBlock>& runs,
                       const RebuiltLayerSink& sink) -> absl::Status {
    recomputed = true;
    const absl::Status s = recovery.recompute({runs, repair_from}, sink);
    if (s.ok() && repair_from >= 0) recovery.first_tainted = -1;
    return s;
  };
  if (lost) {
    const int64_t held = remote.offloaded_tokens();
    if (held != recovery.positions.size()) {
      return failed(absl::InternalError(absl::StrCat("exact tier: the node session holds ", held,
                                                     " entries and ", recovery.positions.size(),
                                                     " positions were recorded")));
    }
    // The hybrid path's rebuild (placement of the lost shards, appends, undo on failure), fed
    // with the K/V of the node entries' positions instead of a prefix.
    const absl::Status rebuilt =
        remote.RebuildLost([&](int64_t tokens, const RebuiltLayerSink& sink) -> absl::Status {
          if (tokens != recovery.positions.size()) {
            return absl::InternalError(absl::StrCat("rebuild of ", tokens, " entries, ",
                                                    recovery.positions.size(), " recorded"));
          }
          return run(recovery.positions.runs(), sink);
        });
    if (!rebuilt.ok() && (recomputed || !NoNodeTakesThem(rebuilt))) return failed(rebuilt);
    if (!rebuilt.ok()) {
      // The placement found no node for the lost shards: the nodes are given up.
      spdlog::warn("session {}: {}; its {} node entries move to the host pages",
                   remote.options().session_id, std::string(rebuilt.message()), held);
      if (absl::Status moved = MoveToHost(remote, host, recovery, repair_from); !moved.ok()) {
        return failed(moved);
      }
      if (repair_from >= 0) recovery.first_tainted = -1;
      return true;
    }
  }
  // Nothing was lost after all (or it was rebuilt without this forward pass): the repair alone.
  if (repair_from >= 0 && !recomputed) {
    const absl::Status repaired =
        run({}, [](int64_t, const void*, const void*, int64_t) { return absl::OkStatus(); });
    if (!repaired.ok()) return failed(repaired);
  }
  return recomputed;
}

bool ExactTier::needs_rebuild() const {
  const bool lost = !recovery_.on_host && remote_->needs_rebuild();
  return lost || (recovery_.needs_repair() && !recovery_.last_attend_degraded);
}

absl::StatusOr<bool> ExactTier::Rebuild() {
  const bool was_on_host = recovery_.on_host;
  TANDEM_ASSIGN_OR_RETURN(const bool recomputed, RebuildExactNodes(*remote_, *host_, recovery_));
  if (recovery_.on_host && !was_on_host) {
    // No nodes from now on: later evictions go to the recompute share and the host pages.
    options_.plan.force_recompute_share = plan_.recompute_share;
    options_.plan.force_fetch_share = 1.0 - plan_.recompute_share;
    Replan(options_.expected_tokens);
    spdlog::info("session {}: without CPU nodes: {}", remote_->options().session_id,
                 FormatExactPlan(plan_));
  }
  return recomputed;
}

}  // namespace tandem::gpu_worker
