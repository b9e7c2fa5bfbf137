#include "tandem/kv_store/kv_store.h"

#include <malloc.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/kv_store/int8_rows.h"

namespace tandem::kv_store {
namespace {

constexpr uint32_t kMaxAppendEntries = 65536;
// Rows of K (or V) one quantisation task of a large int8 Append takes: ~0.3 ms of work at
// head_dim 128, coarse enough that the task overhead does not show, fine enough that an 8 MiB
// shm chunk (16K rows each of K and V) spreads over 16 cores.
constexpr size_t kQuantizeSliceRows = 1024;
// Shard objects are not charged to the budget, so their number is bounded instead
// (a 1024 x 1024 geometry owning everything would be ~200 MB of bookkeeping per session).
constexpr size_t kMaxShardsPerSession = 65536;
constexpr uint32_t kMaxPageTokens = 4096;

BlockFormat FormatOf(const SessionOptions& options) {
  return BlockFormat{options.block_tokens, options.geometry.head_dim, options.storage_dtype()};
}

}  // namespace

absl::Status ValidateName(absl::string_view what, const std::string& name) {
  if (name.empty() || name.size() > kMaxNameChars) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must have 1..", kMaxNameChars, " characters, got ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " '", name, "' has a character outside [A-Za-z0-9._:-]: code ",
                       static_cast<int>(static_cast<unsigned char>(c))));
    }
  }
  return absl::OkStatus();
}

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
    : id_(std::move(id)),
      options_([&] {
        SessionOptions o = options;
        o.shards.clear();
        return o;
      }()),
      pool_(pool),
      budget_(budget),
      beta_(options_.beta),
      layers_(options_.geometry.num_layers) {
  // Sorted input, so every layer's heads are appended in ascending order.
  for (const ShardKey& key : options.shards) {
    assert(key.layer < options_.geometry.num_layers &&
           key.kv_head < options_.geometry.num_kv_heads);
    LayerShards& layer = layers_[key.layer];
    assert(layer.heads.empty() || layer.heads.back() < key.kv_head);
    layer.heads.push_back(key.kv_head);
    layer.shards.push_back(std::make_unique<Shard>(pool, budget));
  }
  num_shards_ = options.shards.size();
}

std::span<const uint32_t> Session::owned_kv_heads(uint32_t layer) const {
  if (layer >= layers_.size()) return {};
  return layers_[layer].heads;
}

Shard* Session::shard(uint32_t layer, uint32_t kv_head) {
  return const_cast<Shard*>(std::as_const(*this).shard(layer, kv_head));
}

const Shard* Session::shard(uint32_t layer, uint32_t kv_head) const {
  if (layer >= layers_.size()) return nullptr;
  const LayerShards& l = layers_[layer];
  const auto it = std::lower_bound(l.heads.begin(), l.heads.end(), kv_head);
  if (it == l.heads.end() || *it != kv_head) return nullptr;
  return l.shards[it - l.heads.begin()].get();
}

std::vector<ShardKey> Session::shard_keys() const {
  std::vector<ShardKey> keys;
  keys.reserve(num_shards_);
  for (uint32_t layer = 0; layer < layers_.size(); ++layer) {
    for (uint32_t head : layers_[layer].heads) keys.push_back({layer, head});
  }
  return keys;
}

absl::Status Session::CheckNotClosed() const {
  if (closed_) return absl::NotFoundError(absl::StrCat("session '", id_, "' was closed"));
  return absl::OkStatus();
}

