#include "tandem/gpu_worker/prefix_cache.h"

#include <algorithm>

namespace tandem::gpu_worker {

size_t CommonPrefixLength(std::span<const int32_t> a, std::span<const int32_t> b, size_t limit) {
  limit = std::min({limit, a.size(), b.size()});
  size_t n = 0;
  while (n < limit && a[n] == b[n]) ++n;
  return n;
}
namespace {

// splitmix64's finaliser: a cheap, well-mixed 64-bit step for the chain.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int64_t block_tokens) : block_tokens_(std::max<int64_t>(1, block_tokens)) {}

std::vector<uint64_t> PrefixCache::BlockKeys(std::span<const int32_t> ids, int64_t block_tokens) {
  const size_t block = static_cast<size_t>(std::max<int64_t>(1, block_tokens));
  std::vector<uint64_t> keys;
  keys.reserve(ids.size() / block);
  uint64_t key = Mix(block);
  for (size_t b = 0; b + block <= ids.size(); b += block) {
    for (size_t i = b; i < b + block; ++i) key = Mix(key ^ static_cast<uint32_t>(ids[i]));
    keys.push_back(key);
  }
  return keys;
}

void PrefixCache::Insert(const std::string& session_id, const std::string& scope,
                         std::span<const int32_t> tokens) {
  Take(session_id);
  Entry entry{session_id, scope, std::vector<int32_t>(tokens.begin(), tokens.end()),
              BlockKeys(tokens, block_tokens_)};
  cached_tokens_ += static_cast<int64_t>(entry.tokens.size());
  lru_.push_front(std::move(entry));
  index_[session_id] = lru_.begin();
}

std::optional<PrefixCache::Hit> PrefixCache::Match(const std::string& scope,
                                                   std::span<const int32_t> prompt,
                                                   int64_t min_common) const {
  if (prompt.size() < 2) return std::nullopt;
  const std::vector<uint64_t> prompt_keys = BlockKeys(prompt, block_tokens_);
  std::optional<Hit> best;
  for (const Entry& e : lru_) {
    if (e.scope != scope) continue;
    // Whole blocks by key, then ids one by one from the last matching block on.
    size_t blocks = 0;
    const size_t max_blocks = std::min(prompt_keys.size(), e.block_keys.size());
    while (blocks < max_blocks && prompt_keys[blocks] == e.block_keys[blocks]) ++blocks;
    const size_t limit = std::min(e.tokens.size(), prompt.size() - 1);
    size_t common = std::min(limit, blocks * static_cast<size_t>(block_tokens_));
    // The keys matched: confirm the ids (a collision must not give a wrong hit).
    if (!std::equal(prompt.begin(), prompt.begin() + common, e.tokens.begin())) common = 0;
    common += CommonPrefixLength(prompt.subspan(common),
                                 std::span<const int32_t>(e.tokens).subspan(common),
                                 limit - common);
    if (static_cast<int64_t>(common) < min_common) continue;
    if (!best.has_value() || static_cast<int64_t>(common) > best->common) {
      best = Hit{e.session_id, static_cast<int64_t>(common)};
    }
  }
  return best;
}

bool PrefixCache::Take(const std::string& session_id) {
  auto it = index_.find(session_id);
  if (it == index_.end()) return false;
  cached_tokens_ -= static_cast<int64_t>(it->second->tokens.size());
  lru_.erase(it->second);
  index_.erase(it);
  return true;
}

std::optional<std::string> PrefixCache::LeastRecentlyUsed() const {
  if (lru_.empty()) return std::nullopt;
  return lru_.back().session_id;
}

std::optional<std::string> PrefixCache::LeastRecentlyUsed(
    const std::function<bool(const std::string& session_id)>& eligible) const {
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    if (eligible(it->session_id)) return it->session_id;
  }
  return std::nullopt;
}

}  // namespace tandem::gpu_worker
