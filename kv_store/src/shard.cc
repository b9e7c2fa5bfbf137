#include "tandem/kv_store/shard.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::kv_store {
namespace {

constexpr size_t kAlignment = 64;  // cache line; also what AVX-512 loads like

constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUp(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

size_t RoundUpToAlignment(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

std::atomic<uint64_t> next_shard_serial{1};

}  // namespace

// ---------------------------------------------------------------------------------------------
// BudgetedBuffer

BudgetedBuffer::~BudgetedBuffer() { Clear(); }

absl::Status BudgetedBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  const size_t exact = RoundUpToAlignment(bytes);
  const size_t geometric = std::max(exact, 2 * capacity_);
  if (geometric > exact && GrowTo(geometric).ok()) return absl::OkStatus();
  return GrowTo(exact);
}

absl::Status BudgetedBuffer::GrowTo(size_t new_capacity) {
  assert(new_capacity > capacity_ && new_capacity % kAlignment == 0);
  // The old capacity is already charged; only the growth is. NOTE: during the copy both
  // buffers exist, so physical memory briefly exceeds the charge by the old capacity.
  const size_t growth = new_capacity - capacity_;
  TANDEM_RETURN_IF_ERROR(budget_->Charge(growth));
  // Large copies are what Attend streams through: align them to 2 MiB and ask for transparent
  // huge pages, so a scan of a long head does not walk a 4 KiB page table entry per page.
  const bool huge = new_capacity >= kHugePage;
  auto* data = static_cast<std::byte*>(std::aligned_alloc(
      huge ? kHugePage : kAlignment, huge ? RoundUp(new_capacity, kHugePage) : new_capacity));
  if (huge && data != nullptr) madvise(data, RoundUp(new_capacity, kHugePage), MADV_HUGEPAGE);
  if (data == nullptr) {
    budget_->Release(growth);
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating a ", FormatBytes(new_capacity), " selected-copy buffer failed"));
  }
  // The buffer does not track its size, so the whole old capacity is kept (at most 2x the
  // live bytes under geometric growth).
  if (capacity_ > 0) std::memcpy(data, data_, capacity_);
  std::free(data_);
  data_ = data;
  capacity_ = new_capacity;
  return absl::OkStatus();
}

void BudgetedBuffer::Clear() {
  if (data_ == nullptr) return;
  std::free(data_);
  budget_->Release(capacity_);
  data_ = nullptr;
  capacity_ = 0;
}

// ---------------------------------------------------------------------------------------------
// Shard

Shard::Shard(BlockPool* pool, MemoryBudget* budget)
    : pool_(pool),
      budget_(budget),
      serial_(next_shard_serial.fetch_add(1, std::memory_order_relaxed)),
      sel_k_(budget),
      sel_v_(budget) {}

Shard::~Shard() {
  for (BlockId id : blocks_) pool_->Unref(id);
}

uint32_t Shard::block_entries(size_t i) const {
  const uint64_t bt = format().block_tokens;
  if (i + 1 < blocks_.size()) return static_cast<uint32_t>(bt);
  return static_cast<uint32_t>(held_ - i * bt);
}

absl::Status Shard::ReserveSelected(uint64_t rows) {
  const size_t bytes = rows * format().row_bytes();
  const size_t exact = RoundUpToAlignment(bytes);
  // K and V always get the same request, so compute both targets up front and pick geometric
  // growth only if both fit; otherwise K's doubling could starve V.
  auto target = [&](const BudgetedBuffer& b, bool geometric) -> size_t {
    if (bytes <= b.capacity()) return b.capacity();
    return geometric ? std::max(exact, 2 * b.capacity()) : exact;
  };
  auto growth = [&](bool geometric) {
    return (target(sel_k_, geometric) - sel_k_.capacity()) +
           (target(sel_v_, geometric) - sel_v_.capacity());
  };
  if (growth(false) == 0) return absl::OkStatus();
  const uint64_t free = budget_->free();
  const bool geometric = growth(true) <= free;
  if (!geometric && growth(false) > free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "memory budget exhausted: the selected copy of ", rows, " rows x ", format().row_bytes(),
        " bytes (K and V) needs ", FormatBytes(growth(false)), " more with ",
        FormatBytes(budget_->used()), " of ", FormatBytes(budget_->capacity()), " used"));
  }
  const size_t k_target = target(sel_k_, geometric);
  const size_t v_target = target(sel_v_, geometric);
  if (k_target > sel_k_.capacity()) TANDEM_RETURN_IF_ERROR(sel_k_.GrowTo(k_target));
  if (v_target > sel_v_.capacity()) TANDEM_RETURN_IF_ERROR(sel_v_.GrowTo(v_target));
  return absl::OkStatus();
}

