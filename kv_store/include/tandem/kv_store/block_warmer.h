// BlockWarmer: a thread that keeps a KvStore's block pools at their warm reserves
// (BlockPool::SetWarmReserve), off the appends' path.
//
// KvStore::Append wakes it once the pools have handed out blocks; it then faults in a batch of
// free blocks per pool at a time (BlockPool::WarmFreeBlocks: one MADV_POPULATE_WRITE per run of
// ids) until every pool is back at its reserve, and sleeps. It runs at nice 10, so the node's
// attention threads come first; its populate runs at ~4 GB/s on one core of the H200 host,
// above what a worker's settle appends in a sustained way.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace tandem::kv_store {

class KvStore;

class BlockWarmer {
 public:
  // `store` must outlive this object.
  explicit BlockWarmer(KvStore& store);
  ~BlockWarmer();   // stops and joins the thread
  BlockWarmer(const BlockWarmer&) = delete;
  BlockWarmer& operator=(const BlockWarmer&) = delete;

  // Asks for a pass over the pools (cheap; a pass under way takes the request with it).
  void Wake();
  uint64_t warmed_blocks() const;   // blocks faulted in so far

 private:
  void Loop();

  KvStore& store_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;      // guarded by mu_
  bool woken_ = false;     // guarded by mu_
  uint64_t warmed_ = 0;    // guarded by mu_
  std::thread thread_;     // last: starts after the members it reads
};

}  // namespace tandem::kv_store
