// Scratch memory and OpenMP thread-count scoping for the cpu backend (private to backend/cpu).
#pragma once

#include <omp.h>

#include <cstddef>
#include <cstdlib>

namespace tandem::gpu_worker::cpu {

// A growable 64-byte aligned scratch buffer (workspaces reused across calls). Contents are not
// preserved when it grows; it never shrinks. Not thread-safe: one owner (an object or a thread).
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ~ScratchBuffer() { std::free(data_); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  // Room for `count` elements of T (64-byte aligned), or nullptr when the allocation fails.
  template <typename T>
  T* Get(size_t count) {
    if (count > kMaxBytes / sizeof(T)) return nullptr;
    const size_t bytes = count * sizeof(T);
    if (bytes > capacity_ || data_ == nullptr) {
      // Geometric growth: sizes vary from call to call (prefill chunks, decode steps).
      size_t want = capacity_ * 2 > bytes ? capacity_ * 2 : bytes;
      want = (want + 63) / 64 * 64;
      if (want == 0) want = 64;
      void* p = std::aligned_alloc(64, want);
      if (p == nullptr) return nullptr;
      std::free(data_);
      data_ = p;
      capacity_ = want;
    }
    return static_cast<T*>(data_);
  }

 private:
  static constexpr size_t kMaxBytes = size_t{1} << 40;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Sets the calling thread's OpenMP thread count (what oneDNN reads when it creates and runs a
// primitive outside a parallel region) for the scope's lifetime, then restores it.
class OmpThreadsScope {
 public:
  explicit OmpThreadsScope(int threads) : saved_(omp_get_max_threads()) {
    omp_set_num_threads(threads);
  }
  ~OmpThreadsScope() { omp_set_num_threads(saved_); }
  OmpThreadsScope(const OmpThreadsScope&) = delete;
  OmpThreadsScope& operator=(const OmpThreadsScope&) = delete;

 private:
  int saved_;
};

}  // namespace tandem::gpu_worker::cpu
