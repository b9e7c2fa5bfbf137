#include "cpu_bf16_panel_gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "cpu_vector_kernels.h"
#include "tandem/common/dnnl_call.h"

namespace tandem::gpu_worker::cpu {
namespace {

// Weight rows per panel: kPanelBytes of f32, a multiple of 8, between 8 and 512 rows.
int64_t PanelRows(int64_t k) {
  const int64_t rows = Bf16PanelGemm::kPanelBytes / (k * static_cast<int64_t>(sizeof(float)));
  return std::clamp<int64_t>(rows / 8 * 8, 8, 512);
}

}  // namespace

absl::Status Bf16PanelGemm::Run(const float* x, const uint16_t* w, const float* bias, float* y,
                                int64_t m, int64_t n, int64_t k, bool accumulate, int threads) {
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
