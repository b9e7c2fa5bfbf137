// The counter-based pseudo-random values of Backend::RandomFill, callable from host and device
// code so both backends write identical values: u(seed, i) = top 24 bits of
// splitmix64(seed + i · 0x9E3779B97F4A7C15) / 2^24, and the filled value is scale · (2u − 1).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif

namespace tandem::gpu_worker {

TANDEM_HOST_DEVICE inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// scale · (2u − 1) with u in [0, 1): values in [-scale, scale).
TANDEM_HOST_DEVICE inline float RandomSigned(uint64_t seed, uint64_t i, float scale) {
  const uint64_t bits = SplitMix64(seed + i * 0x9E3779B97F4A7C15ull) >> 40;   // 24 bits
  const float u = static_cast<float>(bits) * (1.0f / 16777216.0f);
  return scale * (2.0f * u - 1.0f);
}

}  // namespace tandem::gpu_worker
