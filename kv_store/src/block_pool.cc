#include "tandem/kv_store/block_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::kv_store {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockFormat& format,
                                                             uint64_t max_blocks,
                                                             MemoryBudget* budget, bool huge_pages) {
  TANDEM_RETURN_IF_ERROR(format.Validate());
  if (budget == nullptr) return absl::InvalidArgumentError("BlockPool budget is null");
  if (max_blocks == 0) return absl::InvalidArgumentError("BlockPool max_blocks must be > 0");
  // Ids and the bump index are BlockId (uint32_t), so the bump index must reach max_blocks.
  if (max_blocks > std::numeric_limits<BlockId>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockPool max_blocks must be <= ", std::numeric_limits<BlockId>::max(),
                     ", got ", max_blocks));
  }
  const size_t block_bytes = format.block_bytes();
  if (max_blocks > std::numeric_limits<size_t>::max() / block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("BlockPool of ", max_blocks, " blocks of ",
                                                   block_bytes, " bytes overflows size_t"));
  }
  const size_t mapped_bytes = max_blocks * block_bytes;
  // NOTE: MAP_NORESERVE reserves address space only; a page costs memory when first written,
  // so an idle pool of capacity-sized mapping costs nothing.
  void* base = mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    return absl::InternalError(absl::StrCat("mmap of ", FormatBytes(mapped_bytes), " for ",
                                            max_blocks, " blocks failed: ", std::strerror(err)));
  }
  // Best effort: without THP support the pool works the same on 4 KiB pages.
  if (huge_pages) madvise(base, mapped_bytes, MADV_HUGEPAGE);
  return std::unique_ptr<BlockPool>(
      new BlockPool(format, max_blocks, budget, static_cast<std::byte*>(base), mapped_bytes));
}

BlockPool::BlockPool(const BlockFormat& format, uint64_t max_blocks, MemoryBudget* budget,
                     std::byte* base, size_t mapped_bytes)
    : format_(format),
      max_blocks_(max_blocks),
      budget_(budget),
      base_(base),
      mapped_bytes_(mapped_bytes) {}

BlockPool::~BlockPool() {
  // Blocks still referenced at destruction (their owners outlived the pool, a programmer
  // error) still return their bytes so the budget stays balanced.
  if (in_use_ > 0) budget_->Release(in_use_ * format_.block_bytes());
  munmap(base_, mapped_bytes_);
}

absl::StatusOr<BlockId> BlockPool::Allocate() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto has_free = [this] {
    return !free_resident_.empty() || !free_released_.empty() || next_unused_ < max_blocks_;
  };
  // Blocks in a ReleaseFreeBlocks call are free but in no list for a moment: wait for them
  // rather than report a full pool.
  released_cv_.wait(lock, [&] { return has_free() || in_transit_ == 0; });
  if (!has_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("block pool full: all ", max_blocks_, " blocks of ",
                     FormatBytes(format_.block_bytes()), " (block_tokens ", format_.block_tokens,
                     ", head_dim ", format_.head_dim, ") are in use"));
  }
  TANDEM_RETURN_IF_ERROR(budget_->Charge(format_.block_bytes()));
  BlockId id;
  if (!free_resident_.empty()) {
    id = free_resident_.back().first;
    free_resident_.pop_back();
  } else if (!free_released_.empty()) {
    id = free_released_.back();
    free_released_.pop_back();
  } else {
    id = next_unused_++;
    refcounts_.push_back(0);  // amortised O(1); grows with the bump index only
  }
  assert(refcounts_[id] == 0);
  refcounts_[id] = 1;
  ++in_use_;
  return id;
}

absl::StatusOr<std::vector<BlockId>> BlockPool::AllocateMany(uint64_t count) {
  std::vector<BlockId> ids;
  if (count == 0) return ids;
  ids.reserve(count);
  std::vector<BlockId> cold;   // ids of ids without pages: released, or never handed out
  {
    std::unique_lock<std::mutex> lock(mu_);
    const auto available = [this] {
      return free_resident_.size() + free_released_.size() + (max_blocks_ - next_unused_);
    };
    // As Allocate: blocks in a ReleaseFreeBlocks call are waited for, not counted as missing.
    released_cv_.wait(lock, [&] { return available() >= count || in_transit_ == 0; });
    if (available() < count) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "block pool full: ", count, " blocks of ", FormatBytes(format_.block_bytes()),
          " (block_tokens ", format_.block_tokens, ", head_dim ", format_.head_dim,
          ") asked, ", available(), " of ", max_blocks_, " free"));
    }
    TANDEM_RETURN_IF_ERROR(budget_->Charge(count * format_.block_bytes()));
    while (ids.size() < count && !free_resident_.empty()) {
      ids.push_back(free_resident_.back().first);
      free_resident_.pop_back();
    }
    TakeColdLocked(count - ids.size(), cold);
    ids.insert(ids.end(), cold.begin(), cold.end());
    for (BlockId id : ids) {
      assert(refcounts_[id] == 0);
      refcounts_[id] = 1;
    }
    in_use_ += count;
  }
  std::sort(cold.begin(), cold.end());
  Populate(cold);
  return ids;
}