absl::Status Session::CheckAdd(std::span<const ShardKey> keys, size_t dropping) const {
  TANDEM_RETURN_IF_ERROR(CheckNotClosed());
  const Geometry& g = options_.geometry;
  if (num_shards_ - std::min(dropping, num_shards_) + keys.size() > kMaxShardsPerSession) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", id_, "' would own more than ", kMaxShardsPerSession, " shards"));
  }
  std::vector<ShardKey> sorted(keys.begin(), keys.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const ShardKey& key = sorted[i];
    if (key.layer >= g.num_layers || key.kv_head >= g.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard (layer ", key.layer, ", kv_head ", key.kv_head, ") is outside num_layers ",
          g.num_layers, " x num_kv_heads ", g.num_kv_heads));
    }
    if (i > 0 && sorted[i - 1] == key) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard (layer ", key.layer, ", kv_head ", key.kv_head, ") is listed twice"));
    }
    if (shard(key.layer, key.kv_head) != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("session '", id_, "' already owns (layer ",
                                                     key.layer, ", kv_head ", key.kv_head, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::CheckDrop(std::span<const ShardKey> keys) const {
  TANDEM_RETURN_IF_ERROR(CheckNotClosed());
  std::vector<ShardKey> sorted(keys.begin(), keys.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const ShardKey& key = sorted[i];
    if (i > 0 && sorted[i - 1] == key) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard (layer ", key.layer, ", kv_head ", key.kv_head, ") is listed twice"));
    }
    if (shard(key.layer, key.kv_head) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("session '", id_, "' does not own (layer ",
                                                     key.layer, ", kv_head ", key.kv_head, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::AddShards(std::span<const ShardKey> keys) {
  TANDEM_RETURN_IF_ERROR(CheckAdd(keys, 0));
  for (const ShardKey& key : keys) {
    LayerShards& l = layers_[key.layer];
    const auto it = std::lower_bound(l.heads.begin(), l.heads.end(), key.kv_head);
    const auto index = it - l.heads.begin();
    l.heads.insert(it, key.kv_head);
    l.shards.insert(l.shards.begin() + index, std::make_unique<Shard>(pool_, budget_));
  }
  num_shards_ += keys.size();
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Session::DropShards(std::span<const ShardKey> keys) {
  TANDEM_RETURN_IF_ERROR(CheckDrop(keys));
  uint64_t dropped = 0;
  for (const ShardKey& key : keys) {
    LayerShards& l = layers_[key.layer];
    const auto index =
        std::lower_bound(l.heads.begin(), l.heads.end(), key.kv_head) - l.heads.begin();
    dropped += l.shards[index]->blocks().size();
    l.heads.erase(l.heads.begin() + index);
    l.shards.erase(l.shards.begin() + index);  // the Shard's destructor drops its references
  }
  num_shards_ -= keys.size();
  return dropped;
}

uint64_t Session::CloseLocked() {
  uint64_t dropped = 0;
  for (LayerShards& l : layers_) {
    for (const auto& shard : l.shards) dropped += shard->blocks().size();
    l.shards.clear();  // each Shard's destructor drops its block references
    l.heads.clear();
  }
  num_shards_ = 0;
  closed_ = true;
  return dropped;
}

// ---------------------------------------------------------------------------------------------
// KvStore

KvStore::KvStore(Options options) : options_(options), budget_(options.capacity_bytes) {
  if (options_.warm_reserve_bytes > 0) warmer_ = std::make_unique<BlockWarmer>(*this);
}

KvStore::~KvStore() {
  warmer_.reset();   // its passes read pools_
  // Sessions may outlive the store through their shared_ptr; their shards must not outlive
  // the pools, so they are dropped here, before pools_ is destroyed.
  std::map<std::string, std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions.swap(sessions_);
  }
  for (auto& [id, session] : sessions) {
    std::unique_lock<std::shared_mutex> lock(session->mu_);
    session->CloseLocked();
  }
}

absl::Status KvStore::ValidateOptions(SessionOptions& options) const {
  TANDEM_RETURN_IF_ERROR(options.geometry.Validate());
  if (options.block_tokens == 0) options.block_tokens = options_.default_block_tokens;
  TANDEM_RETURN_IF_ERROR(FormatOf(options).Validate());
  if (options.dtype != KvDType::kF32 && options.dtype != KvDType::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session dtype must be f32 or bf16 (int8 is a storage choice: int8_storage), got ",
        KvDTypeName(options.dtype)));
  }
  if (!std::isfinite(options.beta) || options.beta < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("beta must be finite and >= 0, got ", options.beta));
  }
  if (options.page_tokens > kMaxPageTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_tokens must be in 0..", kMaxPageTokens, ", got ", options.page_tokens));
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
                          BlockPool::Create(format, max_blocks, &budget_,
                                                            options_.huge_pages));
  pool->SetWarmReserve(options_.warm_reserve_bytes / format.block_bytes());
  pools_.push_back(std::move(pool));
  return pools_.back().get();
}

absl::Status KvStore::CheckNewSessionLocked(const std::string& id) const {
  if (sessions_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("session '", id, "' already exists"));
  }
  if (sessions_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("session limit reached: ", sessions_.size(),
                                                     " of max_sessions ", options_.max_sessions));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> KvStore::OpenSession(const std::string& id,
                                                              SessionOptions options) {
  TANDEM_RETURN_IF_ERROR(ValidateName("session id", id));
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options));
  std::lock_guard<std::mutex> lock(mu_);
  TANDEM_RETURN_IF_ERROR(CheckNewSessionLocked(id));
  TANDEM_ASSIGN_OR_RETURN(BlockPool * pool, PoolFor(FormatOf(options)));
  auto session = std::make_shared<Session>(id, std::move(options), pool, &budget_);
  sessions_.emplace(id, session);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> KvStore::ForkSession(const std::string& id,
                                                              SessionOptions options,
                                                              const std::string& parent_id,
                                                              uint64_t prefix_tokens) {
  TANDEM_RETURN_IF_ERROR(ValidateName("session id", id));
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options));
  std::shared_ptr<Session> parent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(parent_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("parent session '", parent_id, "' not found"));
    }
    parent = it->second;
    TANDEM_RETURN_IF_ERROR(CheckNewSessionLocked(id));
  }
  // Geometry, block size and dtype of a session are immutable: compared without its lock.
  const SessionOptions& po = parent->options();
  if (!(options.geometry == po.geometry)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fork '", id, "': geometry differs from parent '", parent_id, "'"));
  }
  if (options.block_tokens != po.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fork '", id, "': block_tokens ", options.block_tokens, " != parent's ", po.block_tokens));
  }
  if (options.page_tokens != po.page_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("fork '", id, "': selection differs from parent '", parent_id, "'"));
  }
  if (options.dtype != po.dtype || options.int8_storage != po.int8_storage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fork '", id, "': dtype ", KvDTypeName(options.dtype), " (stored as ",
        KvDTypeName(options.storage_dtype()), ") differs from parent '", parent_id, "' (",
        KvDTypeName(po.dtype), ", stored as ", KvDTypeName(po.storage_dtype()), ")"));
  }

  std::shared_ptr<Session> child;
  {
    // The parent's shard set may change (Reshard), so it is compared under the parent's lock.
    std::shared_lock<std::shared_mutex> parent_lock(parent->mu_);
    if (parent->closed_) {
      return absl::NotFoundError(absl::StrCat("parent session '", parent_id, "' was closed"));
    }
    const std::vector<ShardKey> keys = parent->shard_keys();
    if (options.shards != keys) {
      return absl::InvalidArgumentError(
          absl::StrCat("fork '", id, "': owned shards differ from parent '", parent_id, "'"));
    }
    for (const ShardKey& key : keys) {
      const uint64_t held = parent->shard(key.layer, key.kv_head)->held();
      if (held < prefix_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fork '", id, "': prefix_tokens ", prefix_tokens, " exceeds the ", held,
            " entries of parent shard (layer ", key.layer, ", kv_head ", key.kv_head, ")"));
      }
    }
    // On failure `child` is destroyed on return and drops the references taken so far.
    child = std::make_shared<Session>(id, std::move(options), parent->pool_, &budget_);
    for (const ShardKey& key : keys) {
      TANDEM_RETURN_IF_ERROR(
          child->shard(key.layer, key.kv_head)
              ->ShareFrom(*parent->shard(key.layer, key.kv_head), prefix_tokens));
    }
  }
  // The map lock is taken again (not held while copying selected rows); recheck what may have
  // changed meanwhile.
  std::lock_guard<std::mutex> lock(mu_);
  TANDEM_RETURN_IF_ERROR(CheckNewSessionLocked(child->id()));
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
  return session->CloseLocked();
}

