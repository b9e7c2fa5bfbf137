// ParkingPool: host memory (pinned on cuda) for sessions parked off the device (prefix cache,
// DESIGN "KV reuse across requests"), kept once allocated.
//
// Page-locking costs far more than the copy it enables (cudaMallocHost of 4 GiB takes ~1.5 s
// on the H200 host, the copy ~0.08 s at PCIe speed), so the pool pins slabs of `slab_pages`
// pages of `page_bytes` as parking needs them, up to `max_bytes`, and keeps them for the next
// parked session instead of freeing them. A ParkingSpace is one parked buffer: a logical byte
// range laid over whole pages (at most one page of waste per space), written and read back
// with copies split at page ends.
//
// Not thread-safe: the engine's executor thread owns it with the sessions. It must outlive
// every ParkingSpace it hands out.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker {

class ParkingPool;

// One parked buffer: `bytes()` logical bytes over pool pages; the pages go back to the pool
// when it is destroyed. Move-only.
class ParkingSpace {
 public:
  ParkingSpace() = default;
  ParkingSpace(ParkingSpace&& other) noexcept { *this = std::move(other); }
  ParkingSpace& operator=(ParkingSpace&& other) noexcept;
  ParkingSpace(const ParkingSpace&) = delete;
  ParkingSpace& operator=(const ParkingSpace&) = delete;
  ~ParkingSpace() { Release(); }

  bool held() const { return pool_ != nullptr; }
  size_t bytes() const { return bytes_; }
  size_t held_bytes() const;   // whole pages

  // Device [src, src + count) to logical bytes [offset, offset + count), and back.
  absl::Status CopyFromDevice(size_t offset, const void* src, size_t count);
  absl::Status CopyToDevice(void* dst, size_t offset, size_t count) const;
  // Strided rows (a parked tensor's (layer, head) rows): `rows` device rows of `row_bytes`, row
  // r at src + r·src_pitch, packed at logical bytes [offset, offset + rows·row_bytes); and back,
  // row r to dst + r·dst_pitch. The rows that lie within one page go in one 2D copy
  // (Backend::CopyToHost2D / CopyToDevice2D), a row across a page end in two pieces.
  absl::Status CopyRowsFromDevice(size_t offset, const void* src, size_t src_pitch,
                                  size_t row_bytes, size_t rows);
  absl::Status CopyRowsToDevice(void* dst, size_t dst_pitch, size_t offset, size_t row_bytes,
                                size_t rows) const;

  // The pages back to the pool; the space holds nothing after.
  void Release();

 private:
  friend class ParkingPool;
  ParkingPool* pool_ = nullptr;
  size_t bytes_ = 0;
  std::vector<char*> pages_;
};

class ParkingPool {
 public:
  static constexpr size_t kDefaultPageBytes = size_t{2} << 20;
  // max_bytes: most host bytes the pool pins (0: Take always fails). page_bytes > 0.
  ParkingPool(Backend& backend, size_t max_bytes, size_t page_bytes = kDefaultPageBytes,
              size_t slab_pages = 32);
  ParkingPool(const ParkingPool&) = delete;
  ParkingPool& operator=(const ParkingPool&) = delete;

  // A space of `bytes` (whole pages). RESOURCE_EXHAUSTED when the pages in use and these would
  // pass max_bytes, or the host cannot pin more; nothing is taken then.
  absl::StatusOr<ParkingSpace> Take(size_t bytes);
  // Whole pages a space of `bytes` holds.
  size_t PagesFor(size_t bytes) const { return (bytes + page_bytes_ - 1) / page_bytes_; }

  size_t page_bytes() const { return page_bytes_; }
  size_t max_bytes() const { return max_bytes_; }
  size_t in_use_bytes() const { return (total_pages_ - free_.size()) * page_bytes_; }
  size_t pinned_bytes() const { return total_pages_ * page_bytes_; }
  Backend& backend() const { return *backend_; }

 private:
  friend class ParkingSpace;
  absl::Status Grow(size_t pages);   // pins slabs until `pages` pages are free (within max)

  Backend* backend_;
  size_t max_bytes_;
  size_t page_bytes_;
  size_t slab_pages_;
  std::vector<DeviceBuffer> slabs_;
  std::vector<char*> free_;
  size_t total_pages_ = 0;
};

}  // namespace tandem::gpu_worker
