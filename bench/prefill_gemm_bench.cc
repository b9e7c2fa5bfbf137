// tandem-gemm-bench: the prefill projections (issue 29 item 2) against cuBLASLt's best.
//
// For each weight shape n x k (--shapes: Llama-3-8B's qkv, o_proj, gate_up, down) and chunk of m
// prompt rows (--rows), y[m, n] = x[m, k]·w[n, k]ᵀ with bf16 weights, timed as:
//   matmul      Backend::MatMul as the model runs it: f32 x converted to bf16 into the
//               workspace, then cublasGemmEx (default algorithm) writing f32 y;
//   convert     that conversion alone (m·k f32 read, bf16 written);
//   gemm        cublasGemmEx alone on an already-bf16 x (f32 y);
//   lt_best     the fastest of cuBLASLt's top --lt_algos heuristic algorithms, bf16 x, f32 y
//               (lt_first: the heuristic's first choice);
//   lt_best_bf16_out   the same with bf16 y (what a chain of bf16 activations would run).
// TFLOP/s = 2·m·n·k / time. Each way runs --reps back-to-back calls between two synchronizations
// (host clock), after a warm-up; the figure is the mean per call. Inputs are pseudo-random (a
// fixed LCG), weights rotate over enough copies to exceed 2x the L2 where they would fit in it.
//
//   tandem-gemm-bench --rows=4096
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "convert.cuh"
#include "cuda_check.h"
#include "nlohmann/json.hpp"
#include "parse_flags.h"
#include "tandem/common/bf16.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/backend.h"

ABSL_FLAG(std::string, shapes, "6144x4096,4096x4096,28672x4096,4096x14336",
          "weight shapes n x k (Llama-3-8B: qkv, o_proj, gate_up, down)");
ABSL_FLAG(std::string, rows, "1024,2048,4096,8192", "prompt rows m per call (the prefill chunk)");
ABSL_FLAG(int64_t, reps, 20, "calls per timing");
ABSL_FLAG(int64_t, lt_algos, 16, "cuBLASLt heuristic algorithms tried per case");

namespace tandem::gpu_worker {
namespace {

constexpr size_t kLtWorkspaceBytes = size_t{64} << 20;

absl::StatusOr<std::vector<int64_t>> ParseRows(const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v <= 0 || v > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("--rows: bad value '", part, "'"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParseShapes(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<std::string> nk = absl::StrSplit(part, 'x');
    int64_t n = 0, k = 0;
    if (nk.size() != 2 || !absl::SimpleAtoi(nk[0], &n) || !absl::SimpleAtoi(nk[1], &k) || n <= 0 ||
        k <= 0 || n > (int64_t{1} << 20) || k > (int64_t{1} << 20) || k % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shapes: bad shape '", part, "' (n x k, k a multiple of 8)"));
    }
    out.emplace_back(n, k);
  }
  return out;
}

// Pseudo-random values in [-scale, scale) (a 64-bit LCG).
void FillRandom(std::vector<float>* out, uint64_t seed, float scale) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (float& v : *out) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = scale * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f);
  }
}

struct LtHandles {
  cublasLtHandle_t lt = nullptr;
  ~LtHandles() {
    if (lt != nullptr) cublasLtDestroy(lt);
  }
};

// One cuBLASLt problem: y = x·wᵀ as column-major yᵀ[n, m] = op(w)[n, k]·x[k, m] (w seen as
// column-major k x n, transposed), bf16 inputs, f32 compute, y of `out_type`.
class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    for (cublasLtMatrixLayout_t l : {a_, b_, c_}) {
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    }
    if (op_ != nullptr) cublasLtMatmulDescDestroy(op_);
    if (pref_ != nullptr) cublasLtMatmulPreferenceDestroy(pref_);
  }
  absl::Status Init(cublasLtHandle_t lt, int64_t m, int64_t n, int64_t k, cudaDataType_t out_type,
                    int max_algos) {
    lt_ = lt;
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans = CUBLAS_OP_T;
    TANDEM_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, k, n, k));
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, k, m, k));
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&c_, out_type, n, m, n));
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref_));
    const size_t ws = kLtWorkspaceBytes;
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    algos_.resize(max_algos);
    int found = 0;
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(lt_, op_, a_, b_, c_, c_, pref_,
                                                                 max_algos, algos_.data(), &found));
    algos_.resize(found);
    if (found == 0) {
      return absl::NotFoundError(
          absl::StrFormat("cuBLASLt found no algorithm for m %d n %d k %d", m, n, k));
    }
    return absl::OkStatus();
  }
  int algos() const { return static_cast<int>(algos_.size()); }
  absl::Status Run(int algo, const void* w, const void* x, void* y, void* workspace,
                   cudaStream_t stream) const {
    const float alpha = 1.0f, beta = 0.0f;
    TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(lt_, op_, &alpha, w, a_, x, b_, &beta, y, c_, y,
                                                 c_, &algos_[algo].algo, workspace,
                                                 kLtWorkspaceBytes, stream));
    return absl::OkStatus();
  }

 private:
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos_;
};

