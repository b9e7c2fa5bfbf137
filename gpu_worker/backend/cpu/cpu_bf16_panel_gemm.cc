#include "cpu_bf16_panel_gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "cpu_vector_kernels.h"
#include "tandem/common/bf16.h"
#include "tandem/common/dnnl_call.h"
#include "tandem/cpu_isa/cpu_isa.h"

namespace tandem::gpu_worker::cpu {
namespace {

// Weight rows per panel: kPanelBytes of f32, a multiple of 8, between 8 and 512 rows.
int64_t PanelRows(int64_t k) {
  const int64_t rows = Bf16PanelGemm::kPanelBytes / (k * static_cast<int64_t>(sizeof(float)));
  return std::clamp<int64_t>(rows / 8 * 8, 8, 512);
}

// Decode-sized products (m <= kGemvRows, AVX2): each weight row is read once, widened in
// registers and dotted with every x row; no panel is written. A panel costs a widened store and
// reload of every weight per call, which at m = 1 is ~5x the bytes of the bf16 weights.
constexpr int64_t kGemvRows = 4;

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_GEMV_AVX2 __attribute__((target("avx2,fma")))

template <int M>
TANDEM_GEMV_AVX2 void GemvRowsAvx2(const float* x, const uint16_t* w, const float* bias,
                                   float* y, int64_t n, int64_t k, int64_t j0, int64_t j1,
                                   bool accumulate) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* wr = w + j * k;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i))), 16));
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), wv, acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      float sum = _mm_cvtss_f32(h);
      for (int64_t t = i; t < k; ++t) sum += x[r * k + t] * Bf16ToFloat(wr[t]);
      if (bias != nullptr) sum += bias[j];
      float& out = y[r * n + j];
      out = accumulate ? out + sum : sum;
    }
  }
}
#endif

// The GEMV path for m <= kGemvRows on AVX2 (and AVX-512) CPUs; false when it does not apply.
bool RunGemv(const float* x, const uint16_t* w, const float* bias, float* y, int64_t m,
             int64_t n, int64_t k, bool accumulate, int team) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (m > kGemvRows || ActiveCpuIsa() < CpuIsa::kAvx2) return false;
  // Row ranges of at least 64 outputs per task.
  const int64_t tasks = std::clamp<int64_t>(n / 64, 1, team);
#pragma omp parallel for num_threads(static_cast<int>(tasks)) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t j0 = n * t / tasks, j1 = n * (t + 1) / tasks;
    switch (m) {
      case 1:
        GemvRowsAvx2<1>(x, w, bias, y, n, k, j0, j1, accumulate);
        break;
      case 2:
        GemvRowsAvx2<2>(x, w, bias, y, n, k, j0, j1, accumulate);
        break;
      case 3:
        GemvRowsAvx2<3>(x, w, bias, y, n, k, j0, j1, accumulate);
        break;
      default:
        GemvRowsAvx2<4>(x, w, bias, y, n, k, j0, j1, accumulate);
        break;
    }
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

absl::Status Bf16PanelGemm::Run(const float* x, const uint16_t* w, const float* bias, float* y,
                                int64_t m, int64_t n, int64_t k, bool accumulate, int threads) {
  if (RunGemv(x, w, bias, y, m, n, k, accumulate, std::clamp(threads, 1, threads_))) {
    return absl::OkStatus();
  }
  const int64_t rows = PanelRows(k);
  const int64_t panels = (n + rows - 1) / rows;
  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, std::min<int64_t>(
                                                                        threads_, panels)));
  float* scratch = panels_.Get<float>(static_cast<size_t>(team) * rows * k);
  if (scratch == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("MatMul: out of memory for ", team, " widened bf16 weight panels of [",
                     rows, ", ", k, "] f32"));
  }
  std::atomic<int> failed{static_cast<int>(dnnl_success)};
  // NOTE: dnnl_sgemm inside the parallel region runs on the calling thread only (oneDNN does
  // not nest), so the team's threads each own one panel at a time.
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * rows;
    const int64_t nb = std::min(rows, n - n0);
    float* panel = scratch + static_cast<size_t>(omp_get_thread_num()) * rows * k;
    Bf16ToF32(w + n0 * k, panel, nb * k);
    const dnnl_status_t s = dnnl_sgemm('N', 'T', m, nb, k, 1.0f, x, k, panel, k,
                                       accumulate ? 1.0f : 0.0f, y + n0, n);
    if (s != dnnl_success) {
      failed.store(static_cast<int>(s));
      continue;
    }
    if (bias == nullptr) continue;
    for (int64_t r = 0; r < m; ++r) {
      float* yr = y + r * n + n0;
      for (int64_t j = 0; j < nb; ++j) yr[j] += bias[n0 + j];
    }
  }
  TANDEM_DNNL_STATUS(absl::StrCat("MatMul of bf16 weights through f32 panels: [", m, ", ", k,
                                  "] x [", k, ", ", n, "]"),
                     static_cast<dnnl_status_t>(failed.load()));
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
