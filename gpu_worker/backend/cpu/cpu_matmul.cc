#include "cpu_matmul.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu_vector_kernels.h"
#include "tandem/common/bf16.h"
#include "tandem/common/dnnl_call.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"

namespace tandem::gpu_worker::cpu {
namespace {

using dt = dnnl::memory::data_type;

// Below this many flops (2·m·n·k) a matmul runs on one thread: waking the OpenMP team costs more
// than it saves, and much more on a loaded host where a descheduled thread stalls the team.
constexpr double kParallelFlops = 4e6;

std::string DescribeKey(int64_t m, int64_t n, int64_t k, bool bf16) {
  const char* type = bf16 ? "bf16" : "f32";
  return absl::StrCat("MatMul [", m, ", ", k, "] ", type, " x [", k, ", ", n, "] ", type,
                      " -> f32");
}

}  // namespace

bool CpuMatmul::Bf16OnOneDnn() {
  return ActiveCpuIsa() == CpuIsa::kAvx512 && OneDnnHasBf16Matmul();
}

std::string CpuMatmul::Bf16PathName() {
  return Bf16OnOneDnn() ? "oneDNN bf16"
                        : "widened f32 panels (oneDNN has no bf16 matmul for this CPU's kernels)";
}

absl::Status CpuMatmul::SelfCheck() {
  constexpr int64_t m = 5, n = 40, k = 72;
  std::vector<float> x(m * k), w32(n * k), bias(n), y0(m * n);
  for (int64_t i = 0; i < m * k; ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  for (int64_t i = 0; i < n * k; ++i) w32[i] = std::cos(0.11f * static_cast<float>(i));
  for (int64_t i = 0; i < n; ++i) bias[i] = 0.01f * static_cast<float>(i);
  for (int64_t i = 0; i < m * n; ++i) y0[i] = 0.5f;
  for (const DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    // The weights and inputs as the GEMM sees them (rounded to the weight dtype).
    std::vector<uint16_t> w16(n * k);
    std::vector<float> w_seen(n * k), x_seen(m * k);
    for (int64_t i = 0; i < n * k; ++i) {
      if (dtype == DType::kBF16) w16[i] = FloatToBf16(w32[i]);
      if (dtype == DType::kF16) w16[i] = FloatToF16(w32[i]);
      w_seen[i] = dtype == DType::kBF16  ? Bf16ToFloat(w16[i])
                  : dtype == DType::kF16 ? F16ToFloat(w16[i])
                                         : w32[i];
    }
    for (int64_t i = 0; i < m * k; ++i) {
      x_seen[i] = dtype == DType::kBF16  ? Bf16ToFloat(FloatToBf16(x[i]))
                  : dtype == DType::kF16 ? F16ToFloat(FloatToF16(x[i]))
                                         : x[i];
    }
    std::vector<float> y = y0;
    MatMulParams p;
    p.x = x.data();
    p.w = dtype == DType::kF32 ? static_cast<const void*>(w32.data()) : w16.data();
    p.w_dtype = dtype;
    p.bias = bias.data();
    p.y = y.data();
    p.m = m;
    p.n = n;
    p.k = k;
    p.accumulate = true;
    absl::Status status = Run(p);
    double worst = 0.0;
    for (int64_t r = 0; status.ok() && r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double ref = y0[r * n + c] + bias[c];
        for (int64_t i = 0; i < k; ++i) {
          ref += static_cast<double>(x_seen[r * k + i]) * w_seen[c * k + i];
        }
        worst = std::max(worst, std::abs(ref - y[r * n + c]));
      }
    }
    if (status.ok() && !(worst <= 1e-3)) {
      status = absl::InternalError(
          absl::StrCat("the result differs from the reference by ", worst, " (bound 1e-3)"));
    }
    if (!status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the cpu backend's ", std::string(DTypeName(dtype)), " matmul does not run correctly on this CPU (",
          CpuIsaSummary(), "; bf16 path: ", Bf16PathName(), "): ", status.message(),
          ". Try TANDEM_CPU_ISA=avx2 or =portable, and report it with the output of lscpu"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateMatMul(const MatMulParams& p) {
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr) {
    return absl::InvalidArgumentError("MatMul: x, w and y must not be null");
  }
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("MatMul: m (%d), n (%d), k (%d) must be positive", p.m, p.n, p.k));
  }
  if (p.w_dtype != DType::kF32 && p.w_dtype != DType::kBF16 && p.w_dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("MatMul: weight dtype %s is not f32, bf16 or f16", DTypeName(p.w_dtype)));
  }
  const auto x_begin = reinterpret_cast<uintptr_t>(p.x);
  const auto y_begin = reinterpret_cast<uintptr_t>(p.y);
  const uintptr_t x_end = x_begin + static_cast<uintptr_t>(p.m * p.k) * sizeof(float);
  const uintptr_t y_end = y_begin + static_cast<uintptr_t>(p.m * p.n) * sizeof(float);
  if (x_begin < y_end && y_begin < x_end) {
    return absl::InvalidArgumentError("MatMul: y must not overlap x");
  }
  return absl::OkStatus();
}

