// PrefixCache: the index of finished requests' sessions kept for reuse (automatic prefix
// caching, DESIGN "KV reuse across requests"). A request that ends keeps its session (its KV
// stays where its mode holds it: device window, page summaries, CPU nodes, host pages); a later
// request in the same scope whose prompt starts with that session's tokens continues it instead
// of prefilling them again.
//
// Tokens are hashed per block of `block_tokens` as a chain (block i's key hashes block i's ids
// and block i-1's key), so a key names its whole prefix: Match walks the prompt's chain against
// each entry's, then compares ids from the last matching block on (a hash collision can never
// give a wrong hit). Entries are sessions, not blocks: a session is reused in place (the engine
// truncates it to the common prefix), so one request takes an entry out (Take) and the next End
// puts it back (Insert).
//
// Eviction is least-recently-used: the engine evicts before it would refuse a request for memory
// or for its session limit (the cache never makes a request fail that would run without it).
// For device memory it first parks the session in host memory (Sequence::Park, within
// EngineOptions::prefix_cache_host_bytes) and closes it only when it cannot; a parked entry
// stays here and comes back over PCIe when a prompt hits it.
//
// Scope: entries match only requests of the same scope string (the engine builds it from the
// caller's principal, the request's cache_salt and the attention settings a continued session
// must keep), so another tenant never hits, and cannot learn from timing what it never sent.
//
// Not thread-safe: the engine's executor thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace tandem::gpu_worker {

// The leading ids `a` and `b` share, at most `limit` (and at most the shorter's length).
size_t CommonPrefixLength(std::span<const int32_t> a, std::span<const int32_t> b, size_t limit);

class PrefixCache {
 public:
  // block_tokens >= 1: the hash granularity (the engine's KV block).
  explicit PrefixCache(int64_t block_tokens);

  // A cached session that a prompt can continue.
  struct Hit {
    std::string session_id;
    int64_t common = 0;   // leading ids the prompt shares with the session's tokens
  };

  // Adds (or replaces) `session_id` as the most recently used entry: `tokens` are the ids whose
  // KV the session holds (positions 0..n-1). A token sampled but not fed is not among them: a
  // continuing prompt that repeats it feeds it, one that does not drops it.
  void Insert(const std::string& session_id, const std::string& scope,
              std::span<const int32_t> tokens);

  // The entry of `scope` sharing the longest common prefix of ids with `prompt`, if that prefix
  // is at least `min_common` ids. Hit::common counts held tokens only (not the pending one) and
  // is capped at prompt.size() - 1, so at least one prompt token is left to feed. Does not
  // change the recency order.
  std::optional<Hit> Match(const std::string& scope, std::span<const int32_t> prompt,
                           int64_t min_common) const;

  // Removes the entry (a request continues it, or it is closed). False if it was not cached.
  bool Take(const std::string& session_id);

  // The least recently used entry, to evict; nullopt when empty. With `eligible`: the least
  // recently used of the entries it accepts (e.g. those still holding device memory).
  std::optional<std::string> LeastRecentlyUsed() const;
  std::optional<std::string> LeastRecentlyUsed(
      const std::function<bool(const std::string& session_id)>& eligible) const;

  bool contains(const std::string& session_id) const { return index_.count(session_id) != 0; }
  size_t size() const { return lru_.size(); }
  int64_t cached_tokens() const { return cached_tokens_; }

  // The chain of block keys of `ids`: key i names ids [0, (i + 1) * block) (whole blocks only).
  static std::vector<uint64_t> BlockKeys(std::span<const int32_t> ids, int64_t block_tokens);

 private:
  struct Entry {
    std::string session_id;
    std::string scope;
    std::vector<int32_t> tokens;      // held ids
    std::vector<uint64_t> block_keys; // BlockKeys(tokens)
  };
  using Lru = std::list<Entry>;   // most recently used first

  int64_t block_tokens_;
  Lru lru_;
  std::unordered_map<std::string, Lru::iterator> index_;
  int64_t cached_tokens_ = 0;
};

}  // namespace tandem::gpu_worker
