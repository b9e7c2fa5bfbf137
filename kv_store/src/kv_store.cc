#include "tandem/kv_store/kv_store.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::kv_store {
namespace {

constexpr size_t kMaxSessionIdChars = 128;
constexpr uint32_t kMaxAppendEntries = 65536;
// Shard objects are not charged to the budget, so their number is bounded instead
// (a 1024 x 1024 geometry owning everything would be ~200 MB of bookkeeping per session).
constexpr size_t kMaxShardsPerSession = 65536;

absl::Status ValidateSessionId(const std::string& id) {
  if (id.empty() || id.size() > kMaxSessionIdChars) {
    return absl::InvalidArgumentError(absl::StrCat("session id must have 1..", kMaxSessionIdChars,
                                                   " characters, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("session id '", id, "' has a character outside [A-Za-z0-9._:-]: code ",
                       static_cast<int>(static_cast<unsigned char>(c))));
    }
  }
  return absl::OkStatus();
}

BlockFormat FormatOf(const SessionOptions& options) {
  return BlockFormat{options.block_tokens, options.geometry.head_dim, options.dtype};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Geometry, Session

absl::Status Geometry::Validate() const {
  if (num_layers < 1 || num_layers > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in 1..1024, got ", num_layers));
  }
  if (num_kv_heads < 1 || num_kv_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads must be in 1..1024, got ", num_kv_heads));
  }
  if (num_q_heads < 1 || num_q_heads > 8192 || num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_q_heads must be in 1..8192 and a multiple of num_kv_heads (",
                     num_kv_heads, "), got ", num_q_heads));
  }
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be in 8..256 and a multiple of 8, got ", head_dim));
  }
  return absl::OkStatus();
}

Session::Session(std::string id, SessionOptions options, BlockPool* pool, MemoryBudget* budget)
    : id_(std::move(id)), options_(std::move(options)), pool_(pool), beta_(options_.beta) {
  const Geometry& g = options_.geometry;
  owned_.resize(g.num_layers);
  shard_index_.assign(size_t{g.num_layers} * g.num_kv_heads, -1);
  shards_.reserve(options_.shards.size());
  for (const ShardKey& key : options_.shards) {
    assert(key.layer < g.num_layers && key.kv_head < g.num_kv_heads);
    shard_index_[size_t{key.layer} * g.num_kv_heads + key.kv_head] =
        static_cast<int32_t>(shards_.size());
    owned_[key.layer].push_back(key.kv_head);
    shards_.push_back(std::make_unique<Shard>(pool, budget));
  }
}

std::span<const uint32_t> Session::owned_kv_heads(uint32_t layer) const {
  if (layer >= owned_.size()) return {};
  return owned_[layer];
}

Shard* Session::shard(uint32_t layer, uint32_t kv_head) {
  return const_cast<Shard*>(std::as_const(*this).shard(layer, kv_head));
}

const Shard* Session::shard(uint32_t layer, uint32_t kv_head) const {
  const Geometry& g = options_.geometry;
  if (layer >= g.num_layers || kv_head >= g.num_kv_heads) return nullptr;
  const int32_t index = shard_index_[size_t{layer} * g.num_kv_heads + kv_head];
  if (index < 0 || static_cast<size_t>(index) >= shards_.size()) return nullptr;
  return shards_[index].get();
}

uint64_t Session::DropShardsLocked() {
  uint64_t dropped = 0;
  for (const auto& shard : shards_) dropped += shard->blocks().size();
  shards_.clear();  // each Shard's destructor drops its block references
  std::fill(shard_index_.begin(), shard_index_.end(), -1);
  for (auto& heads : owned_) heads.clear();
  closed_ = true;
  return dropped;
}

// ---------------------------------------------------------------------------------------------
// KvStore

KvStore::KvStore(Options options) : options_(options), budget_(options.capacity_bytes) {}

KvStore::~KvStore() {
  // Sessions may outlive the store through their shared_ptr; their shards must not outlive
  // the pools, so they are dropped here, before pools_ is destroyed.
  std::map<std::string, std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions.swap(sessions_);
  }
  for (auto& [id, session] : sessions) {
    std::unique_lock<std::shared_mutex> lock(session->mu_);
    session->DropShardsLocked();
  }
}