size_t CpuMatmul::KeyHash::operator()(const Key& key) const {
  size_t h = 0;
  auto mix = [&h](uint64_t v) {
    h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  };
  mix(static_cast<uint64_t>(key.m));
  mix(static_cast<uint64_t>(key.n));
  mix(static_cast<uint64_t>(key.k));
  mix(static_cast<uint64_t>(key.bf16) | static_cast<uint64_t>(key.bias) << 1 |
      static_cast<uint64_t>(key.accumulate) << 2 | static_cast<uint64_t>(key.threads) << 3);
  return h;
}

CpuMatmul::CpuMatmul(dnnl::engine engine, dnnl::stream stream, int threads)
    : engine_(std::move(engine)),
      stream_(std::move(stream)),
      threads_(threads),
      bf16_panels_(threads) {}

absl::StatusOr<std::unique_ptr<CpuMatmul>> CpuMatmul::Create(int threads) {
  std::optional<dnnl::engine> engine;
  std::optional<dnnl::stream> stream;
  TANDEM_DNNL_CALL("creating the oneDNN CPU engine and stream",
                   engine.emplace(dnnl::engine::kind::cpu, 0);
                   stream.emplace(*engine));
  return std::unique_ptr<CpuMatmul>(
      new CpuMatmul(std::move(*engine), std::move(*stream), std::max(1, threads)));
}

absl::Status CpuMatmul::Lookup(const Key& key, Entry** entry) {
  if (auto it = index_.find(key); it != index_.end()) {
    if (it->second != lru_.begin()) lru_.splice(lru_.begin(), lru_, it->second);
    *entry = &*it->second;
    return absl::OkStatus();
  }
  Entry e;
  e.key = key;
  TANDEM_DNNL_CALL(absl::StrCat("creating the ", DescribeKey(key.m, key.n, key.k, key.bf16)), {
    const dt in_type = key.bf16 ? dt::bf16 : dt::f32;
    const dnnl::memory::desc src_md({key.m, key.k}, in_type, {key.k, 1});
    const dnnl::memory::desc wei_md({key.k, key.n}, in_type, {1, key.k});  // wᵀ view of [n, k]
    const dnnl::memory::desc dst_md({key.m, key.n}, dt::f32, {key.n, 1});
    const dnnl::memory::desc bias_md({1, key.n}, dt::f32, {key.n, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);  // y = x · wᵀ + bias + y
      attr.set_post_ops(ops);
    }
    const auto desc = key.bias ? dnnl::matmul::desc(src_md, wei_md, bias_md, dst_md)
                               : dnnl::matmul::desc(src_md, wei_md, dst_md);
    const dnnl::matmul::primitive_desc pd(desc, attr, engine_);
    e.prim = dnnl::matmul(pd);
    e.scratch_bytes = pd.scratchpad_desc().get_size();
    e.src = dnnl::memory(src_md, engine_, DNNL_MEMORY_NONE);
    e.wei = dnnl::memory(wei_md, engine_, DNNL_MEMORY_NONE);
    e.dst = dnnl::memory(dst_md, engine_, DNNL_MEMORY_NONE);
    if (key.bias) e.bias = dnnl::memory(bias_md, engine_, DNNL_MEMORY_NONE);
    if (e.scratch_bytes > 0)
      e.scratch = dnnl::memory(pd.scratchpad_desc(), engine_, DNNL_MEMORY_NONE);
  });
  if (lru_.size() >= kCapacity) {
    index_.erase(lru_.back().key);
    lru_.pop_back();
  }
  lru_.push_front(std::move(e));
  index_.emplace(key, lru_.begin());
  *entry = &lru_.front();
  return absl::OkStatus();
}

