#include "tandem/gpu_worker/parking_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

ParkingSpace& ParkingSpace::operator=(ParkingSpace&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    bytes_ = other.bytes_;
    pages_ = std::move(other.pages_);
    other.pool_ = nullptr;
    other.bytes_ = 0;
    other.pages_.clear();
  }
  return *this;
}

size_t ParkingSpace::held_bytes() const {
  return pool_ == nullptr ? 0 : pages_.size() * pool_->page_bytes();
}

void ParkingSpace::Release() {
  if (pool_ != nullptr) {
    pool_->free_.insert(pool_->free_.end(), pages_.begin(), pages_.end());
  }
  pool_ = nullptr;
  bytes_ = 0;
  pages_.clear();
}

absl::Status ParkingSpace::CopyFromDevice(size_t offset, const void* src, size_t count) {
  if (pool_ == nullptr || offset + count > bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("parking space: bytes [", offset, ", ",
                                                   offset + count, ") of ", bytes_));
  }
  const size_t page = pool_->page_bytes();
  const char* from = static_cast<const char*>(src);
  while (count > 0) {
    const size_t in_page = offset % page, piece = std::min(count, page - in_page);
    TANDEM_RETURN_IF_ERROR(
        pool_->backend().CopyToHost(pages_[offset / page] + in_page, from, piece));
    offset += piece;
    from += piece;
    count -= piece;
  }
  return absl::OkStatus();
}

absl::Status ParkingSpace::CopyToDevice(void* dst, size_t offset, size_t count) const {
  if (pool_ == nullptr || offset + count > bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("parking space: bytes [", offset, ", ",
                                                   offset + count, ") of ", bytes_));
  }
  const size_t page = pool_->page_bytes();
  char* to = static_cast<char*>(dst);
  while (count > 0) {
    const size_t in_page = offset % page, piece = std::min(count, page - in_page);
    TANDEM_RETURN_IF_ERROR(
        pool_->backend().CopyToDevice(to, pages_[offset / page] + in_page, piece));
    offset += piece;
    to += piece;
    count -= piece;
  }
  return absl::OkStatus();
}

absl::Status ParkingSpace::CopyRowsFromDevice(size_t offset, const void* src, size_t src_pitch,
                                              size_t row_bytes, size_t rows) {
  if (pool_ == nullptr || offset + rows * row_bytes > bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("parking space: ", rows, " rows of ", row_bytes,
                                                   " bytes at ", offset, " of ", bytes_));
  }
  const size_t page = pool_->page_bytes();
  const char* from = static_cast<const char*>(src);
  for (size_t r = 0; r < rows && row_bytes > 0;) {
    const size_t at = offset + r * row_bytes, in_page = at % page;
    const size_t whole = std::min(rows - r, (page - in_page) / row_bytes);   // rows in this page
    if (whole == 0) {   // row r crosses a page end
      TANDEM_RETURN_IF_ERROR(CopyFromDevice(at, from + r * src_pitch, row_bytes));
      ++r;
      continue;
    }
    TANDEM_RETURN_IF_ERROR(pool_->backend().CopyToHost2D(pages_[at / page] + in_page, row_bytes,
                                                         from + r * src_pitch, src_pitch,
                                                         row_bytes, whole));
    r += whole;
  }
  return absl::OkStatus();
}

absl::Status ParkingSpace::CopyRowsToDevice(void* dst, size_t dst_pitch, size_t offset,
                                            size_t row_bytes, size_t rows) const {
  if (pool_ == nullptr || offset + rows * row_bytes > bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("parking space: ", rows, " rows of ", row_bytes,
                                                   " bytes at ", offset, " of ", bytes_));
  }
  const size_t page = pool_->page_bytes();
  char* to = static_cast<char*>(dst);
  for (size_t r = 0; r < rows && row_bytes > 0;) {
    const size_t at = offset + r * row_bytes, in_page = at % page;
    const size_t whole = std::min(rows - r, (page - in_page) / row_bytes);
    if (whole == 0) {
      TANDEM_RETURN_IF_ERROR(CopyToDevice(to + r * dst_pitch, at, row_bytes));
      ++r;
      continue;
    }
    TANDEM_RETURN_IF_ERROR(pool_->backend().CopyToDevice2D(to + r * dst_pitch, dst_pitch,
                                                           pages_[at / page] + in_page, row_bytes,
                                                           row_bytes, whole));
    r += whole;
  }
  return absl::OkStatus();
}

ParkingPool::ParkingPool(Backend& backend, size_t max_bytes, size_t page_bytes,
                         size_t slab_pages)
    : backend_(&backend),
      max_bytes_(max_bytes),
      page_bytes_(std::max<size_t>(page_bytes, 1)),
      slab_pages_(std::max<size_t>(slab_pages, 1)) {}

absl::Status ParkingPool::Grow(size_t pages) {
  const size_t max_pages = max_bytes_ / page_bytes_;
  while (free_.size() < pages) {
    const size_t slab = std::min(slab_pages_, max_pages - total_pages_);
    absl::StatusOr<DeviceBuffer> buffer = backend_->AllocateHost(slab * page_bytes_);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("parking pool: pinning ", FormatBytes(slab * page_bytes_),
                       " more of host memory failed: ", buffer.status().message()));
    }
    for (size_t i = 0; i < slab; ++i) free_.push_back(buffer->as<char>() + i * page_bytes_);
    total_pages_ += slab;
    slabs_.push_back(std::move(*buffer));
  }
  return absl::OkStatus();
}

absl::StatusOr<ParkingSpace> ParkingPool::Take(size_t bytes) {
  const size_t pages = std::max<size_t>(PagesFor(bytes), 1);
  const size_t in_use = total_pages_ - free_.size();
  if ((in_use + pages) * page_bytes_ > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "parking pool: ", FormatBytes(pages * page_bytes_), " more would pass its ",
        FormatBytes(max_bytes_), " (", FormatBytes(in_use * page_bytes_), " in use)"));
  }
  TANDEM_RETURN_IF_ERROR(Grow(pages));
  ParkingSpace space;
  space.pool_ = this;
  space.bytes_ = bytes;
  space.pages_.assign(free_.end() - pages, free_.end());
  free_.resize(free_.size() - pages);
  return space;
}

}  // namespace tandem::gpu_worker