absl::Status KvStore::ValidateOptions(SessionOptions& options) const {
  TANDEM_RETURN_IF_ERROR(options.geometry.Validate());
  if (options.block_tokens == 0) options.block_tokens = options_.default_block_tokens;
  TANDEM_RETURN_IF_ERROR(FormatOf(options).Validate());
  if (!std::isfinite(options.beta) || options.beta < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("beta must be finite and >= 0, got ", options.beta));
  }
  const Geometry& g = options.geometry;
  if (options.shards.empty()) {
    const size_t all = size_t{g.num_layers} * g.num_kv_heads;
    if (all > kMaxShardsPerSession) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shards is empty (all) but num_layers x num_kv_heads = ", g.num_layers, " x ",
          g.num_kv_heads, " exceeds ", kMaxShardsPerSession, " shards per session"));
    }
    options.shards.reserve(all);
    for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
      for (uint32_t head = 0; head < g.num_kv_heads; ++head) {
        options.shards.push_back({layer, head});
      }
    }
    return absl::OkStatus();
  }
  if (options.shards.size() > kMaxShardsPerSession) {
    return absl::InvalidArgumentError(absl::StrCat("shards lists ", options.shards.size(),
                                                   " entries, more than ", kMaxShardsPerSession));
  }
  for (const ShardKey& key : options.shards) {
    if (key.layer >= g.num_layers || key.kv_head >= g.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard (layer ", key.layer, ", kv_head ", key.kv_head, ") is outside num_layers ",
          g.num_layers, " x num_kv_heads ", g.num_kv_heads));
    }
  }
  std::sort(options.shards.begin(), options.shards.end());
  const auto dup = std::adjacent_find(options.shards.begin(), options.shards.end());
  if (dup != options.shards.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard (layer ", dup->layer, ", kv_head ", dup->kv_head, ") is listed twice"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockPool*> KvStore::PoolFor(const BlockFormat& format) {
  for (const auto& pool : pools_) {
    if (pool->format() == format) return pool.get();
  }
  // Every pool may grow to the whole budget; the budget, not max_blocks, is the real limit.
  uint64_t max_blocks = std::max<uint64_t>(1, options_.capacity_bytes / format.block_bytes());
  max_blocks = std::min<uint64_t>(max_blocks, std::numeric_limits<BlockId>::max());
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<BlockPool> pool,
                          BlockPool::Create(format, max_blocks, &budget_));
  pools_.push_back(std::move(pool));
  return pools_.back().get();
}

absl::StatusOr<std::shared_ptr<Session>> KvStore::OpenSession(const std::string& id,
                                                              SessionOptions options) {
  TANDEM_RETURN_IF_ERROR(ValidateSessionId(id));
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options));
  std::lock_guard<std::mutex> lock(mu_);
  if (sessions_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("session '", id, "' already exists"));
  }
  if (sessions_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("session limit reached: ", sessions_.size(),
                                                     " of max_sessions ", options_.max_sessions));
  }
  TANDEM_ASSIGN_OR_RETURN(BlockPool * pool, PoolFor(FormatOf(options)));
  auto session = std::make_shared<Session>(id, std::move(options), pool, &budget_);
  sessions_.emplace(id, session);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> KvStore::ForkSession(const std::string& id,
                                                              SessionOptions options,
                                                              const std::string& parent_id,
                                                              uint64_t prefix_tokens) {
  TANDEM_RETURN_IF_ERROR(ValidateSessionId(id));
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options));
  std::shared_ptr<Session> parent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(parent_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("parent session '", parent_id, "' not found"));
    }
    parent = it->second;
    if (sessions_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("session '", id, "' already exists"));
    }
    if (sessions_.size() >= options_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat("session limit reached: ", sessions_.size(),
                                                       " of max_sessions ", options_.max_sessions));
    }
  }
  // options_ of a session is immutable, so it can be compared without the session lock.
  const SessionOptions& po = parent->options();
  if (!(options.geometry == po.geometry)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fork '", id, "': geometry differs from parent '", parent_id, "'"));
  }
  if (options.block_tokens != po.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fork '", id, "': block_tokens ", options.block_tokens, " != parent's ", po.block_tokens));
  }
  if (options.dtype != po.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("fork '", id, "': dtype differs from parent '", parent_id, "'"));
  }
  if (options.shards != po.shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("fork '", id, "': owned shards differ from parent '", parent_id, "'"));
  }

  // Same shard list, so child shard i shares parent shard i.
  auto child = std::make_shared<Session>(id, std::move(options), parent->pool_, &budget_);
  {
    std::shared_lock<std::shared_mutex> parent_lock(parent->mu_);
    if (parent->closed_) {
      return absl::NotFoundError(absl::StrCat("parent session '", parent_id, "' was closed"));
    }
    for (size_t i = 0; i < parent->shards_.size(); ++i) {
      if (parent->shards_[i]->held() < prefix_tokens) {
        const ShardKey& key = po.shards[i];
        return absl::InvalidArgumentError(
            absl::StrCat("fork '", id, "': prefix_tokens ", prefix_tokens, " exceeds the ",
                         parent->shards_[i]->held(), " entries of parent shard (layer ", key.layer,
                         ", kv_head ", key.kv_head, ")"));
      }
    }
    // On failure `child` is destroyed on return and drops the references taken so far.
    for (size_t i = 0; i < parent->shards_.size(); ++i) {
      TANDEM_RETURN_IF_ERROR(child->shards_[i]->ShareFrom(*parent->shards_[i], prefix_tokens));
    }
  }
  // The map lock is taken again (not held while copying selected rows); recheck what may have
  // changed meanwhile.
  std::lock_guard<std::mutex> lock(mu_);
  if (sessions_.contains(child->id())) {
    return absl::AlreadyExistsError(absl::StrCat("session '", child->id(), "' already exists"));
  }
  if (sessions_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("session limit reached: ", sessions_.size(),
                                                     " of max_sessions ", options_.max_sessions));
  }
  sessions_.emplace(child->id(), child);
  return child;
}