absl::Status CpuMatmul::Run(const MatMulParams& p) {
  if (p.w_dtype == DType::kBF16 && !Bf16OnOneDnn()) return RunBf16Panels(p);
  if (p.m > kRowGranule && p.m % kRowGranule != 0) {
    MatMulParams head = p, tail = p;
    head.m = p.m - p.m % kRowGranule;
    tail.m = p.m % kRowGranule;
    tail.x = p.x + head.m * p.k;
    tail.y = p.y + head.m * p.n;
    TANDEM_RETURN_IF_ERROR(RunRows(head));
    return RunRows(tail);
  }
  return RunRows(p);
}

absl::Status CpuMatmul::RunBf16Panels(const MatMulParams& p) {
  const size_t mk = static_cast<size_t>(p.m) * static_cast<size_t>(p.k);
  // x rounded to bf16 but kept as f32, for the widened panels (cpu_bf16_panel_gemm.h).
  float* xr = src_.Get<float>(mk);
  if (xr == nullptr) return absl::ResourceExhaustedError("MatMul: out of memory for bf16 x");
  RoundToBf16(p.x, xr, static_cast<int64_t>(mk));
  const double flops =
      2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
  return bf16_panels_.Run(xr, static_cast<const uint16_t*>(p.w), p.bias, p.y, p.m, p.n, p.k,
                          p.accumulate, flops < kParallelFlops ? 1 : threads_);
}

absl::Status CpuMatmul::RunRows(const MatMulParams& p) {
  Key key;
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.bf16 = p.w_dtype == DType::kBF16;
  key.bias = p.bias != nullptr;
  key.accumulate = p.accumulate;
  const double flops =
      2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
  key.threads = flops < kParallelFlops ? 1 : threads_;

  // The operands as oneDNN takes them (see the numerics note in the header).
  const void* src = p.x;
  const void* wei = p.w;
  const size_t mk = static_cast<size_t>(p.m) * static_cast<size_t>(p.k);
  if (p.w_dtype == DType::kBF16) {
    uint16_t* xb = src_.Get<uint16_t>(mk);
    if (xb == nullptr) return absl::ResourceExhaustedError("MatMul: out of memory for bf16 x");
    F32ToBf16(p.x, xb, static_cast<int64_t>(mk));
    src = xb;
  } else if (p.w_dtype == DType::kF16) {
    const size_t nk = static_cast<size_t>(p.n) * static_cast<size_t>(p.k);
    float* xh = src_.Get<float>(mk);
    float* wf = weights_.Get<float>(nk);
    if (xh == nullptr || wf == nullptr) {
      return absl::ResourceExhaustedError("MatMul: out of memory for f16 operands");
    }
    for (size_t i = 0; i < mk; ++i) xh[i] = F16ToFloat(FloatToF16(p.x[i]));
    const auto* wh = static_cast<const uint16_t*>(p.w);
    for (size_t i = 0; i < nk; ++i) wf[i] = F16ToFloat(wh[i]);
    src = xh;
    wei = wf;
  }

  OmpThreadsScope omp_threads(key.threads);  // oneDNN sizes and runs its team from this
  Entry* e = nullptr;
  TANDEM_RETURN_IF_ERROR(Lookup(key, &e));
  TANDEM_DNNL_CALL(absl::StrCat("running the ", DescribeKey(key.m, key.n, key.k, key.bf16)), {
    std::unordered_map<int, dnnl::memory> args;
    e->src.set_data_handle(const_cast<void*>(src));
    e->wei.set_data_handle(const_cast<void*>(wei));
    e->dst.set_data_handle(p.y);
    args[DNNL_ARG_SRC] = e->src;
    args[DNNL_ARG_WEIGHTS] = e->wei;
    args[DNNL_ARG_DST] = e->dst;
    if (key.bias) {
      e->bias.set_data_handle(const_cast<float*>(p.bias));
      args[DNNL_ARG_BIAS] = e->bias;
    }
    if (e->scratch_bytes > 0) {
      std::byte* pad = scratchpad_.Get<std::byte>(e->scratch_bytes);
      if (pad == nullptr) return absl::ResourceExhaustedError("MatMul: out of memory for scratch");
      e->scratch.set_data_handle(pad);
      args[DNNL_ARG_SCRATCHPAD] = e->scratch;
    }
    e->prim.execute(stream_, args);
    stream_.wait();
  });
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
