// A growable 64-byte aligned scratch buffer for per-thread workspaces (private to
// cpu_attention). Contents are not preserved when it grows; it never shrinks.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace tandem::cpu_attention::internal {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  // Ensures room for `count` elements of T and returns the (64-byte aligned) storage; throws
  // std::bad_alloc when the allocation fails.
  template <typename T>
  T* Get(size_t count) {
    const size_t bytes = count * sizeof(T);
    if (bytes > capacity_) {
      // Geometric growth: sizes vary from call to call; avoid reallocating for each.
      size_t want = capacity_ * 2 > bytes ? capacity_ * 2 : bytes;
      want = (want + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, want);
      if (p == nullptr) throw std::bad_alloc();
      std::free(data_);
      data_ = p;
      capacity_ = want;
    }
    return static_cast<T*>(data_);
  }

  size_t capacity() const { return capacity_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace tandem::cpu_attention::internal
