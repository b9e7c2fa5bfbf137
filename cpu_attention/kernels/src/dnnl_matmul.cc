#include "dnnl_matmul.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::cpu_attention::internal {
namespace {

using dt = dnnl::memory::data_type;

dt ToDnnl(MmType t) { return t == MmType::kBf16 ? dt::bf16 : dt::f32; }

dnnl::memory::desc Md(int64_t rows, int64_t cols, MmType type,
                      const std::array<int64_t, 2>& strides) {
  return dnnl::memory::desc({rows, cols}, ToDnnl(type), {strides[0], strides[1]});
}

const char* TypeName(MmType t) { return t == MmType::kBf16 ? "bf16" : "f32"; }

std::string Dim(int64_t d) { return d == kRuntimeDim ? "?" : absl::StrCat(d); }

}  // namespace

std::string DescribeMatmul(const MatmulDesc& d) {
  return absl::StrCat("attention matmul [", Dim(d.m), ", ", Dim(d.k), "] ", TypeName(d.src_type),
                      " x [", Dim(d.k), ", ", Dim(d.n), "] ", TypeName(d.wei_type), " -> ",
                      TypeName(d.dst_type));
}

size_t MatmulDescHash::operator()(const MatmulDesc& d) const {
  size_t h = 0;
  auto mix = [&h](uint64_t v) {
    h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  };
  mix(static_cast<uint64_t>(d.m));
  mix(static_cast<uint64_t>(d.k));
  mix(static_cast<uint64_t>(d.n));
  mix(static_cast<uint64_t>(d.src_type) | static_cast<uint64_t>(d.wei_type) << 8 |
      static_cast<uint64_t>(d.dst_type) << 16);
  for (int64_t s : d.src_strides) mix(static_cast<uint64_t>(s));
  for (int64_t s : d.wei_strides) mix(static_cast<uint64_t>(s));
  for (int64_t s : d.dst_strides) mix(static_cast<uint64_t>(s));
  return h;
}

ThreadMatmuls& ThreadMatmuls::ForThisThread() {
  thread_local ThreadMatmuls instance;
  return instance;
}

absl::Status ThreadMatmuls::Init() {
  if (stream_.has_value()) return absl::OkStatus();
  TANDEM_DNNL_CALL("creating the oneDNN CPU engine and stream",
                   engine_.emplace(dnnl::engine::kind::cpu, 0);
                   stream_.emplace(*engine_));
  return absl::OkStatus();
}

absl::Status ThreadMatmuls::Lookup(const MatmulDesc& desc, Entry** entry) {
  if (auto it = index_.find(desc); it != index_.end()) {
    if (it->second != lru_.begin()) lru_.splice(lru_.begin(), lru_, it->second);
    *entry = &*it->second;
    return absl::OkStatus();
  }
  TANDEM_RETURN_IF_ERROR(Init());
  Entry e;
  e.desc = desc;
  e.runtime = desc.m == kRuntimeDim || desc.k == kRuntimeDim || desc.n == kRuntimeDim;
  TANDEM_DNNL_CALL(absl::StrCat("creating the ", DescribeMatmul(desc)), {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const auto src_md = Md(desc.m, desc.k, desc.src_type, desc.src_strides);
    const auto wei_md = Md(desc.k, desc.n, desc.wei_type, desc.wei_strides);
    const auto dst_md = Md(desc.m, desc.n, desc.dst_type, desc.dst_strides);
    e.pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src_md, wei_md, dst_md), attr, *engine_);
    e.prim = dnnl::matmul(e.pd);
    e.scratch_bytes = e.pd.scratchpad_desc().get_size();
    if (e.scratch_bytes > 0) {
      e.scratch = dnnl::memory(e.pd.scratchpad_desc(), *engine_, DNNL_MEMORY_NONE);
      e.args[DNNL_ARG_SCRATCHPAD] = e.scratch;
    }
    if (!e.runtime) {
      e.src = dnnl::memory(src_md, *engine_, DNNL_MEMORY_NONE);
      e.wei = dnnl::memory(wei_md, *engine_, DNNL_MEMORY_NONE);
      e.dst = dnnl::memory(dst_md, *engine_, DNNL_MEMORY_NONE);
      e.args[DNNL_ARG_SRC] = e.src;
      e.args[DNNL_ARG_WEIGHTS] = e.wei;
      e.args[DNNL_ARG_DST] = e.dst;
    }
  });
  if (lru_.size() >= kCapacity) {
    index_.erase(lru_.back().desc);
    lru_.pop_back();
  }
  lru_.push_front(std::move(e));
  index_.emplace(desc, lru_.begin());
  *entry = &lru_.front();
  return absl::OkStatus();
}

absl::Status ThreadMatmuls::Run(const MatmulDesc& desc, int64_t m, int64_t k, int64_t n,
                                const void* src, const void* wei, void* dst) {
  Entry* e = nullptr;
  TANDEM_RETURN_IF_ERROR(Lookup(desc, &e));
  TANDEM_DNNL_CALL(absl::StrCat("running the ", DescribeMatmul(desc), " with m ", m, ", k ", k,
                                ", n ", n),
                   {
    if (e->scratch_bytes > 0) e->scratch.set_data_handle(scratch_.Get<std::byte>(e->scratch_bytes));
    if (e->runtime) {
      std::unordered_map<int, dnnl::memory> args = e->args;
      args[DNNL_ARG_SRC] =
          dnnl::memory(Md(m, k, desc.src_type, desc.src_strides), *engine_, const_cast<void*>(src));
      args[DNNL_ARG_WEIGHTS] =
          dnnl::memory(Md(k, n, desc.wei_type, desc.wei_strides), *engine_, const_cast<void*>(wei));
      args[DNNL_ARG_DST] = dnnl::memory(Md(m, n, desc.dst_type, desc.dst_strides), *engine_, dst);
      e->prim.execute(*stream_, args);
    } else {
      e->src.set_data_handle(const_cast<void*>(src));
      e->wei.set_data_handle(const_cast<void*>(wei));
      e->dst.set_data_handle(dst);
      e->prim.execute(*stream_, e->args);
    }
    stream_->wait();
  });
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention::internal
