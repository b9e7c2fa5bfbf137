// The in-process CPU attention node the node fuzz targets drive, and the session every input
// starts from: a small node (16 MiB pool, one attention thread, no shm, no background release)
// and a "fuzz" session of 2 layers x 2 kv heads x 4 query heads x D 8 with 20 entries per
// shard, in one of three kinds (MAW f32, MAW bf16, pages f32). Each input opens it, runs, and
// closes everything again, so inputs do not depend on each other and a block or session left
// behind is a leak the target reports.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::fuzz {

inline constexpr char kSessionId[] = "fuzz";
inline constexpr uint32_t kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 8;
inline constexpr uint32_t kBaseEntries = 20;  // per shard

enum class BaseKind { kMawF32 = 0, kMawBf16 = 1, kPages = 2 };

inline std::unique_ptr<CpuAttentionNode> MakeNode() {
  NodeOptions options;
  options.pool_bytes = 16ull << 20;
  options.block_tokens = 16;
  options.threads = 1;
  options.max_sessions = 64;
  options.max_query_tokens = 64;
  options.max_batch = 8;
  options.allow_shm = false;  // a fuzzed OpenSession must not map some other process's segment
  options.release_free_after = std::chrono::milliseconds(-1);
  absl::StatusOr<std::unique_ptr<CpuAttentionNode>> node = CpuAttentionNode::Create(options);
  FUZZ_CHECK(node.ok(), node.status().ToString());
  return std::move(*node);
}

inline v1::OpenSessionRequest BaseOpenRequest(BaseKind kind) {
  v1::OpenSessionRequest r;
  r.set_session_id(kSessionId);
  r.mutable_geometry()->set_num_layers(kLayers);
  r.mutable_geometry()->set_num_q_heads(kQHeads);
  r.mutable_geometry()->set_num_kv_heads(kKvHeads);
  r.mutable_geometry()->set_head_dim(kHeadDim);
  r.set_block_size(16);
  r.set_kv_dtype(kind == BaseKind::kMawBf16 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
  r.set_beta(0.5f);
  if (kind == BaseKind::kPages) {
    r.set_selection(v1::SELECTION_PAGES);
    r.set_page_tokens(8);
  }
  return r;
}

// Opens the base session and appends kBaseEntries deterministic entries to every shard.
inline void OpenBase(CpuAttentionNode& node, BaseKind kind) {
  v1::OpenSessionResponse opened;
  const absl::Status open = node.OpenSession(BaseOpenRequest(kind), &opened);
  FUZZ_CHECK(open.ok(), open.ToString());
  const bool bf16 = kind == BaseKind::kMawBf16;
  std::vector<float> kv(kKvHeads * kBaseEntries * kHeadDim), maw(kKvHeads * kBaseEntries);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(i % 13) * 0.125f - 0.75f;
  for (size_t i = 0; i < maw.size(); ++i) maw[i] = static_cast<float>(i % 7) * 0.25f;
  const int64_t kv_shape[] = {kKvHeads, kBaseEntries, kHeadDim};
  const int64_t maw_shape[] = {kKvHeads, kBaseEntries};
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    v1::AppendKvRequest append;
    append.set_session_id(kSessionId);
    append.set_layer(layer);
    append.set_window_entries(4);
    if (bf16) {
      EncodeBf16(kv, kv_shape, append.mutable_k());
      EncodeBf16(kv, kv_shape, append.mutable_v());
    } else {
      EncodeF32(kv, kv_shape, append.mutable_k());
      EncodeF32(kv, kv_shape, append.mutable_v());
    }
    EncodeF32(maw, maw_shape, append.mutable_maw());
    v1::AppendKvResponse totals;
    const absl::Status appended = node.AppendKv(append, &totals);
    FUZZ_CHECK(appended.ok(), appended.ToString());
  }
}

inline void Close(CpuAttentionNode& node, const std::string& id) {
  v1::CloseSessionRequest close;
  close.set_session_id(id);
  v1::CloseSessionResponse closed;
  (void)node.CloseSession(close, &closed);
}

// After every session is closed the pool must be empty again.
inline void CheckEmpty(const CpuAttentionNode& node) {
  const v1::StatsResponse stats = node.Stats();
  FUZZ_CHECK(stats.sessions() == 0 && stats.used_bytes() == 0 && stats.blocks_in_use() == 0,
             absl::StrCat("leaked: ", stats.sessions(), " sessions, ", stats.used_bytes(),
                          " bytes, ", stats.blocks_in_use(), " blocks"));
}

}  // namespace tandem::cpu_attention::fuzz