absl::StatusOr<AppendStats> KvStore::Append(Session& session, uint32_t layer,
                                            std::span<const uint32_t> kv_heads, const std::byte* k,
                                            const std::byte* v, const float* maw, uint32_t n,
                                            uint32_t window_entries,
                                            std::span<const uint8_t> selected) {
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
  const bool with_flags = !selected.empty();
  const bool indexed = session.options().has_selection_index();
  if (indexed && !with_flags && window_entries == 0) {
    return absl::InvalidArgumentError("window_entries must be > 0");
  }
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
  if (with_flags) {
    if (selected.size() != total) {
      return absl::InvalidArgumentError(absl::StrCat("selected has ", selected.size(),
                                                     " flags, expected num_heads x n = ", total));
    }
    for (size_t i = 0; i < total; ++i) {
      if (selected[i] > (indexed ? 1 : 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "selected[", i / n, "][", i % n, "] must be ", indexed ? "0 or 1" : "0 (the session "
            "keeps no selection index)", ", got ", int{selected[i]}));
      }
    }
  }

  // int8 storage: quantise every head's rows once, outside the lock and before the shards
  // change (the shards copy the quantised rows; Append stays all-or-nothing). Slices of K and
  // V rows run through options_.parallel_for: a large append is bounded by memory bandwidth,
  // not by one core (rows are independent: the result is the same bytes).
  const size_t row = session.format().row_bytes();
  std::unique_ptr<std::byte[]> quantised;  // [2, total] int8 rows; every byte is written
  if (session.options().int8_storage) {
    quantised.reset(new std::byte[2 * total * row]);
    const KvDType src_dtype = session.options().dtype;
    const size_t src_row = size_t{g.head_dim} * DTypeBytes(src_dtype);
    const size_t slices = (total + kQuantizeSliceRows - 1) / kQuantizeSliceRows;
    const std::byte* src[2] = {k, v};
    auto quantize = [&](size_t i) {
      const size_t part = i / slices, first = (i % slices) * kQuantizeSliceRows;
      const size_t rows = std::min(kQuantizeSliceRows, total - first);
      QuantizeRowsInt8(src[part] + first * src_row, src_dtype, rows, g.head_dim,
                       quantised.get() + (part * total + first) * row);
    };
    if (options_.parallel_for && slices > 1) {
      options_.parallel_for(2 * slices, quantize);
    } else {
      for (size_t i = 0; i < 2 * slices; ++i) quantize(i);
    }
    k = quantised.get();
    v = quantised.get() + total * row;
  }

  std::unique_lock<std::shared_mutex> lock(session.mu_);
  TANDEM_RETURN_IF_ERROR(session.CheckNotClosed());
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
  // Unused when the flags decide.
  // Without an index nothing is selected (maw > +inf never holds).
  SelectRule rule;
  rule.select_all = indexed && session.beta_ == 0.0f;
  rule.threshold = !indexed ? std::numeric_limits<float>::infinity()
                   : with_flags ? 0.0f
                                : session.beta_ / static_cast<float>(window_entries);

  AppendStats stats;
  std::vector<uint64_t> old_held(shards.size());
  for (size_t h = 0; h < shards.size(); ++h) old_held[h] = shards[h]->held();
  std::vector<absl::StatusOr<uint64_t>> counts(shards.size(), uint64_t{0});
  auto append_head = [&](size_t h) {
    const size_t offset = h * size_t{n};
    counts[h] =
        with_flags ? shards[h]->AppendWithSelection(k + offset * row, v + offset * row,
                                                    maw + offset, selected.data() + offset, n)
                   : shards[h]->Append(k + offset * row, v + offset * row, maw + offset, n, rule);
  };
  // A large append fills its heads' shards on every runner too: each copies into its own fresh
  // blocks (the page faults and copies of a long fill), and BlockPool and MemoryBudget are
  // thread-safe. NOTE: near a full budget, heads growing their selected copies at once may
  // fail where one after another would not have (the append is refused whole either way).
  if (options_.parallel_for && shards.size() > 1 && total >= 2 * kQuantizeSliceRows) {
    options_.parallel_for(shards.size(), append_head);
  } else {
    for (size_t h = 0; h < shards.size(); ++h) {
      append_head(h);
      if (!counts[h].ok()) break;
    }
  }
  for (size_t h = 0; h < shards.size(); ++h) {
    if (counts[h].ok()) {
      stats.entries_selected += *counts[h];
      continue;
    }
    // All-or-nothing: roll back the heads that were appended (a failed head changed nothing;
    // one never run has its old count). NOTE: a head whose shared partial block was copied on
    // write keeps its private copy (same contents).
    for (size_t j = 0; j < shards.size(); ++j) {
      if (counts[j].ok()) shards[j]->Truncate(old_held[j]);
    }
    return absl::Status(counts[h].status().code(),
                        absl::StrCat("append to session '", session.id(), "' layer ", layer,
                                     " kv_head ", kv_heads[h], ": ",
                                     counts[h].status().message()));
  }
  stats.entries_appended = total;
  // The shards took blocks: the pools' warm reserves are topped up off this path.
  if (warmer_ != nullptr) warmer_->Wake();
  return stats;
}

