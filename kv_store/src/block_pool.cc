#include "tandem/kv_store/block_pool.h"

#include <sys/mman.h>

#include <cassert>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::kv_store {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockFormat& format,
                                                             uint64_t max_blocks,
                                                             MemoryBudget* budget) {
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
    return absl::InternalError(absl::StrCat("mmap of ", mapped_bytes, " bytes for ", max_blocks,
                                            " blocks failed: ", std::strerror(err)));
  }
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
  std::lock_guard<std::mutex> lock(mu_);
  if (free_list_.empty() && next_unused_ >= max_blocks_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("block pool full: all ", max_blocks_, " blocks of ", format_.block_bytes(),
                     " bytes (block_tokens ", format_.block_tokens, ", head_dim ", format_.head_dim,
                     ") are in use"));
  }
  TANDEM_RETURN_IF_ERROR(budget_->Charge(format_.block_bytes()));
  BlockId id;
  if (!free_list_.empty()) {
    id = free_list_.back();
    free_list_.pop_back();
  } else {
    id = next_unused_++;
    refcounts_.push_back(0);  // amortised O(1); grows with the bump index only
  }
  assert(refcounts_[id] == 0);
  refcounts_[id] = 1;
  ++in_use_;
  return id;
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
    free_list_.push_back(id);
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

}  // namespace tandem::kv_store