void Shard::CopyOnWriteLastBlock(BlockId fresh) {
  const BlockId shared = blocks_.back();
  const size_t rows = held_ % format().block_tokens;
  const size_t row = format().row_bytes();
  std::memcpy(pool_->k(fresh), pool_->k(shared), rows * row);
  std::memcpy(pool_->v(fresh), pool_->v(shared), rows * row);
  std::memcpy(pool_->maw(fresh), pool_->maw(shared), rows * sizeof(float));
  blocks_.back() = fresh;
  pool_->Unref(shared);
}

absl::StatusOr<uint64_t> Shard::Append(const std::byte* k, const std::byte* v, const float* maw,
                                       uint64_t n, SelectRule rule) {
  return AppendImpl(k, v, maw, n, [maw, rule](uint64_t i) { return rule.Selects(maw[i]); });
}

absl::StatusOr<uint64_t> Shard::AppendWithSelection(const std::byte* k, const std::byte* v,
                                                    const float* maw, const uint8_t* selected,
                                                    uint64_t n) {
  return AppendImpl(k, v, maw, n, [selected](uint64_t i) { return selected[i] != 0; });
}

absl::StatusOr<uint64_t> Shard::AppendImpl(const std::byte* k, const std::byte* v, const float* maw,
                                           uint64_t n, absl::FunctionRef<bool(uint64_t)> selects) {
  if (n == 0) return uint64_t{0};
  const uint64_t bt = format().block_tokens;
  const size_t row = format().row_bytes();

  // Plan: rows still free in the last block, whether it must be copied first, new blocks.
  const uint64_t used_in_last = held_ % bt;  // 0: no partial last block
  const uint64_t room = used_in_last == 0 ? 0 : bt - used_in_last;
  const bool cow = used_in_last != 0 && pool_->refcount(blocks_.back()) > 1;
  const uint64_t fresh_blocks = n > room ? CeilDiv(n - room, bt) : 0;
  uint64_t selected = 0;
  for (uint64_t i = 0; i < n; ++i) selected += selects(i) ? 1 : 0;

  // Everything that can fail happens before the shard changes (all-or-nothing). The fresh
  // blocks come in one pool call, their pages faulted in (BlockPool::AllocateMany).
  TANDEM_ASSIGN_OR_RETURN(std::vector<BlockId> fresh,
                          pool_->AllocateMany(fresh_blocks + (cow ? 1 : 0)));
  if (absl::Status s = ReserveSelected(selected_count_ + selected); !s.ok()) {
    for (BlockId id : fresh) pool_->Unref(id);
    return s;
  }

  size_t next_fresh = 0;
  if (cow) CopyOnWriteLastBlock(fresh[next_fresh++]);
  const uint64_t old_held = held_;
  // One memcpy per (block, K|V|MAW): input rows are contiguous [n, head_dim], and so are a
  // block's rows.
  for (uint64_t done = 0; done < n;) {
    if (held_ % bt == 0) blocks_.push_back(fresh[next_fresh++]);
    const BlockId b = blocks_.back();
    const uint64_t r = held_ % bt;
    const uint64_t c = std::min(bt - r, n - done);
    std::memcpy(pool_->k(b) + r * row, k + done * row, c * row);
    std::memcpy(pool_->v(b) + r * row, v + done * row, c * row);
    std::memcpy(pool_->maw(b) + r, maw + done, c * sizeof(float));
    held_ += c;
    done += c;
  }
  assert(next_fresh == fresh.size());

  // Selected copy: runs of consecutive selected entries are copied with one memcpy each.
  selected_flags_.resize(held_, 0);
  for (uint64_t i = 0; i < n;) {
    if (!selects(i)) {
      ++i;
      continue;
    }
    uint64_t j = i;
    while (j < n && selects(j)) selected_flags_[old_held + j++] = 1;
    std::memcpy(sel_k_.data() + selected_count_ * row, k + i * row, (j - i) * row);
    std::memcpy(sel_v_.data() + selected_count_ * row, v + i * row, (j - i) * row);
    selected_count_ += j - i;
    i = j;
  }
  return selected;
}

