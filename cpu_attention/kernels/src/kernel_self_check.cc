#include "tandem/cpu_attention/kernel_self_check.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/int8_rows.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;

constexpr uint32_t kD = 64, kG = 4;
constexpr size_t kKeys = 300;
// Relative error bound of O: bf16 P·V rounding and int8 codes are in the KV values the
// reference sees, so what is left is f32 accumulation (1e-5) and the kernels' exp2 (1e-6).
constexpr double kTolerance = 2e-3;

// The rows as stored (dtype) and as the reference sees them (f32 of the stored values).
struct Rows {
  std::vector<std::byte> stored;
  std::vector<float> seen;
};

Rows MakeRows(KvDType dtype, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> f32(kKeys * kD);
  for (float& x : f32) x = dist(rng);
  Rows rows;
  const size_t row_bytes = kv_store::BlockFormat{16, kD, dtype}.row_bytes();
  rows.stored.resize(kKeys * row_bytes);
  rows.seen.resize(kKeys * kD);
  if (dtype == KvDType::kF32) {
    std::memcpy(rows.stored.data(), f32.data(), f32.size() * sizeof(float));
    rows.seen = f32;
  } else if (dtype == KvDType::kBf16) {
    auto* bits = reinterpret_cast<bf16_t*>(rows.stored.data());
    for (size_t i = 0; i < f32.size(); ++i) {
      bits[i] = FloatToBf16(f32[i]);
      rows.seen[i] = Bf16ToFloat(bits[i]);
    }
  } else {
    kv_store::QuantizeRowsInt8(reinterpret_cast<const std::byte*>(f32.data()), KvDType::kF32,
                               kKeys, kD, rows.stored.data());
    kv_store::DequantizeRowsInt8(rows.stored.data(), kKeys, kD, KvDType::kF32,
                                 reinterpret_cast<std::byte*>(rows.seen.data()));
  }
  return rows;
}

absl::Status CheckOne(KvDType dtype, uint32_t tokens, ThreadPool& pool) {
  std::mt19937 rng(17 + tokens);
  const Rows k = MakeRows(dtype, rng);
  const Rows v = MakeRows(dtype, rng);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(size_t{tokens} * kG * kD);
  for (float& x : q) x = dist(rng);
  std::vector<float> o(q.size(), 0.0f), lse(size_t{tokens} * kG, 0.0f);

  AttentionParams params;
  params.dtype = dtype;
  params.head_dim = kD;
  params.group = kG;
  params.num_tokens = tokens;
  params.q_token_stride = params.o_token_stride = size_t{kG} * kD;
  params.lse_token_stride = kG;
  HeadProblem head{k.stored.data(), v.stored.data(), kKeys, q.data(), o.data(), lse.data()};
  const std::string what = absl::StrCat(kv_store::KvDTypeName(dtype), " KV, ", tokens,
                                        " token(s), group ", kG, ", head_dim ", kD);
  const absl::Status status = SparseAttention(params, {&head, 1}, pool);
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));

  std::vector<double> ref_o, ref_lse;
  ReferenceAttention(q.data(), k.seen.data(), v.seen.data(), kKeys, tokens, kG, kD,
                     1.0 / std::sqrt(static_cast<double>(kD)), &ref_o, &ref_lse);
  const double err_o = RelativeError(o, ref_o);
  const double err_lse = RelativeError(lse, ref_lse);
  if (err_o > kTolerance || err_lse > kTolerance) {
    return absl::InternalError(absl::StrCat(what, ": output differs from the reference (relative "
                                            "error of O ", err_o, ", of LSE ", err_lse,
                                            "; the bound is ", kTolerance, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAttentionKernels(ThreadPool& pool) {
  for (KvDType dtype : {KvDType::kBf16, KvDType::kF32, KvDType::kInt8}) {
    for (uint32_t tokens : {1u, 3u}) {
      const absl::Status status = CheckOne(dtype, tokens, pool);
      if (status.ok()) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "the CPU attention kernels do not run correctly on this CPU (", CpuIsaSummary(),
          "): ", status.message(),
          ". Try TANDEM_CPU_ISA=avx2 or =portable to run a lesser kernel set, and report it "
          "with the output of lscpu"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention
