#include "tandem/gpu_worker/window_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::vector<EvictedBlock> SlotRuns(const std::vector<EvictedBlock>& blocks) {
  std::vector<EvictedBlock> runs;
  for (const EvictedBlock& b : blocks) {
    if (!runs.empty() && runs.back().first_slot + runs.back().count == b.first_slot &&
        runs.back().first_pos + runs.back().count == b.first_pos) {
      runs.back().count += b.count;
    } else {
      runs.push_back(b);
    }
  }
  return runs;
}

absl::StatusOr<WindowCache> WindowCache::Create(Backend& backend, const WindowGeometry& geometry,
                                                const WindowOptions& options) {
  if (geometry.num_layers <= 0 || geometry.num_kv_heads <= 0 || geometry.head_dim <= 0) {
    return absl::InvalidArgumentError("window cache: layers, kv heads and head_dim must be > 0");
  }
  if (geometry.dtype != DType::kF32 && geometry.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("window cache: the KV dtype must be f32 or bf16");
  }
  const bool unlimited = options.window == WindowOptions::kUnlimited;
  if (options.block < 1 || options.block > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("window cache: block must be in 1..4096, got ", options.block));
  }
  if (options.max_chunk < 1 || options.max_context < 1 || options.sink < 0) {
    return absl::InvalidArgumentError(
        "window cache: max_chunk and max_context must be >= 1 and sink >= 0");
  }
  if (!unlimited && options.window < options.block) {
    return absl::InvalidArgumentError(absl::StrCat("window cache: window (", options.window,
                                                   ") must be at least one block (",
                                                   options.block, ")"));
  }
  WindowCache cache;
  cache.backend_ = &backend;
  cache.geometry_ = geometry;
  cache.options_ = options;
  cache.options_.sink = std::min(options.sink, options.max_context);
  const int64_t sink = cache.options_.sink;
  // The ring must hold everything that is recent between two eviction points: the window plus
  // one forward pass worth of new tokens (evicted blocks always start at a block boundary).
  const int64_t recent_span =
      unlimited ? std::max<int64_t>(options.max_context - sink, 0)
                : std::min(options.window + options.max_chunk, options.max_context);
  cache.ring_blocks_ = std::max<int64_t>(CeilDiv(recent_span, options.block), 1);
  cache.capacity_ = sink + cache.ring_blocks_ * options.block;

  const int64_t per_head = cache.capacity_ * geometry.head_dim;
  const size_t kv_bytes = static_cast<size_t>(geometry.num_layers) * 2 * geometry.num_kv_heads *
                          per_head * DTypeBytes(geometry.dtype);
  TANDEM_ASSIGN_OR_RETURN(cache.kv_, backend.Allocate(kv_bytes));
  const size_t maw_count =
      static_cast<size_t>(geometry.num_layers) * geometry.num_kv_heads * cache.capacity_;
  TANDEM_ASSIGN_OR_RETURN(cache.maw_, backend.Allocate(maw_count * sizeof(float)));
  TANDEM_ASSIGN_OR_RETURN(cache.slot_pos_dev_,
                          backend.Allocate(static_cast<size_t>(cache.capacity_) * 4));
  cache.slot_pos_.assign(cache.capacity_, -1);
  TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(cache.slot_pos_dev_.data(), cache.slot_pos_.data(),
                                              cache.slot_pos_.size() * 4));
  TANDEM_RETURN_IF_ERROR(backend.Fill(cache.maw_.as<float>(), -1.0f, maw_count));
  return cache;
}

size_t WindowCache::BytesFor(const WindowGeometry& geometry, const WindowOptions& options) {
  const bool unlimited = options.window == WindowOptions::kUnlimited;
  if (options.block < 1 || options.max_chunk < 1 || options.max_context < 1 || options.sink < 0 ||
      (!unlimited && options.window < options.block)) {
    return 0;
  }
  // The capacity rule of Create.
  const int64_t sink = std::min(options.sink, options.max_context);
  const int64_t recent_span =
      unlimited ? std::max<int64_t>(options.max_context - sink, 0)
                : std::min(options.window + options.max_chunk, options.max_context);
  const int64_t ring_blocks = std::max<int64_t>(CeilDiv(recent_span, options.block), 1);
  const size_t capacity = static_cast<size_t>(sink + ring_blocks * options.block);
  const size_t per_layer_head = capacity * (2 * geometry.head_dim * DTypeBytes(geometry.dtype) +
                                            sizeof(float));   // K, V and MAW
  return static_cast<size_t>(geometry.num_layers * geometry.num_kv_heads) * per_layer_head +
         capacity * 4;   // + the slot -> position table
}

absl::Status WindowCache::Relayout(const WindowOptions& target) {
  if (parked()) return absl::FailedPreconditionError("window cache: parked (Unpark first)");
  TANDEM_ASSIGN_OR_RETURN(WindowCache dst, Create(*backend_, geometry_, target));
  TANDEM_RETURN_IF_ERROR(CopyPositionsInto(dst, next_pos_));
  dst.configured_window_ = configured_window_;
  // The copies are queued on the device; the old buffers are freed when `dst` replaces them
  // (the backend's free waits for queued work that may still read them).
  *this = std::move(dst);
  return absl::OkStatus();
}

absl::Status WindowCache::CopyPositionsInto(WindowCache& dst, int64_t end) const {
  if (dst.options_.sink != options_.sink || dst.options_.block != options_.block) {
    return absl::InternalError("window cache: a copy keeps the sink and the block");
  }
  // Empty slots below scan_slots are read by the attention (with weight 0): they must hold
  // finite values, and the new ring may leave gaps (0 bits are 0 in f32 and bf16).
  TANDEM_RETURN_IF_ERROR(backend_->Fill(dst.kv_.as<float>(), 0.0f, dst.kv_.bytes() / 4));
  // The positions on the device: the sink, then the recent ones. Each maps to a run of slots
  // in both rings; consecutive positions whose slots are consecutive in both join one run
  // (a ring has at most one wrap, so a few runs cover everything).
  struct Run {
    int64_t src = 0, dst = 0, count = 0;
  };
  std::vector<Run> runs;
  auto add = [&](int64_t first_pos, int64_t count) {
    const int64_t src = SlotOf(first_pos), dst_slot = dst.SlotOf(first_pos);
    if (!runs.empty() && runs.back().src + runs.back().count == src &&
        runs.back().dst + runs.back().count == dst_slot) {
      runs.back().count += count;
    } else {
      runs.push_back({src, dst_slot, count});
    }
  };
  const int64_t sink = options_.sink, block = options_.block;
  if (end > 0 && sink > 0) add(0, std::min(sink, end));
  for (int64_t p = sink + evicted_tokens_; p < end;) {
    // Up to the end of p's block: a block is contiguous in every ring.
    const int64_t count = std::min(block - (p - sink) % block, end - p);
    add(p, count);
    p += count;
  }
  const size_t row_bytes = geometry_.head_dim * DTypeBytes(geometry_.dtype);
  int64_t scan = 0;
  for (const Run& r : runs) {
    for (int64_t l = 0; l < geometry_.num_layers; ++l) {
      for (int64_t h = 0; h < geometry_.num_kv_heads; ++h) {
        const size_t src_off = (h * capacity_ + r.src) * row_bytes;
        const size_t dst_off = (h * dst.capacity_ + r.dst) * row_bytes;
        TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(static_cast<char*>(dst.k(l)) + dst_off,
                                                      static_cast<const char*>(k(l)) + src_off,
                                                      r.count * row_bytes));
        TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(static_cast<char*>(dst.v(l)) + dst_off,
                                                      static_cast<const char*>(v(l)) + src_off,
                                                      r.count * row_bytes));
        TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(dst.maw(l) + h * dst.capacity_ + r.dst,
                                                      maw(l) + h * capacity_ + r.src,
                                                      r.count * sizeof(float)));
      }
    }
    std::copy_n(slot_pos_.begin() + r.src, r.count, dst.slot_pos_.begin() + r.dst);
    scan = std::max(scan, r.dst + r.count);
  }
  TANDEM_RETURN_IF_ERROR(backend_->CopyToDevice(dst.slot_pos_dev_.data(), dst.slot_pos_.data(),
                                                dst.slot_pos_.size() * 4));
  dst.scan_slots_ = scan;
  dst.next_pos_ = end;
  dst.evicted_tokens_ = evicted_tokens_;
  return absl::OkStatus();
}

absl::StatusOr<WindowOptions> WindowCache::ForkOptions(int64_t positions,
                                                       int64_t max_context) const {
  if (parked()) return absl::FailedPreconditionError("window cache: parked (Unpark first)");
  if (positions < 0 || positions > next_pos_) {
    return absl::InvalidArgumentError(absl::StrCat("window cache: fork of ", positions,
                                                   " positions of ", next_pos_));
  }
  if (evicted_tokens_ > 0 && positions < options_.sink + evicted_tokens_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "window cache: cannot fork ", positions, " positions: positions before ",
        options_.sink + evicted_tokens_, " have left the device"));
  }
  if (widened()) {
    return absl::FailedPreconditionError("window cache: a widened window (a prefill) is not forked");
  }
  WindowOptions target = options_;
  target.max_context = std::max(options_.max_context, max_context);
  const int64_t recent = std::max<int64_t>(positions - options_.sink, 0) - evicted_tokens_;
  if (options_.window != WindowOptions::kUnlimited && recent > options_.window) {
    target.window = CeilDiv(recent, options_.block) * options_.block;   // still settling
  }
  return target;
}

absl::StatusOr<size_t> WindowCache::ForkBytes(int64_t positions, int64_t max_context) const {
  TANDEM_ASSIGN_OR_RETURN(const WindowOptions target, ForkOptions(positions, max_context));
  return BytesFor(geometry_, target);
}

absl::StatusOr<WindowCache> WindowCache::Fork(int64_t positions, int64_t max_context) const {
  TANDEM_ASSIGN_OR_RETURN(const WindowOptions target, ForkOptions(positions, max_context));
  TANDEM_ASSIGN_OR_RETURN(WindowCache fork, Create(*backend_, geometry_, target));
  TANDEM_RETURN_IF_ERROR(CopyPositionsInto(fork, positions));
  if (target.window != options_.window) {
    // Narrowed with the prefix's pending blocks on a wider ring: settling, as this one is.
    fork.options_.window = options_.window;
    fork.configured_window_ = options_.window;
  }
  return fork;
}

absl::Status WindowCache::Grow(int64_t max_context) {
  if (max_context <= options_.max_context) return absl::OkStatus();
  if (options_.window != WindowOptions::kUnlimited) {
    return absl::FailedPreconditionError("window cache: only an unlimited window grows");
  }
  WindowOptions grown = options_;
  grown.max_context = max_context;
  return Relayout(grown);
}

absl::Status WindowCache::Widen(int64_t recent_tokens) {
  if (options_.window == WindowOptions::kUnlimited) {
    return absl::FailedPreconditionError("window cache: an unlimited window does not widen");
  }
  if (!settling() && !PendingEvictions().empty()) {
    return absl::FailedPreconditionError("window cache: evictions are pending");
  }
  const int64_t block = options_.block;
  const int64_t wanted = std::min(CeilDiv(recent_tokens, block) * block,
                                  CeilDiv(options_.max_context, block) * block);
  if (wanted <= options_.window) return absl::OkStatus();
  if (settling() && wanted < RecentTokens()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "window cache: a settling ring widens to hold its ", RecentTokens(),
        " recent tokens at least, not ", wanted));
  }
  const int64_t configured = configured_window();
  WindowOptions wide = options_;
  wide.window = wanted;
  TANDEM_RETURN_IF_ERROR(Relayout(wide));
  configured_window_ = configured;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> WindowCache::WidenWithin(int64_t recent_tokens, size_t max_extra_bytes) {
  const int64_t block = options_.block;
  auto extra = [&](int64_t window) {
    WindowOptions o = options_;
    o.window = window;
    const size_t bytes = BytesFor(geometry_, o);
    return bytes > device_bytes() ? bytes - device_bytes() : 0;
  };
  // The widest window (in blocks) whose extra bytes fit: BytesFor grows with the window.
  int64_t lo = options_.window / block, hi = CeilDiv(recent_tokens, block);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (extra(mid * block) <= max_extra_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  for (int64_t w = lo * block; w > options_.window;
       w = options_.window + (w - options_.window) * 7 / 8 / block * block) {
    const absl::Status s = Widen(w);
    if (s.ok()) break;
    if (s.code() != absl::StatusCode::kResourceExhausted) return s;
  }
  return options_.window;
}

absl::Status WindowCache::Narrow() {
  if (configured_window_ == 0) return absl::OkStatus();
  options_.window = configured_window_;
  if (!PendingEvictions().empty()) return absl::OkStatus();   // the last Release shrinks
  return Shrink();
}

absl::Status WindowCache::Shrink() {
  WindowOptions configured = options_;
  configured.window = configured_window_;
  configured_window_ = 0;
  if (absl::Status s = Relayout(configured); !s.ok()) {
    configured_window_ = configured.window;
    return s;
  }
  return absl::OkStatus();
}

int64_t WindowCache::SlotOf(int64_t pos) const {
  const int64_t sink = options_.sink;
  if (pos < sink) return pos;
  const int64_t r = pos - sink;
  const int64_t block = r / options_.block;
  return sink + (block % ring_blocks_) * options_.block + r % options_.block;
}

int64_t WindowCache::RecentTokens() const {
  return std::max<int64_t>(next_pos_ - options_.sink, 0) - evicted_tokens_;
}

absl::StatusOr<const std::vector<int32_t>*> WindowCache::Append(int64_t count) {
  if (parked()) return absl::FailedPreconditionError("window cache: parked (Unpark first)");
  if (count <= 0 || count > options_.max_chunk) {
    return absl::InvalidArgumentError(
        absl::StrCat("window cache: append of ", count, " tokens; must be 1..", options_.max_chunk));
  }
  if (next_pos_ + count > options_.max_context) {
    return absl::FailedPreconditionError(
        absl::StrCat("window cache: ", next_pos_ + count, " positions exceed the context limit ",
                     options_.max_context));
  }
  if (!EvictionsBeforeAppend(count).empty()) {
    return absl::FailedPreconditionError(
        "window cache: the ring is full (the oldest pending evictions must leave first)");
  }
  new_slots_.resize(count);
  int64_t lo = capacity_, hi = -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = SlotOf(next_pos_ + i);
    new_slots_[i] = static_cast<int32_t>(slot);
    slot_pos_[slot] = static_cast<int32_t>(next_pos_ + i);
    lo = std::min(lo, slot);
    hi = std::max(hi, slot);
  }
  next_pos_ += count;
  scan_slots_ = std::max(scan_slots_, hi + 1);
  // New tokens occupy one or two runs of slots (the ring may wrap); upload the covering range.
  TANDEM_RETURN_IF_ERROR(backend_->CopyToDevice(slot_pos_dev_.as<int32_t>() + lo,
                                                slot_pos_.data() + lo, (hi - lo + 1) * 4));
  return &new_slots_;
}

absl::Status WindowCache::EmptySlots(int64_t first_slot, int64_t count) {
  std::fill_n(slot_pos_.begin() + first_slot, count, -1);
  // A slot's MAW starts "fresh" (-1) so its next token takes its first attention weight as is
  // (Create marks every slot fresh; reuse happens only after a release or a truncation).
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    for (int64_t h = 0; h < geometry_.num_kv_heads; ++h) {
      TANDEM_RETURN_IF_ERROR(backend_->Fill(maw(l) + h * capacity_ + first_slot, -1.0f, count));
    }
  }
  return backend_->CopyToDevice(slot_pos_dev_.as<int32_t>() + first_slot,
                                slot_pos_.data() + first_slot, count * 4);
}