absl::Status Shard::ReadEntries(uint64_t first, uint64_t n, std::byte* k, std::byte* v, float* maw,
                                uint8_t* selected) const {
  if (first > held_ || n > held_ - first) {
    return absl::OutOfRangeError(absl::StrCat("entries [", first, ", ", first + n,
                                              ") are not all held: the shard holds ", held_));
  }
  if (n == 0) return absl::OkStatus();
  const uint64_t bt = format().block_tokens;
  const size_t row = format().row_bytes();
  // One memcpy per (block, K|V|MAW), as in Append.
  for (uint64_t done = 0; done < n;) {
    const uint64_t entry = first + done;
    const size_t b = entry / bt;
    const uint64_t r = entry % bt;
    const uint64_t c = std::min(bt - r, n - done);
    std::memcpy(k + done * row, block_k(b) + r * row, c * row);
    std::memcpy(v + done * row, block_v(b) + r * row, c * row);
    std::memcpy(maw + done, block_maw(b) + r, c * sizeof(float));
    done += c;
  }
  std::memcpy(selected, selected_flags_.data() + first, n);
  return absl::OkStatus();
}

absl::Status Shard::ShareFrom(const Shard& parent, uint64_t prefix) {
  if (held_ != 0 || !blocks_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ShareFrom needs an empty shard, this one holds ", held_, " entries"));
  }
  if (parent.pool_ != pool_) {
    return absl::InvalidArgumentError("ShareFrom across different block pools (formats differ)");
  }
  if (prefix > parent.held_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ShareFrom prefix ", prefix, " exceeds the parent's held entries ", parent.held_));
  }
  if (prefix == 0) return absl::OkStatus();
  const uint64_t selected = static_cast<uint64_t>(
      std::count_if(parent.selected_flags_.begin(), parent.selected_flags_.begin() + prefix,
                    [](uint8_t f) { return f != 0; }));
  TANDEM_RETURN_IF_ERROR(ReserveSelected(selected));

  const uint64_t num_blocks = CeilDiv(prefix, format().block_tokens);
  blocks_.assign(parent.blocks_.begin(), parent.blocks_.begin() + num_blocks);
  for (BlockId id : blocks_) pool_->Ref(id);
  held_ = prefix;
  selected_flags_.assign(parent.selected_flags_.begin(), parent.selected_flags_.begin() + prefix);
  // The parent's copy is in entry order, so the prefix's selected rows are its first rows.
  if (selected > 0) {
    const size_t bytes = selected * format().row_bytes();
    std::memcpy(sel_k_.data(), parent.sel_k_.data(), bytes);
    std::memcpy(sel_v_.data(), parent.sel_v_.data(), bytes);
  }
  selected_count_ = selected;
  return absl::OkStatus();
}

void Shard::Truncate(uint64_t held) {
  if (held >= held_) return;
  const uint64_t keep_blocks = CeilDiv(held, format().block_tokens);
  for (size_t i = keep_blocks; i < blocks_.size(); ++i) pool_->Unref(blocks_[i]);
  blocks_.resize(keep_blocks);
  // The copy is in entry order: dropping the tail's selected entries drops its last rows.
  const uint64_t dropped = static_cast<uint64_t>(std::count_if(
      selected_flags_.begin() + held, selected_flags_.end(), [](uint8_t f) { return f != 0; }));
  selected_count_ -= dropped;
  selected_flags_.resize(held);
  held_ = held;
}

absl::Status Shard::SetSelection(std::span<const uint8_t> selected) {
  if (selected.size() != held_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SetSelection got ", selected.size(), " flags for a shard holding ", held_, " entries"));
  }
  const uint64_t count = static_cast<uint64_t>(
      std::count_if(selected.begin(), selected.end(), [](uint8_t f) { return f != 0; }));
  TANDEM_RETURN_IF_ERROR(ReserveSelected(count));

  // Gather from the blocks, one memcpy per run of consecutive selected rows within a block.
  const size_t row = format().row_bytes();
  const uint64_t bt = format().block_tokens;
  uint64_t out = 0;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const uint64_t entries = block_entries(b);
    const uint64_t base = b * bt;
    for (uint64_t r = 0; r < entries;) {
      if (selected[base + r] == 0) {
        ++r;
        continue;
      }
      uint64_t e = r;
      while (e < entries && selected[base + e] != 0) ++e;
      std::memcpy(sel_k_.data() + out * row, block_k(b) + r * row, (e - r) * row);
      std::memcpy(sel_v_.data() + out * row, block_v(b) + r * row, (e - r) * row);
      out += e - r;
      r = e;
    }
  }
  assert(out == count);
  for (uint64_t i = 0; i < held_; ++i) selected_flags_[i] = selected[i] != 0 ? 1 : 0;
  selected_count_ = count;
  return absl::OkStatus();
}

}  // namespace tandem::kv_store