absl::Status Run() {
  absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> shapes =
      ParseShapes(absl::GetFlag(FLAGS_shapes));
  if (!shapes.ok()) return shapes.status();
  absl::StatusOr<std::vector<int64_t>> rows = ParseRows(absl::GetFlag(FLAGS_rows));
  if (!rows.ok()) return rows.status();
  const int64_t reps = std::clamp<int64_t>(absl::GetFlag(FLAGS_reps), 1, 10000);
  const int max_algos = static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_lt_algos), 1, 64));

  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(0);
  if (!backend.ok()) return backend.status();
  Backend& be = **backend;
  cudaDeviceProp props{};
  TANDEM_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, 0));
  std::printf("# %s, %d SMs, L2 %d MiB\n", props.name, props.multiProcessorCount,
              props.l2CacheSize >> 20);
  cudaStream_t stream = nullptr;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream,
                                                                          &cudaStreamDestroy);
  cublasHandle_t blas_raw = nullptr;
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas_raw));
  std::unique_ptr<cublasContext, decltype(&cublasDestroy)> blas(blas_raw, &cublasDestroy);
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas.get(), stream));
  LtHandles lt;
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&lt.lt));
  absl::StatusOr<DeviceBuffer> workspace = be.Allocate(kLtWorkspaceBytes);
  if (!workspace.ok()) return workspace.status();

  // Mean seconds per call of `call` (queued `reps` times between synchronizations).
  auto time = [&](const std::function<absl::Status()>& call,
                  const std::function<absl::Status()>& sync) -> absl::StatusOr<double> {
    for (int i = 0; i < 3; ++i) TANDEM_RETURN_IF_ERROR(call());
    TANDEM_RETURN_IF_ERROR(sync());
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < reps; ++i) TANDEM_RETURN_IF_ERROR(call());
    TANDEM_RETURN_IF_ERROR(sync());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
           static_cast<double>(reps);
  };
  auto sync_stream = [&]() -> absl::Status {
    TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  };
  auto sync_backend = [&]() { return be.Synchronize(); };

  std::vector<std::string> table;
  for (const auto& [n, k] : *shapes) {
    const size_t w_bytes = static_cast<size_t>(n * k) * 2;
    const int64_t sets = std::max<int64_t>(
        1,
        static_cast<int64_t>((2 * static_cast<size_t>(props.l2CacheSize) + w_bytes - 1) / w_bytes));
    std::vector<DeviceBuffer> weights;
    {
      std::vector<float> values(static_cast<size_t>(n * k));
      std::vector<uint16_t> bits(values.size());
      for (int64_t s = 0; s < sets; ++s) {
        FillRandom(&values, 100 + s, 0.05f);
        for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToBf16(values[i]);
        absl::StatusOr<DeviceBuffer> w = be.Allocate(w_bytes);
        if (!w.ok()) return w.status();
        TANDEM_RETURN_IF_ERROR(be.CopyToDevice(w->data(), bits.data(), w_bytes));
        weights.push_back(*std::move(w));
      }
    }
    for (const int64_t m : *rows) {
      std::vector<float> xh(static_cast<size_t>(m * k));
      FillRandom(&xh, 7, 1.0f);
      absl::StatusOr<DeviceBuffer> x = be.Allocate(xh.size() * 4);
      if (!x.ok()) return x.status();
      TANDEM_RETURN_IF_ERROR(be.CopyToDevice(x->data(), xh.data(), xh.size() * 4));
      absl::StatusOr<DeviceBuffer> x16 = be.Allocate(xh.size() * 2);
      if (!x16.ok()) return x16.status();
      absl::StatusOr<DeviceBuffer> y = be.Allocate(static_cast<size_t>(m * n) * 4);
      if (!y.ok()) return y.status();
      TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchConvertFromF32(
          {.src = x->as<float>(), .dst = x16->data(), .dst_dtype = DType::kBF16, .count = m * k},
          stream));
      TANDEM_RETURN_IF_ERROR(sync_stream());
      int64_t rep = 0;  // rotates the weight copies
      auto next_w = [&] { return weights[rep++ % sets].data(); };
      const double flops = 2.0 * static_cast<double>(m) * n * k;
      nlohmann::json row{{"bench", "prefill_gemm"}, {"m", m}, {"n", n}, {"k", k}};
      std::string line = absl::StrFormat("%6d x %5d  m %5d", n, k, m);
      auto record = [&](const std::string& name, double seconds, bool gemm_flops) {
        row[name + "_us"] = seconds * 1e6;
        if (gemm_flops) row[name + "_tflops"] = flops / seconds / 1e12;
        absl::StrAppend(&line,
                        absl::StrFormat("  %s %.1f", name,
                                        gemm_flops ? flops / seconds / 1e12 : seconds * 1e6));
      };

      absl::StatusOr<double> matmul = time(
          [&] {
            return be.MatMul({.x = x->as<float>(),
                              .w = next_w(),
                              .w_dtype = DType::kBF16,
                              .y = y->as<float>(),
                              .m = m,
                              .n = n,
                              .k = k});
          },
          sync_backend);
      if (!matmul.ok()) return matmul.status();
      record("matmul", *matmul, true);
      absl::StatusOr<double> convert = time(
          [&]() -> absl::Status {
            TANDEM_CUDA_RETURN_IF_ERROR(
                cuda_backend::LaunchConvertFromF32({.src = x->as<float>(),
                                                    .dst = x16->data(),
                                                    .dst_dtype = DType::kBF16,
                                                    .count = m * k},
                                                   stream));
            return absl::OkStatus();
          },
          sync_stream);
      if (!convert.ok()) return convert.status();
      record("convert", *convert, false);
      absl::StatusOr<double> gemm = time(
          [&]() -> absl::Status {
            const float alpha = 1.0f, beta = 0.0f;
            TANDEM_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
                blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                static_cast<int>(k), &alpha, next_w(), CUDA_R_16BF, static_cast<int>(k),
                x16->data(), CUDA_R_16BF, static_cast<int>(k), &beta, y->data(), CUDA_R_32F,
                static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            return absl::OkStatus();
          },
          sync_stream);
      if (!gemm.ok()) return gemm.status();
      record("gemm", *gemm, true);
      for (const bool bf16_out : {false, true}) {
        LtGemm problem;
        TANDEM_RETURN_IF_ERROR(
            problem.Init(lt.lt, m, n, k, bf16_out ? CUDA_R_16BF : CUDA_R_32F, max_algos));
        double best = 0.0, first = 0.0;
        for (int algo = 0; algo < problem.algos(); ++algo) {
          absl::StatusOr<double> t = time(
              [&] {
                return problem.Run(algo, next_w(), x16->data(), y->data(), workspace->data(),
                                   stream);
              },
              sync_stream);
          if (!t.ok()) {  // an algorithm the heuristic offered but cannot run: skipped, said
            std::fprintf(stderr, "m %d n %d k %d: cuBLASLt algorithm %d skipped: %s\n",
                         static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), algo,
                         t.status().ToString().c_str());
            continue;
          }
          if (algo == 0) first = *t;
          if (best == 0.0 || *t < best) best = *t;
        }
        const std::string name = bf16_out ? "lt_best_bf16_out" : "lt_best";
        if (best > 0.0) record(name, best, true);
        if (!bf16_out && first > 0.0) record("lt_first", first, true);
      }
      row["matmul_vs_lt_best"] =
          row.contains("lt_best_us") ? row["lt_best_us"].get<double>() / (*matmul * 1e6) : 0.0;
      std::printf("%s\n", row.dump().c_str());
      std::fflush(stdout);
      table.push_back(line);
    }
  }
  std::printf("\n# TFLOP/s (convert in microseconds)\n");
  for (const std::string& l : table) std::printf("%s\n", l.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::gpu_worker

int main(int argc, char** argv) {
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  const absl::Status status = tandem::gpu_worker::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "tandem-gemm-bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