void BlockPool::TakeColdLocked(uint64_t n, std::vector<BlockId>& out) {
  for (; n > 0 && !free_released_.empty(); --n) {
    out.push_back(free_released_.back());
    free_released_.pop_back();
  }
  for (; n > 0 && next_unused_ < max_blocks_; --n) {
    out.push_back(next_unused_++);
    refcounts_.push_back(0);
  }
}

void BlockPool::Populate(std::span<const BlockId> ids) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23   // Linux 5.14; older kernels answer EINVAL and fault on write
#endif
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t block_bytes = format_.block_bytes();
  const auto base = reinterpret_cast<uintptr_t>(base_);
  for (size_t i = 0; i < ids.size();) {
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1) ++j;
    const uintptr_t first_page = (base + size_t{ids[i]} * block_bytes) / page * page;
    const uintptr_t end = base + (size_t{ids[j - 1]} + 1) * block_bytes;
    const uintptr_t last_page = (end + page - 1) / page * page;
    // Best effort: a failure leaves the pages to fault in on first write, as before.
    if (madvise(reinterpret_cast<void*>(first_page), last_page - first_page,
                MADV_POPULATE_WRITE) != 0 &&
        errno == EINVAL) {
      return;   // the kernel lacks it: no other run will do better
    }
    i = j;
  }
}

void BlockPool::Ref(BlockId id) {
  std::lock_guard<std::mutex> lock(mu_);
  assert(id < next_unused_ && refcounts_[id] > 0 && "Ref of a free block");
  ++refcounts_[id];
}

void BlockPool::Unref(BlockId id) {
  std::lock_guard<std::mutex> lock(mu_);
  assert(id < next_unused_ && refcounts_[id] > 0 && "Unref of a free block");
  if (--refcounts_[id] == 0) {
    free_resident_.emplace_back(id, Clock::now());
    --in_use_;
    budget_->Release(format_.block_bytes());
  }
}

uint32_t BlockPool::refcount(BlockId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return id < next_unused_ ? refcounts_[id] : 0;
}

uint64_t BlockPool::blocks_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

uint64_t BlockPool::blocks_touched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_unused_;
}

uint64_t BlockPool::blocks_resident() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_unused_ - free_released_.size() - in_transit_;
}

uint64_t BlockPool::ReleaseFreeBlocks(std::chrono::steady_clock::time_point freed_before) {
  std::vector<BlockId> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // While blocks are in use the newest warm_reserve_ stay (an idle pool empties out).
    while (!free_resident_.empty() && free_resident_.front().second < freed_before &&
           (in_use_ == 0 || free_resident_.size() > warm_reserve_)) {
      ids.push_back(free_resident_.front().first);
      free_resident_.pop_front();
    }
    if (ids.empty()) return 0;
    in_transit_ += ids.size();
  }
  // Runs of adjacent ids are one range; only pages wholly inside a range are released (the
  // others hold bytes of blocks that may be in use).
  std::sort(ids.begin(), ids.end());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t block_bytes = format_.block_bytes();
  const auto base = reinterpret_cast<uintptr_t>(base_);
  uint64_t released = 0;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1) ++j;
    const uintptr_t begin = base + size_t{ids[i]} * block_bytes;
    const uintptr_t end = base + (size_t{ids[j - 1]} + 1) * block_bytes;
    const uintptr_t first_page = (begin + page - 1) / page * page;
    const uintptr_t last_page = end / page * page;
    if (last_page > first_page &&
        madvise(reinterpret_cast<void*>(first_page), last_page - first_page, MADV_DONTNEED) == 0) {
      released += last_page - first_page;
    }
    i = j;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_released_.insert(free_released_.end(), ids.begin(), ids.end());
    in_transit_ -= ids.size();
  }
  released_cv_.notify_all();
  return released;
}

void BlockPool::SetWarmReserve(uint64_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  warm_reserve_ = blocks;
}

uint64_t BlockPool::warm_reserve() const {
  std::lock_guard<std::mutex> lock(mu_);
  return warm_reserve_;
}

uint64_t BlockPool::WarmFreeBlocks(uint64_t at_most) {
  std::vector<BlockId> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Blocks in transit may be a release under way: they are not counted as warm here, so a
    // reserve is never warmed past by more than one call's blocks.
    const uint64_t have = free_resident_.size() + in_transit_;
    if (in_use_ == 0 || have >= warm_reserve_) return 0;
    // No more resident free blocks than the budget could still hand out.
    const uint64_t chargeable = budget_->free() / format_.block_bytes();
    if (chargeable <= have) return 0;
    TakeColdLocked(std::min({at_most, warm_reserve_ - have, chargeable - have}), ids);
    if (ids.empty()) return 0;
    in_transit_ += ids.size();
  }
  std::sort(ids.begin(), ids.end());
  Populate(ids);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (BlockId id : ids) free_resident_.emplace_back(id, now);
    in_transit_ -= ids.size();
  }
  released_cv_.notify_all();
  return ids.size();
}

}  // namespace tandem::kv_store
