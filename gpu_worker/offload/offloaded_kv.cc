#include "tandem/gpu_worker/offloaded_kv.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<std::unique_ptr<OffloadedKv>> OffloadedKv::Create(Backend& backend,
                                                                 const WindowGeometry& geometry,
                                                                 int64_t page_tokens) {
  if (geometry.num_layers <= 0 || geometry.num_kv_heads <= 0 || geometry.head_dim <= 0 ||
      (geometry.dtype != DType::kF32 && geometry.dtype != DType::kBF16)) {
    return absl::InvalidArgumentError("offloaded KV: bad geometry");
  }
  if (page_tokens < 1 || page_tokens > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("offloaded KV: page of ", page_tokens, " tokens; must be 1..1048576"));
  }
  return std::unique_ptr<OffloadedKv>(new OffloadedKv(backend, geometry, page_tokens));
}

OffloadedKv::OffloadedKv(Backend& backend, const WindowGeometry& geometry, int64_t page_tokens)
    : backend_(backend),
      geometry_(geometry),
      page_tokens_(page_tokens),
      row_bytes_(geometry.head_dim * DTypeBytes(geometry.dtype)),
      half_page_bytes_(HalfPageBytes(geometry, page_tokens)),
      layers_(geometry.num_layers),
      tokens_(geometry.num_layers, 0) {}

size_t OffloadedKv::HostBytesFor(const WindowGeometry& geometry, int64_t page_tokens,
                                 int64_t tokens) {
  if (page_tokens < 1 || tokens <= 0) return 0;
  const int64_t pages = (tokens + page_tokens - 1) / page_tokens;
  return static_cast<size_t>(geometry.num_layers) * pages * 2 *
         HalfPageBytes(geometry, page_tokens);
}

size_t OffloadedKv::HalfPageBytes(const WindowGeometry& geometry, int64_t page_tokens) {
  return geometry.num_kv_heads * page_tokens * geometry.head_dim * DTypeBytes(geometry.dtype);
}

absl::StatusOr<std::unique_ptr<OffloadedKv>> OffloadedKv::Clone() const {
  auto copy = std::unique_ptr<OffloadedKv>(new OffloadedKv(backend_, geometry_, page_tokens_));
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (const DeviceBuffer& page : layers_[l]) {
      TANDEM_ASSIGN_OR_RETURN(DeviceBuffer fresh, backend_.AllocateHost(page.bytes()));
      std::memcpy(fresh.data(), page.data(), page.bytes());
      copy->host_bytes_ += fresh.bytes();
      copy->layers_[l].push_back(std::move(fresh));
    }
  }
  copy->tokens_ = tokens_;
  return copy;
}

OffloadedKv::Page OffloadedKv::page(int64_t layer, int64_t index) const {
  const DeviceBuffer& buffer = layers_[layer][index];
  const char* base = static_cast<const char*>(buffer.data());
  const int64_t filled = std::min(page_tokens_, tokens_[layer] - index * page_tokens_);
  return {base, base + half_page_bytes_, filled};
}

absl::Status OffloadedKv::Append(int64_t layer, const void* k_host, const void* v_host,
                                 int64_t n) {
  return AppendImpl(layer, k_host, v_host, n, /*from_device=*/false);
}

absl::Status OffloadedKv::AppendFromDevice(int64_t layer, const void* k, const void* v,
                                           int64_t n) {
  return AppendImpl(layer, k, v, n, /*from_device=*/true);
}

absl::Status OffloadedKv::AppendImpl(int64_t layer, const void* k, const void* v, int64_t n,
                                     bool from_device) {
  if (layer < 0 || layer >= geometry_.num_layers || n <= 0 || k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("offloaded KV: bad layer, count or pointer");
  }
  const int64_t heads = geometry_.num_kv_heads;
  std::vector<DeviceBuffer>& pages = layers_[layer];
  for (int64_t done = 0; done < n;) {
    const int64_t at = tokens_[layer] % page_tokens_;
    if (at == 0 && tokens_[layer] / page_tokens_ == static_cast<int64_t>(pages.size())) {
      TANDEM_ASSIGN_OR_RETURN(DeviceBuffer page, backend_.AllocateHost(2 * half_page_bytes_));
      host_bytes_ += page.bytes();
      pages.push_back(std::move(page));
    }
    const int64_t count = std::min(page_tokens_ - at, n - done);
    char* dst = static_cast<char*>(pages[tokens_[layer] / page_tokens_].data());
    // Rows: one per kv head, `count` entries each, from source pitch n and page pitch P.
    const size_t src_pitch = n * row_bytes_;
    const size_t dst_pitch = page_tokens_ * row_bytes_;
    const size_t width = count * row_bytes_;
    for (int half = 0; half < 2; ++half) {
      const char* src = static_cast<const char*>(half == 0 ? k : v) + done * row_bytes_;
      char* to = dst + half * half_page_bytes_ + at * row_bytes_;
      if (from_device) {
        TANDEM_RETURN_IF_ERROR(
            backend_.CopyToHost2D(to, dst_pitch, src, src_pitch, width, heads));
      } else {
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(to + h * dst_pitch, src + h * src_pitch, width);
        }
      }
    }
    tokens_[layer] += count;
    done += count;
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
