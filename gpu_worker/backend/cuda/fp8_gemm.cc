#include "fp8_gemm.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::cuda_backend {
namespace {

// Plans kept at the most; past it they are dropped and rebuilt (prefill repeats a handful of
// shapes: each projection at the chunk length and the last chunk's; batches one per row count).
constexpr size_t kMaxPlans = 256;

// The largest power of two up to 256 dividing a pointer: cuBLASLt chooses kernels for the
// alignment it is promised (256 bytes unless told less).
uint32_t AlignmentOf(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

absl::Status LtError(cublasStatus_t status, const char* what, const Fp8GemmArgs& a) {
  return absl::InternalError(absl::StrCat("FP8 GEMM (m ", a.m, ", n ", a.n, ", k ", a.k,
                                          "): ", what, " failed: ", cublasGetStatusName(status),
                                          " (", cublasGetStatusString(status), ")"));
}

}  // namespace

struct Fp8Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr;  // A: k x n column-major (w row-major), transposed
  cublasLtMatrixLayout_t x = nullptr;  // B: k x m column-major (x row-major)
  cublasLtMatrixLayout_t y = nullptr;  // C = D: n x m column-major f32 (y row-major)
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (y != nullptr) cublasLtMatrixLayoutDestroy(y);
    if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
    if (w != nullptr) cublasLtMatrixLayoutDestroy(w);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

void Fp8Gemm::HandleDeleter::operator()(cublasLtContext* handle) const { cublasLtDestroy(handle); }

Fp8Gemm::Fp8Gemm(Fp8Gemm&&) noexcept = default;
Fp8Gemm& Fp8Gemm::operator=(Fp8Gemm&&) noexcept = default;
Fp8Gemm::~Fp8Gemm() = default;

absl::StatusOr<Fp8Gemm> Fp8Gemm::Create(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("FP8 GEMM: cannot read device ", device, "'s compute capability"));
  }
  if (major < 9) {
    return absl::UnimplementedError(absl::StrCat("FP8 GEMM: compute capability ", major,
                                                 ".x has no FP8 outer-vector scaling (9.0+)"));
  }
  cublasLtHandle_t handle = nullptr;
  if (const cublasStatus_t s = cublasLtCreate(&handle); s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtCreate failed: ", cublasGetStatusName(s)));
  }
  Fp8Gemm gemm;
  gemm.handle_.reset(handle);
  return gemm;
}

bool Fp8Gemm::Supports(int64_t m, int64_t n, int64_t k) {
  return m >= 1 && n >= 4 && k >= 16 && k % 16 == 0 && n % 4 == 0 && m <= INT32_MAX &&
         n <= INT32_MAX && k <= INT32_MAX;
}