absl::StatusOr<ReshardStats> KvStore::Reshard(Session& session, std::span<const ShardKey> add,
                                              std::span<const ShardKey> drop) {
  std::unique_lock<std::shared_mutex> lock(session.mu_);
  TANDEM_RETURN_IF_ERROR(session.CheckNotClosed());
  {
    std::vector<ShardKey> dropped(drop.begin(), drop.end());
    std::sort(dropped.begin(), dropped.end());
    for (const ShardKey& key : add) {
      if (std::binary_search(dropped.begin(), dropped.end(), key)) {
        return absl::InvalidArgumentError(absl::StrCat("shard (layer ", key.layer, ", kv_head ",
                                                       key.kv_head, ") is both added and dropped"));
      }
    }
  }
  TANDEM_RETURN_IF_ERROR(session.CheckDrop(drop));
  TANDEM_RETURN_IF_ERROR(session.CheckAdd(add, drop.size()));
  // Both lists passed their checks against the same state, and they are disjoint, so neither
  // step can fail now.
  ReshardStats stats;
  TANDEM_ASSIGN_OR_RETURN(stats.blocks_released, session.DropShards(drop));
  TANDEM_RETURN_IF_ERROR(session.AddShards(add));
  stats.shards = session.num_shards();
  return stats;
}