absl::Status WindowCache::Truncate(int64_t positions) {
  if (parked()) return absl::FailedPreconditionError("window cache: parked (Unpark first)");
  if (positions < 0 || positions > next_pos_) {
    return absl::InvalidArgumentError(absl::StrCat("window cache: truncate to ", positions,
                                                   " positions of ", next_pos_));
  }
  if (positions == next_pos_) return absl::OkStatus();
  if (evicted_tokens_ > 0 && positions < options_.sink + evicted_tokens_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "window cache: cannot truncate to ", positions, " positions: positions before ",
        options_.sink + evicted_tokens_, " have left the device"));
  }
  // Runs of consecutive slots (a ring wraps at most once per run of positions).
  int64_t pos = positions;
  while (pos < next_pos_) {
    const int64_t first_slot = SlotOf(pos);
    int64_t count = 1;
    while (pos + count < next_pos_ && SlotOf(pos + count) == first_slot + count) ++count;
    TANDEM_RETURN_IF_ERROR(EmptySlots(first_slot, count));
    pos += count;
  }
  next_pos_ = positions;
  return absl::OkStatus();
}

std::vector<EvictedBlock> WindowCache::EvictionsBeforeAppend(int64_t count) const {
  std::vector<EvictedBlock> blocks;
  if (options_.window == WindowOptions::kUnlimited || count <= 0) return blocks;
  // Recent positions [first, next_pos_ + count) must span at most ring_blocks_ blocks (the
  // first starts at a block boundary: evictions leave whole blocks); beyond that, a new
  // position's slot is that of the oldest recent block.
  const int64_t sink = options_.sink, block = options_.block;
  const int64_t first = sink + evicted_tokens_;
  const int64_t end = next_pos_ + count;
  if (end <= sink) return blocks;
  const int64_t spanned = CeilDiv(end - std::max(first, sink), block);
  for (int64_t b = 0; b < spanned - ring_blocks_; ++b) {
    const int64_t pos = first + b * block;
    if (pos >= next_pos_) break;   // a single append larger than the ring (never: max_chunk)
    blocks.push_back({SlotOf(pos), pos, std::min(block, next_pos_ - pos)});
  }
  return blocks;
}

absl::Status WindowCache::Skip(int64_t count) {
  if (count < 0 || count % options_.block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("window cache: skip of ", count,
                                                   " tokens; must be a multiple of the block ",
                                                   options_.block));
  }
  if (options_.window == WindowOptions::kUnlimited) {
    return absl::FailedPreconditionError("window cache: skip needs a bounded window");
  }
  if (next_pos_ < options_.sink || RecentTokens() != 0) {
    return absl::FailedPreconditionError(
        "window cache: skip needs a full sink and no recent tokens on the device");
  }
  if (next_pos_ + count > options_.max_context) {
    return absl::FailedPreconditionError(
        absl::StrCat("window cache: ", next_pos_ + count, " positions exceed the context limit ",
                     options_.max_context));
  }
  next_pos_ += count;
  evicted_tokens_ += count;
  return absl::OkStatus();
}

int64_t WindowCache::eviction_entries() const {
  if (configured_window_ == 0) return entries();
  return std::min(entries(), options_.sink + configured_window_);
}

std::vector<EvictedBlock> WindowCache::PendingEvictions() const {
  std::vector<EvictedBlock> blocks;
  if (options_.window == WindowOptions::kUnlimited) return blocks;
  int64_t recent = RecentTokens();
  int64_t first_pos = options_.sink + evicted_tokens_;
  while (recent > options_.window) {
    blocks.push_back({SlotOf(first_pos), first_pos, options_.block});
    first_pos += options_.block;
    recent -= options_.block;
  }
  return blocks;
}

