// Engine: a one-shot request's prompt continuing a session that holds its prefix (the prefix
// cache's, a running request's or a kept one's): the scope it may match in, the choice between
// continuing in place and forking, and the fork (engine.h; kv_cache_manager.h keeps the cache).
#include "tandem/gpu_worker/engine.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/gpu_worker/kv_recompute.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/tier_traits.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

Engine::CacheScope Engine::PrefixCacheScope(const GenerateRequest& request,
                                            const SequenceSpec& spec) const {
  // Fields joined by a byte no principal, salt or number contains; lengths first, so no two
  // different tuples give one key.
  auto key_of = [&](const std::string& principal) {
    std::string key = absl::StrCat(principal.size(), ":", principal, "\x1f",
                                   request.cache_salt.size(), ":", request.cache_salt, "\x1f",
                                   std::string(AttentionModeName(spec.mode)));
    const TierTraits traits = TraitsOf(spec.mode, spec.selection);
    if (traits.windowed) absl::StrAppend(&key, "\x1f", spec.window, "\x1f", spec.sink);
    if (traits.selects) {
      absl::StrAppend(&key, "\x1f", spec.selection == SelectionRule::kPages ? "pages" : "maw");
    }
    return key;
  };
  return {key_of(options_.prefix_cache_shared_scope ? "" : request.principal),
          key_of(request.principal)};
}

Sequence* Engine::ReuseCachedPrefix(const CacheScope& scope, const std::vector<int32_t>& prompt,
                                     int64_t planned, int64_t* common, bool* forked) {
  *forked = false;
  auto fork_of = [&](const PrefixCache::Hit& parent) -> Sequence* {
    absl::StatusOr<Sequence*> fork =
        ForkSession(scope.cache, parent.session_id, parent.common, planned);
    if (!fork.ok()) {
      spdlog::debug("prefix cache: no fork of {}: {}", parent.session_id,
                    fork.status().ToString());
      return nullptr;
    }
    *common = parent.common;
    *forked = true;
    return *fork;
  };
  std::optional<PrefixCache::Hit> hit = kv_cache_->Match(scope.cache, prompt);
  // A session in use that shares more (a reader of the same document that came just before, or
  // a kept session of the caller's): forked, never taken. The cached hit stays out of the cache
  // meanwhile, so that the fork's room is not made by evicting it.
  if (const std::optional<PrefixCache::Hit> in_use = InUsePrefix(scope, prompt);
      in_use.has_value() && (!hit.has_value() || in_use->common > hit->common)) {
    const bool hit_held = hit.has_value() && kv_cache_->Take(hit->session_id);
    Sequence* fork = fork_of(*in_use);
    if (hit_held && sessions_->contains(hit->session_id)) {
      kv_cache_->Insert(hit->session_id, scope.cache, sessions_->Find(hit->session_id)->tokens);
    }
    if (fork != nullptr) return fork;
  }
  // (A failed fork may have closed sessions: look the hit up again.)
  if (!hit.has_value() || !sessions_->contains(hit->session_id)) return nullptr;
  // A parked hit comes back over PCIe first (both ways below read its window on the device).
  if (sessions_->Find(hit->session_id)->parked() &&
      !kv_cache_->Unpark(scope.cache, hit->session_id)) {
    return nullptr;
  }
  // Continuing in place keeps one copy; a fork keeps the cached tokens the prompt does not share
  // for whoever sends them next (the same document with another question, or the parent's own
  // next turn). A tail shorter than a block is a chat turn re-rendered at its end: not worth a
  // copy.
  const int64_t dropped =
      static_cast<int64_t>(sessions_->Find(hit->session_id)->tokens.size()) - hit->common;
  if (dropped >= options_.block_tokens) {
    if (Sequence* fork = fork_of(*hit)) return fork;
    if (!sessions_->contains(hit->session_id)) return nullptr;
  }
  Sequence& seq = *sessions_->Find(hit->session_id);
  if (absl::Status truncated = seq.TruncateTo(hit->common); !truncated.ok()) {
    // Its tokens after the common prefix left the device (a long generation in a bounded
    // window): this prompt cannot reuse it; it stays cached for prompts that extend it.
    spdlog::debug("prefix cache: {}: {}", hit->session_id, truncated.ToString());
    return nullptr;
  }
  kv_cache_->Take(hit->session_id);
  *common = hit->common;
  return &seq;
}

