// A probe, not part of the build: what page-locking host memory costs on the GPU host, and
// whether pinning on another thread stalls the main thread's stream work (for a pool of
// pre-locked pages behind offload's settle; BENCHMARKS.md, issue 15's settle in slices).
//   nvcc -O2 -arch=sm_90 -o pin_probe bench/probes/pin_probe.cu && ./pin_probe
// Sizes: one settle slice of Llama-3-8B offload pages (32 layers x 16 MiB = 4096 tokens).
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <atomic>
using Clock = std::chrono::steady_clock;
static double Ms(Clock::time_point a) { return std::chrono::duration<double, std::milli>(Clock::now() - a).count(); }
__global__ void Spin(int* x, int n) { for (int i = 0; i < n; ++i) atomicAdd(x, 1); }
int main() {
  const size_t page = 16ull << 20; const int pages = 32;
  cudaFree(0);
  // (a) cudaMallocHost
  std::vector<void*> a(pages);
  auto t = Clock::now();
  for (int i = 0; i < pages; ++i) cudaMallocHost(&a[i], page);
  printf("cudaMallocHost 32x16MiB: %.1f ms\n", Ms(t));
  t = Clock::now();
  for (int i = 0; i < pages; ++i) cudaFreeHost(a[i]);
  printf("cudaFreeHost 32x16MiB: %.1f ms\n", Ms(t));
  // (b) mmap + touch, then cudaHostRegister
  std::vector<void*> b(pages);
  t = Clock::now();
  for (int i = 0; i < pages; ++i) { b[i] = mmap(nullptr, page, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE, -1, 0); }
  printf("mmap POPULATE 32x16MiB: %.1f ms\n", Ms(t));
  t = Clock::now();
  for (int i = 0; i < pages; ++i) cudaHostRegister(b[i], page, cudaHostRegisterDefault);
  printf("cudaHostRegister of populated 32x16MiB: %.1f ms\n", Ms(t));
  for (int i = 0; i < pages; ++i) { cudaHostUnregister(b[i]); munmap(b[i], page); }
  // (c) one 512 MiB cudaMallocHost
  void* big; t = Clock::now(); cudaMallocHost(&big, page * pages); printf("cudaMallocHost 512MiB once: %.1f ms\n", Ms(t)); cudaFreeHost(big);
  // (d) main thread: 200 small async ops + syncs; background: cudaMallocHost 32x16MiB
  int* d; cudaMalloc(&d, 4); cudaStream_t s; cudaStreamCreate(&s);
  void* dev; cudaMalloc(&dev, page); void* pin; cudaMallocHost(&pin, page);
  std::atomic<bool> done{true};
  auto loop = [&](const char* what) {
    double worst = 0; auto t0 = Clock::now(); int i = 0;
    for (; i < 200 || !done; ++i) {
      auto t1 = Clock::now();
      Spin<<<1, 1, 0, s>>>(d, 1000);
      cudaMemcpyAsync(dev, pin, 1 << 20, cudaMemcpyHostToDevice, s);
      cudaStreamSynchronize(s);
      worst = std::max(worst, Ms(t1));
    }
    printf("%s: %d launch+copy+sync in %.1f ms (%.3f ms each), worst %.2f ms\n", what, i, Ms(t0), Ms(t0) / i, worst);
  };
  loop("alone");
  done = false;
  std::thread bg([&] { std::vector<void*> c(pages); for (auto& p : c) cudaMallocHost(&p, page); for (auto& p : c) cudaFreeHost(p); done = true; });
  loop("beside cudaMallocHost thread"); bg.join();
  done = false;
  std::thread bg2([&] { std::vector<void*> c(pages); for (auto& p : c) { p = mmap(nullptr, page, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE, -1, 0); cudaHostRegister(p, page, 0);} for (auto& p : c) {cudaHostUnregister(p); munmap(p, page);} done = true; });
  loop("beside mmap+register thread"); bg2.join();
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