absl::Status WindowCache::ReadBlocks(int64_t layer, const std::vector<EvictedBlock>& blocks,
                                     void* k_host, void* v_host, float* maw_host) {
  if (layer < 0 || layer >= geometry_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("window cache: layer ", layer));
  }
  int64_t total = 0;
  for (const EvictedBlock& b : blocks) total += b.count;
  const size_t elem = DTypeBytes(geometry_.dtype);
  const size_t row_bytes = geometry_.head_dim * elem;
  int64_t done = 0;
  for (const EvictedBlock& b : SlotRuns(blocks)) {
    // One strided copy per (run of blocks, K|V|MAW) gathers that run of every kv head.
    const size_t src_pitch = capacity_ * row_bytes;
    const size_t dst_pitch = total * row_bytes;
    const size_t offset = b.first_slot * row_bytes;
    TANDEM_RETURN_IF_ERROR(backend_->CopyToHost2D(
        static_cast<char*>(k_host) + done * row_bytes, dst_pitch,
        static_cast<const char*>(k(layer)) + offset, src_pitch, b.count * row_bytes,
        geometry_.num_kv_heads));
    TANDEM_RETURN_IF_ERROR(backend_->CopyToHost2D(
        static_cast<char*>(v_host) + done * row_bytes, dst_pitch,
        static_cast<const char*>(v(layer)) + offset, src_pitch, b.count * row_bytes,
        geometry_.num_kv_heads));
    TANDEM_RETURN_IF_ERROR(backend_->CopyToHost2D(
        maw_host + done, total * sizeof(float), maw(layer) + b.first_slot,
        capacity_ * sizeof(float), b.count * sizeof(float), geometry_.num_kv_heads));
    done += b.count;
  }
  for (int64_t i = 0; i < geometry_.num_kv_heads * total; ++i) {
    maw_host[i] = std::max(maw_host[i], 0.0f);
  }
  return absl::OkStatus();
}

absl::Status WindowCache::Release(const std::vector<EvictedBlock>& blocks) {
  for (const EvictedBlock& b : SlotRuns(blocks)) {
    if (b.first_pos != options_.sink + evicted_tokens_) {
      return absl::FailedPreconditionError("window cache: blocks must be released oldest first");
    }
    TANDEM_RETURN_IF_ERROR(EmptySlots(b.first_slot, b.count));
    evicted_tokens_ += b.count;
  }
  // After Narrow(): once the blocks beyond the configured window have left, the ring shrinks.
  if (configured_window_ > 0 && options_.window == configured_window_ &&
      PendingEvictions().empty()) {
    return Shrink();
  }
  return absl::OkStatus();
}

size_t WindowCache::ParkBytes() const {
  const size_t per_layer_head = static_cast<size_t>(scan_slots_) *
                                (2 * geometry_.head_dim * DTypeBytes(geometry_.dtype) +
                                 sizeof(float));   // K, V and MAW
  return static_cast<size_t>(geometry_.num_layers * geometry_.num_kv_heads) * per_layer_head;
}

absl::Status WindowCache::Park(ParkingPool& pool) {
  if (parked()) return absl::FailedPreconditionError("window cache: already parked");
  if (widened() || settling()) {
    return absl::FailedPreconditionError(
        "window cache: a widened or settling window is not parked (its slots are moving)");
  }
  TANDEM_ASSIGN_OR_RETURN(ParkingSpace space, pool.Take(ParkBytes()));
  // Host layout: K and V rows [layers][K|V][heads][scan_slots · D], then MAW rows
  // [layers][heads][scan_slots]; a (layer, head)'s used slots are one contiguous row, a tensor's
  // heads one strided copy.
  const size_t row_bytes = geometry_.head_dim * DTypeBytes(geometry_.dtype);
  const size_t used = scan_slots_ * row_bytes, maw_used = scan_slots_ * sizeof(float);
  const int64_t heads = geometry_.num_kv_heads;
  size_t offset = 0;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    for (const void* tensor : {k(l), v(l)}) {
      TANDEM_RETURN_IF_ERROR(
          space.CopyRowsFromDevice(offset, tensor, capacity_ * row_bytes, used, heads));
      offset += heads * used;
    }
  }
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(
        space.CopyRowsFromDevice(offset, maw(l), capacity_ * sizeof(float), maw_used, heads));
    offset += heads * maw_used;
  }
  parked_ = std::move(space);
  kv_ = DeviceBuffer();
  maw_ = DeviceBuffer();
  slot_pos_dev_ = DeviceBuffer();
  return absl::OkStatus();
}