uint64_t KvStore::ReleaseFreeMemory(std::chrono::steady_clock::time_point freed_before) {
  std::vector<BlockPool*> pools;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& pool : pools_) pools.push_back(pool.get());   // never removed before ~KvStore
  }
  uint64_t released = 0;
  for (BlockPool* pool : pools) released += pool->ReleaseFreeBlocks(freed_before);
  // Blocks go free when shards do; their selected copies went back to the C heap then.
  if (released > 0) malloc_trim(0);
  return released;
}

uint64_t KvStore::WarmFreeBlocks(uint64_t batch_bytes) {
  std::vector<BlockPool*> pools;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& pool : pools_) pools.push_back(pool.get());   // never removed before ~KvStore
  }
  uint64_t warmed = 0;
  for (BlockPool* pool : pools) {
    warmed += pool->WarmFreeBlocks(std::max<uint64_t>(1, batch_bytes / pool->format().block_bytes()));
  }
  return warmed;
}

uint64_t KvStore::warmed_blocks() const {
  return warmer_ != nullptr ? warmer_->warmed_blocks() : 0;
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
      stats.resident_block_bytes += pool->blocks_resident() * pool->format().block_bytes();
    }
    sessions.reserve(sessions_.size());
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
    stats.sessions = static_cast<uint32_t>(sessions_.size());
  }
  // Session locks are taken without mu_ held so a long Append does not stall the store.
  for (const auto& session : sessions) {
    std::shared_lock<std::shared_mutex> lock(session->mu_);
    const uint64_t entry_bytes = session->format().entry_bytes();
    for (const Session::LayerShards& layer : session->layers_) {
      for (const auto& shard : layer.shards) {
        // Logical bytes: a prefix shared by k shards (forks) counts k times, so with forks
        // stored_bytes can exceed block_bytes_in_use.
        stats.stored_bytes += shard->held() * entry_bytes;
        stats.selected_bytes += shard->selected_capacity_bytes();
      }
    }
  }
  stats.used_bytes = budget_.used();
  return stats;
}

}  // namespace tandem::kv_store