absl::StatusOr<std::shared_ptr<Session>> KvStore::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  }
  return it->second;
}

absl::StatusOr<uint64_t> KvStore::CloseSession(const std::string& id) {
  std::shared_ptr<Session> session;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
    }
    session = std::move(it->second);
    sessions_.erase(it);
  }
  // Waits for readers (Attend) and writers that still hold the session to finish.
  std::unique_lock<std::shared_mutex> lock(session->mu_);
  return session->DropShardsLocked();
}

absl::StatusOr<AppendStats> KvStore::Append(Session& session, uint32_t layer,
                                            std::span<const uint32_t> kv_heads, const std::byte* k,
                                            const std::byte* v, const float* maw, uint32_t n,
                                            uint32_t window_entries) {
  const Geometry& g = session.geometry();
  if (layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is out of range: num_layers is ", g.num_layers));
  }
  if (kv_heads.empty()) return absl::InvalidArgumentError("kv_heads is empty");
  if (n == 0 || n > kMaxAppendEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be in 1..", kMaxAppendEntries, ", got ", n));
  }
  if (window_entries == 0) return absl::InvalidArgumentError("window_entries must be > 0");
  if (k == nullptr || v == nullptr || maw == nullptr) {
    return absl::InvalidArgumentError("k, v and maw must not be null");
  }
  std::vector<bool> seen(g.num_kv_heads, false);
  for (uint32_t head : kv_heads) {
    if (head >= g.num_kv_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_head ", head, " is out of range: num_kv_heads is ", g.num_kv_heads));
    }
    if (seen[head]) {
      return absl::InvalidArgumentError(absl::StrCat("kv_head ", head, " is listed twice"));
    }
    seen[head] = true;
  }
  const size_t total = kv_heads.size() * size_t{n};
  for (size_t i = 0; i < total; ++i) {
    if (!std::isfinite(maw[i]) || maw[i] < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("maw[", i / n, "][", i % n, "] must be finite and >= 0, got ", maw[i]));
    }
  }

  std::unique_lock<std::shared_mutex> lock(session.mu_);
  if (session.closed_) {
    return absl::NotFoundError(absl::StrCat("session '", session.id(), "' was closed"));
  }
  std::vector<Shard*> shards;
  shards.reserve(kv_heads.size());
  for (uint32_t head : kv_heads) {
    Shard* shard = session.shard(layer, head);
    if (shard == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session '", session.id(), "' does not own (layer ", layer, ", kv_head ", head, ")"));
    }
    shards.push_back(shard);
  }

  // HGCA Alg. 1 line 24: salient when maw > beta / n_gpu; beta == 0 keeps everything (dense).
  SelectRule rule;
  rule.select_all = session.beta_ == 0.0f;
  rule.threshold = session.beta_ / static_cast<float>(window_entries);

  const size_t row = session.format().row_bytes();
  AppendStats stats;
  std::vector<uint64_t> old_held;
  old_held.reserve(shards.size());
  for (size_t h = 0; h < shards.size(); ++h) {
    old_held.push_back(shards[h]->held());
    const size_t offset = h * size_t{n};
    absl::StatusOr<uint64_t> selected =
        shards[h]->Append(k + offset * row, v + offset * row, maw + offset, n, rule);
    if (!selected.ok()) {
      // All-or-nothing: roll the heads already appended back. NOTE: a head whose shared
      // partial block was copied on write keeps its private copy (same contents).
      for (size_t j = 0; j < h; ++j) shards[j]->Truncate(old_held[j]);
      return absl::Status(
          selected.status().code(),
          absl::StrCat("append to session '", session.id(), "' layer ", layer, " kv_head ",
                       kv_heads[h], ": ", selected.status().message()));
    }
    stats.entries_selected += *selected;
  }
  stats.entries_appended = total;
  return stats;
}

StoreStats KvStore::Stats() const {
  StoreStats stats;
  stats.capacity_bytes = budget_.capacity();
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& pool : pools_) {
      const uint64_t blocks = pool->blocks_in_use();
      stats.blocks_in_use += blocks;
      stats.block_bytes_in_use += blocks * pool->format().block_bytes();
    }
    sessions.reserve(sessions_.size());
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
    stats.sessions = static_cast<uint32_t>(sessions_.size());
  }
  // Session locks are taken without mu_ held so a long Append does not stall the store.
  for (const auto& session : sessions) {
    std::shared_lock<std::shared_mutex> lock(session->mu_);
    const uint64_t entry_bytes = session->format().entry_bytes();
    for (const auto& shard : session->shards_) {
      // Logical bytes: a prefix shared by k shards (forks) counts k times, so with forks
      // stored_bytes can exceed block_bytes_in_use.
      stats.stored_bytes += shard->held() * entry_bytes;
      stats.selected_bytes += shard->selected_capacity_bytes();
    }
  }
  stats.used_bytes = budget_.used();
  return stats;
}

}  // namespace tandem::kv_store