absl::Status WindowCache::Unpark() {
  if (!parked()) return absl::FailedPreconditionError("window cache: not parked");
  const size_t row_bytes = geometry_.head_dim * DTypeBytes(geometry_.dtype);
  const int64_t heads = geometry_.num_kv_heads;
  const size_t maw_count = static_cast<size_t>(geometry_.num_layers) * heads * capacity_;
  TANDEM_ASSIGN_OR_RETURN(
      DeviceBuffer kv,
      backend_->Allocate(static_cast<size_t>(geometry_.num_layers) * 2 * heads * capacity_ *
                         row_bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer maw_dev, backend_->Allocate(maw_count * sizeof(float)));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer slot_pos, backend_->Allocate(capacity_ * 4));
  kv_ = std::move(kv);
  maw_ = std::move(maw_dev);
  slot_pos_dev_ = std::move(slot_pos);
  // Slots past scan_slots were never written: their MAW starts fresh, as in Create.
  TANDEM_RETURN_IF_ERROR(backend_->Fill(maw_.as<float>(), -1.0f, maw_count));
  TANDEM_RETURN_IF_ERROR(
      backend_->CopyToDevice(slot_pos_dev_.data(), slot_pos_.data(), slot_pos_.size() * 4));
  const size_t used = scan_slots_ * row_bytes, maw_used = scan_slots_ * sizeof(float);
  size_t offset = 0;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    for (void* tensor : {k(l), v(l)}) {
      TANDEM_RETURN_IF_ERROR(
          parked_.CopyRowsToDevice(tensor, capacity_ * row_bytes, offset, used, heads));
      offset += heads * used;
    }
  }
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(
        parked_.CopyRowsToDevice(maw(l), capacity_ * sizeof(float), offset, maw_used, heads));
    offset += heads * maw_used;
  }
  parked_.Release();
  return absl::OkStatus();
}

void* WindowCache::k(int64_t layer) const {
  const size_t per_tensor =
      static_cast<size_t>(geometry_.num_kv_heads) * capacity_ * geometry_.head_dim *
      DTypeBytes(geometry_.dtype);
  return static_cast<char*>(kv_.data()) + 2 * layer * per_tensor;
}

void* WindowCache::v(int64_t layer) const {
  const size_t per_tensor =
      static_cast<size_t>(geometry_.num_kv_heads) * capacity_ * geometry_.head_dim *
      DTypeBytes(geometry_.dtype);
  return static_cast<char*>(kv_.data()) + (2 * layer + 1) * per_tensor;
}

float* WindowCache::maw(int64_t layer) const {
  return maw_.as<float>() + layer * geometry_.num_kv_heads * capacity_;
}

size_t WindowCache::device_bytes() const {
  return kv_.bytes() + maw_.bytes() + slot_pos_dev_.bytes();
}

size_t WindowCache::resident_bytes() const {
  const size_t per_slot = static_cast<size_t>(geometry_.num_layers) * geometry_.num_kv_heads *
                              (2 * geometry_.head_dim * DTypeBytes(geometry_.dtype) +
                               sizeof(float)) +
                          4;   // K, V, MAW and the slot table
  return static_cast<size_t>(capacity_) * per_slot;
}

}  // namespace tandem::gpu_worker
