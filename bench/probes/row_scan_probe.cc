// A probe, not part of the build: the bf16 row-scan kernels alone (cpu_attention's
// RowScanKernels: scores, then accumulate, over 64-key chunks of one K and one V set), one
// thread, to separate the kernels' own cost from the rest of an Attend (BENCHMARKS.md, issue 24:
// the AVX2 split-order scan). Argument: keys per set (256: cached; 262144: streaming, 128 MiB).
// TANDEM_CPU_ISA=avx2|avx512 picks the kernels. From the repository root:
//   g++ -O3 -std=c++20 -Icpu_attention/kernels/src -Icommon/cpu_isa/include \
//     bench/probes/row_scan_probe.cc cpu_attention/kernels/src/row_scan_kernels.cc \
//     common/cpu_isa/src/*.cc -labsl_strings -labsl_status -labsl_statusor -o row_scan_probe
//   TANDEM_CPU_ISA=avx2 ./row_scan_probe 256
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "row_scan_kernels.h"

using tandem::cpu_attention::internal::GetBf16ScanKernels;
using tandem::cpu_attention::internal::RowScanKernels;

int main(int argc, char** argv) {
  constexpr size_t kD = 128, kChunk = 64, kRows = 4;  // Llama-3-8B: head_dim 128, G 4
  const size_t keys = argc > 1 ? std::strtoul(argv[1], nullptr, 10) / kChunk * kChunk : 256;
  const RowScanKernels* kernels = GetBf16ScanKernels();
  if (keys == 0 || kernels == nullptr) {
    std::fprintf(stderr, "usage: row_scan_probe KEYS (>= 64), on a CPU with AVX2 or AVX-512\n");
    return 2;
  }
  // bf16 values in about [-2, 2): the sign, exponent 127..128, random mantissa bits.
  std::mt19937 rng(1);
  std::vector<uint16_t> k(keys * kD), v(keys * kD);
  for (uint16_t& x : k) x = static_cast<uint16_t>(0x3f80 ^ (rng() & 0x807f));
  for (uint16_t& x : v) x = static_cast<uint16_t>(0x3f80 ^ (rng() & 0x807f));
  std::vector<float> q(kRows * kD, 0.01f), acc(kRows * kD, 0.0f), p(kRows * kChunk, 0.001f);
  if (kernels->to_kernel_order != nullptr) kernels->to_kernel_order(q.data(), kRows, kD);
  const std::byte* rows[kChunk];
  double best_scores = 1e30, best_accumulate = 1e30;
  for (int rep = 0; rep < 50; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t c = 0; c < keys; c += kChunk) {
      for (size_t i = 0; i < kChunk; ++i) {
        rows[i] = reinterpret_cast<const std::byte*>(&k[(c + i) * kD]);
      }
      kernels->scores(q.data(), kRows, kD, rows, kChunk, nullptr, p.data(), kChunk, {});
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (size_t c = 0; c < keys; c += kChunk) {
      for (size_t i = 0; i < kChunk; ++i) {
        rows[i] = reinterpret_cast<const std::byte*>(&v[(c + i) * kD]);
      }
      kernels->accumulate(p.data(), kChunk, kRows, rows, kChunk, kD, acc.data());
    }
    const auto t2 = std::chrono::steady_clock::now();
    best_scores = std::min(best_scores, std::chrono::duration<double>(t1 - t0).count());
    best_accumulate = std::min(best_accumulate, std::chrono::duration<double>(t2 - t1).count());
  }
  const double row_bytes = kD * sizeof(uint16_t);
  std::printf("%s, %zu keys: scores %.1f ns per key (%.1f GB/s), accumulate %.1f ns per key "
              "(%.1f GB/s) [%g]\n",
              kernels->name, keys, best_scores / keys * 1e9, keys * row_bytes / best_scores / 1e9,
              best_accumulate / keys * 1e9, keys * row_bytes / best_accumulate / 1e9, acc[5]);
  return 0;
}