std::optional<PrefixCache::Hit> Engine::InUsePrefix(const CacheScope& scope,
                                                    const std::vector<int32_t>& prompt) const {
  std::optional<PrefixCache::Hit> best;
  if (prompt.size() < 2) return best;
  auto consider = [&](const std::string& id, const Sequence& seq) {
    if (seq.window.widened()) return;   // a prefill under way: not forkable yet
    if (seq.in_pass) return;            // in a pass paused for an interlude: KV half written
    if (seq.offload != nullptr && !seq.offload->can_fork()) return;
    if (const Generation* running = sessions_->running(id);
        running != nullptr && !running->failure.ok()) {
      return;   // failed in this iteration (its state may be inconsistent): End closes it
    }
    const size_t limit = std::min(seq.tokens.size(), prompt.size() - 1);
    const size_t common = CommonPrefixLength(seq.tokens, prompt, limit);
    if (static_cast<int64_t>(common) < options_.prefix_cache_min_tokens) return;
    if (!best.has_value() || static_cast<int64_t>(common) > best->common) {
      best = PrefixCache::Hit{id, static_cast<int64_t>(common)};
    }
  };
  for (const auto& [id, g] : sessions_->running()) {   // running one-shot requests of the scope
    if (g->cache_key == scope.cache && g->seq != nullptr) consider(id, *g->seq);
  }
  // Kept sessions are pinned prefixes of their own principal's scope only (even when one-shot
  // requests share one scope: a conversation is not a cached prompt).
  for (const auto& [id, own] : sessions_->kept()) {
    const Sequence* kept = sessions_->Find(id);
    if (own == scope.own && kept != nullptr) consider(id, *kept);
  }
  return best;
}

absl::StatusOr<Sequence*> Engine::ForkSession(const std::string& key,
                                              const std::string& parent_id, int64_t common,
                                              int64_t planned) {
  Sequence& parent = *sessions_->Find(parent_id);
  // What cannot fork is known before any room is made or anything is moved.
  if (parent.in_pass) return absl::FailedPreconditionError("a pass over it is under way");
  if (parent.offload != nullptr && !parent.offload->can_fork()) {
    return absl::UnimplementedError("its offload tier does not fork");
  }
  TANDEM_RETURN_IF_ERROR(parent.window.ForkBytes(common, planned).status());
  // A parent still settling its prompt into its tier finishes that first, once: its forks then
  // share the settled entries on the CPU nodes instead of each appending its own copy of them.
  // Not when the settle would take positions at or after `common` off the device (the fork
  // then copies the pending blocks instead). The settle runs here, between steps, at once.
  int64_t settled_end = parent.window.options().sink + parent.window.evicted_tokens();
  for (const EvictedBlock& b : parent.window.PendingEvictions()) settled_end += b.count;
  if (parent.offload != nullptr && parent.window.settling() && common >= settled_end) {
    if (absl::Status settled = runner_->SettleEvictions(parent); !settled.ok()) {
      // As a failed settle slice: the parent's state is no longer consistent.
      const std::string why = absl::StrCat("its prompt's move to the KV tier before a fork "
                                           "failed: ", settled.ToString());
      if (Generation* running = sessions_->running(parent_id); running != nullptr) {
        running->failure = absl::InternalError(why);   // End closes it
      } else {
        CloseLostSession(parent_id, why);
      }
      return absl::FailedPreconditionError(absl::StrCat("no fork of ", parent_id, ": ", why));
    }
  }
  // A cached parent is out of the cache while room is made, so that the room is not made by
  // evicting it; back in afterwards as the most recently used (a document others are reading).
  const bool cached = kv_cache_->Take(parent_id);
  auto recache = absl::MakeCleanup([&] {
    if (cached) kv_cache_->Insert(parent_id, key, parent.tokens);
  });
  TANDEM_RETURN_IF_ERROR(kv_cache_->MakeSessionRoom(options_.max_sessions));
  const std::string id = sessions_->NewAnonymousId();
  const WindowOptions& wo = parent.window.options();
  const int64_t expected_offloaded =
      wo.window == WindowOptions::kUnlimited ? 0
                                             : std::max<int64_t>(0, planned - wo.window - wo.sink);
  TANDEM_ASSIGN_OR_RETURN(size_t device_bytes, parent.window.ForkBytes(common, planned));
  if (const PageIndex* pages = PagesOf(parent); pages != nullptr) {
    device_bytes += PageIndex::BytesFor(window_geometry(), pages->page_tokens(),
                                        std::max(expected_offloaded, parent.offloaded_entries()));
  }
  auto tier_fork = [&](Sequence& fork) {
    return TierFork{absl::StrCat(id_prefix_, ".", id), expected_offloaded,
                    MakeRecomputeKv(*runner_, fork, options_.prefill_chunk,
                                    [this](size_t bytes) { return CheckDeviceKv(bytes); })};
  };
  std::unique_ptr<Sequence> fork;
  TANDEM_RETURN_IF_ERROR(kv_cache_->WithEviction([&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(CheckDeviceKv(device_bytes));
    TANDEM_ASSIGN_OR_RETURN(fork, parent.Fork(id, common, planned, tier_fork));
    return absl::OkStatus();
  }));
  return &sessions_->Add(std::move(fork));
}

}  // namespace tandem::gpu_worker