absl::StatusOr<Fp8Gemm::Plan*> Fp8Gemm::PlanFor(const Fp8GemmArgs& a) {
  if (!Supports(a.m, a.n, a.k) || a.x_codes == nullptr || a.x_scale == nullptr ||
      a.w_codes == nullptr || a.w_scale == nullptr || a.y == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 GEMM: m ", a.m, ", n ", a.n, ", k ", a.k,
                                                   " or a null pointer is not supported (k a "
                                                   "multiple of 16, n of 4)"));
  }
  const uint32_t w_alignment = AlignmentOf(a.w_codes), x_alignment = AlignmentOf(a.x_codes),
                 y_alignment = AlignmentOf(a.y);
  const Key key{a.m, a.n, a.k, a.accumulate, w_alignment, x_alignment, y_alignment};
  auto no_kernel = [&] {
    return absl::UnimplementedError(
        absl::StrCat("FP8 GEMM: cuBLASLt has no row-scaled e4m3 kernel"
                     " for m ",
                     a.m, ", n ", a.n, ", k ", a.k, " here"));
  };
  if (const auto it = plans_.find(key); it != plans_.end()) {
    if (it->second == nullptr) return no_kernel();
    return it->second.get();
  }
  if (plans_.size() >= kMaxPlans) plans_.clear();
  auto plan = std::make_unique<Plan>();
  auto check = [&](cublasStatus_t s, const char* what) {
    return s == CUBLAS_STATUS_SUCCESS ? absl::OkStatus() : LtError(s, what, a);
  };
  absl::Status status = check(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                              "creating the matmul description");
  const cublasOperation_t transpose = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  const int32_t outer_vector = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value, size_t bytes) {
    if (status.ok()) {
      status = check(cublasLtMatmulDescSetAttribute(plan->desc, attribute, value, bytes),
                     "setting a matmul attribute");
    }
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof(plain));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer_vector, sizeof(outer_vector));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer_vector, sizeof(outer_vector));
  // The scale pointers are part of the description; Run sets the call's own.
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a.w_scale, sizeof(a.w_scale));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a.x_scale, sizeof(a.x_scale));
  if (!status.ok()) return status;
  const auto m = static_cast<uint64_t>(a.m), n = static_cast<uint64_t>(a.n),
             k = static_cast<uint64_t>(a.k);
  TANDEM_RETURN_IF_ERROR(check(cublasLtMatrixLayoutCreate(&plan->w, CUDA_R_8F_E4M3, k, n, a.k),
                               "creating the weight layout"));
  TANDEM_RETURN_IF_ERROR(check(cublasLtMatrixLayoutCreate(&plan->x, CUDA_R_8F_E4M3, k, m, a.k),
                               "creating the activation layout"));
  TANDEM_RETURN_IF_ERROR(check(cublasLtMatrixLayoutCreate(&plan->y, CUDA_R_32F, n, m, a.n),
                               "creating the output layout"));
  cublasLtMatmulPreference_t preference = nullptr;
  TANDEM_RETURN_IF_ERROR(
      check(cublasLtMatmulPreferenceCreate(&preference), "creating the algorithm preference"));
  const uint64_t workspace = kFp8GemmWorkspaceBytes;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, w_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, x_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, y_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, y_alignment}};
  for (const auto& [attribute, bytes] : alignments) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes));
    }
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreferenceDestroy(preference);
    return check(s, "setting the algorithm preference");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  s = cublasLtMatmulAlgoGetHeuristic(handle_.get(), plan->desc, plan->w, plan->x, plan->y, plan->y,
                                     preference, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && found == 0)) {
    plans_.emplace(key, nullptr);
    return no_kernel();
  }
  TANDEM_RETURN_IF_ERROR(check(s, "choosing an algorithm"));
  plan->algo = result.algo;
  Plan* raw = plan.get();
  plans_.emplace(key, std::move(plan));
  return raw;
}

absl::Status Fp8Gemm::Prepare(const Fp8GemmArgs& a) { return PlanFor(a).status(); }

absl::Status Fp8Gemm::Run(const Fp8GemmArgs& a, void* workspace, cudaStream_t stream) {
  if (workspace == nullptr) return absl::InvalidArgumentError("FP8 GEMM: null workspace");
  TANDEM_ASSIGN_OR_RETURN(Plan * plan, PlanFor(a));
  auto check = [&](cublasStatus_t s, const char* what) {
    return s == CUBLAS_STATUS_SUCCESS ? absl::OkStatus() : LtError(s, what, a);
  };
  TANDEM_RETURN_IF_ERROR(
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                           &a.w_scale, sizeof(a.w_scale)),
            "setting the weight scales"));
  TANDEM_RETURN_IF_ERROR(
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                           &a.x_scale, sizeof(a.x_scale)),
            "setting the activation scales"));
  const float alpha = 1.0f;
  const float beta = a.accumulate ? 1.0f : 0.0f;
  return check(cublasLtMatmul(handle_.get(), plan->desc, &alpha, a.w_codes, plan->w, a.x_codes,
                              plan->x, &beta, a.y, plan->y, a.y, plan->y, &plan->algo, workspace,
                              kFp8GemmWorkspaceBytes, stream),
               "cublasLtMatmul");
}

}  // namespace tandem::gpu_worker::cuda_backend
