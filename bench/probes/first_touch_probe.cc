// A probe, not part of the build: how fast fresh anonymous memory takes writes, the cost a
// node's append pays when its blocks were never written (BENCHMARKS.md, issue 27: "Settle
// appends at memory speed"). For 4 KiB pages and transparent huge pages (MADV_HUGEPAGE), on 1,
// 4 and 8 threads, 2 GiB in 8 MiB steps:
//   fault + copy      memcpy into untouched memory (a page fault per page)
//   populate + copy   MADV_POPULATE_WRITE of each step, then the memcpy (what BlockPool does)
//   warm copy         memcpy into memory populated beforehand (what the warm reserve gives)
// and, once per page size, MADV_POPULATE_WRITE of 2 GiB alone on one thread. From the root:
//   g++ -O2 -std=c++20 -pthread bench/probes/first_touch_probe.cc -o first_touch_probe
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23   // Linux 5.14
#endif

namespace {

constexpr size_t kBytes = size_t{2} << 30;
constexpr size_t kStep = size_t{8} << 20;
constexpr size_t kHuge = size_t{2} << 20;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// An anonymous mapping of kBytes, 2 MiB aligned, unmapped on destruction.
class Region {
 public:
  explicit Region(bool huge) {
    raw_ = mmap(nullptr, kBytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                -1, 0);
    if (raw_ == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
    data_ = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw_) + kHuge - 1) &
                                    ~uintptr_t{kHuge - 1});
    madvise(data_, kBytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  }
  ~Region() { munmap(raw_, kBytes + kHuge); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  char* data() const { return data_; }

 private:
  void* raw_;
  char* data_;
};

enum class Mode { kFault, kPopulate, kWarm };

double CopyRate(bool huge, int threads, Mode mode, const std::vector<char>& src) {
  Region region(huge);
  if (mode == Mode::kWarm) madvise(region.data(), kBytes, MADV_POPULATE_WRITE);
  const double start = Seconds();
  std::vector<std::thread> workers;
  const size_t per = kBytes / threads;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      char* dst = region.data() + t * per;
      for (size_t off = 0; off + kStep <= per; off += kStep) {
        if (mode == Mode::kPopulate) madvise(dst + off, kStep, MADV_POPULATE_WRITE);
        std::memcpy(dst + off, src.data() + off % (src.size() - kStep), kStep);
      }
    });
  }
  for (std::thread& w : workers) w.join();
  return kBytes / (Seconds() - start) / 1e9;
}

double PopulateRate(bool huge) {
  Region region(huge);
  const double start = Seconds();
  madvise(region.data(), kBytes, MADV_POPULATE_WRITE);
  return kBytes / (Seconds() - start) / 1e9;
}

}  // namespace

int main() {
  const std::vector<char> src(size_t{64} << 20, 1);
  for (const bool huge : {false, true}) {
    std::printf("%s pages: populate alone, 1 thread %.2f GB/s\n", huge ? "2 MiB" : "4 KiB",
                PopulateRate(huge));
    for (const int threads : {1, 4, 8}) {
      std::printf("%s pages, %d threads: fault+copy %.2f, populate+copy %.2f, warm copy %.2f GB/s\n",
                  huge ? "2 MiB" : "4 KiB", threads, CopyRate(huge, threads, Mode::kFault, src),
                  CopyRate(huge, threads, Mode::kPopulate, src),
                  CopyRate(huge, threads, Mode::kWarm, src));
    }
  }
  return 0;
}
