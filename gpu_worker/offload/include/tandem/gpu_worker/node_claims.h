// NodeClaims: the memory this worker's open sessions will still charge on each CPU node beyond
// what that node's last Stats answer saw.
//
// A node charges a session's bytes only as its entries arrive (AppendKv), so sessions opened
// close together would all be placed against the same free bytes and overfill a node once their
// entries arrive (the appends then fail with "memory budget exhausted"). Each open session
// (RemoteKv) claims what it projects to charge on each node by the end of its expected length and
// reports what it has charged so far; NodePool subtracts the claims from the free bytes it
// reports, so placement plans against what is really left.
//
// Per claim and node, in bytes: projected (by the end of the expected length), charged (so far),
// seen (charged when the node's last Stats answer was asked for: already in its used bytes).
// What a claim still takes from the reported free bytes: max(projected, charged) - seen.
// A closed session's claim is withdrawn at once; what its entries held stays counted as used
// until the node's next Stats (forks may still share those blocks), so the error is on the safe
// side. Nodes shared with other workers are not covered: their refusals stay the backstop.
//
// Not thread-safe: NodePool guards it with its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace tandem::gpu_worker {

class NodeClaims {
 public:
  // A new, empty claim; its id (never 0).
  uint64_t Add();
  void Remove(uint64_t id);
  // Claim `id` will charge `projected_bytes` on `node` by the end of its expected length and
  // has charged `charged_bytes` so far.
  void Set(uint64_t id, size_t node, uint64_t projected_bytes, uint64_t charged_bytes);
  // A Stats call to `node` is about to be sent: what the claims have charged by now is in its
  // answer. SawStats(node) once the answer arrived.
  void AskingStats(size_t node);
  void SawStats(size_t node);
  // `node` restarted (a new node id): its process holds none of what the claims charged there.
  void Forget(size_t node);
  // Bytes the claims other than `except` (0 = none excepted) will still charge on `node`
  // beyond its last Stats answer.
  uint64_t Pending(size_t node, uint64_t except = 0) const;
  size_t size() const { return claims_.size(); }

 private:
  struct OnNode {
    uint64_t projected = 0;
    uint64_t charged = 0;
    uint64_t seen = 0;
    uint64_t asking = 0;   // charged when the Stats call in flight was sent
  };
  std::map<uint64_t, std::vector<OnNode>> claims_;
  uint64_t next_id_ = 1;
};

}  // namespace tandem::gpu_worker
