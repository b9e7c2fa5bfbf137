// CpuAttentionNode's shard migration: ReshardSession (the owned shards change, the metadata
// charge follows them) and the export of a shard's entries in chunks (StartExport, ShardExport,
// ExportShard); the import is AppendKv with `selected` (cpu_attention_node.cc).
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "node_requests.h"
#include "session_owners.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/kv_store/int8_rows.h"

namespace tandem::cpu_attention {
namespace {

using internal::CheckOpen;
using internal::Draining;
using internal::ProtoDType;
using internal::ShardKeys;
using kv_store::KvDType;
using kv_store::Session;
using kv_store::Shard;

}  // namespace

absl::Status CpuAttentionNode::ReshardSession(const v1::ReshardSessionRequest& request,
                                              v1::ReshardSessionResponse* response,
                                              const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_.Find(request.session_id()));
  if (request.add_size() > 0 && draining()) return Draining("adding shards");
  TANDEM_ASSIGN_OR_RETURN(const std::vector<kv_store::ShardKey> add,
                          ShardKeys(request.add(), "add", session->geometry()));
  TANDEM_ASSIGN_OR_RETURN(const std::vector<kv_store::ShardKey> drop,
                          ShardKeys(request.drop(), "drop", session->geometry()));
  // Added shards are charged before they exist; the charge is then set to the owned count.
  const uint64_t extra = internal::SessionMetadataBytes(0, add.size()) -
                         internal::SessionMetadataBytes(0, 0);
  TANDEM_RETURN_IF_ERROR(Budget().Charge(extra));
  absl::StatusOr<kv_store::ReshardStats> resharded = store_.Reshard(*session, add, drop);
  if (!resharded.ok()) {
    Budget().Release(extra);
    return resharded.status();
  }
  const kv_store::ReshardStats& stats = *resharded;
  const uint64_t before = owners_->charged(request.session_id());
  if (before > 0) {   // sessions opened through OpenSession (the store's own ones are not charged)
    const uint64_t now =
        internal::SessionMetadataBytes(session->geometry().num_layers, stats.shards);
    Budget().Release(before + extra - now);
    owners_->SetCharged(request.session_id(), now);
  } else {
    Budget().Release(extra);
  }
  response->set_free_bytes(store_.budget().free());
  response->set_blocks_released(stats.blocks_released);
  response->set_shards(static_cast<uint32_t>(stats.shards));
  return absl::OkStatus();
}

absl::StatusOr<ShardExport> CpuAttentionNode::StartExport(const v1::ExportShardRequest& request,
                                                          uint64_t max_chunk_bytes,
                                                          const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  constexpr uint32_t kDefaultChunkEntries = 4096;
  constexpr uint32_t kMaxChunkEntries = 65536;
  if (request.max_chunk_entries() > kMaxChunkEntries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_entries ", request.max_chunk_entries(), " exceeds ", kMaxChunkEntries));
  }
  ShardExport e;
  TANDEM_ASSIGN_OR_RETURN(e.session_, store_.Find(request.session_id()));
  const Session& session = *e.session_;
  e.key_ = {request.shard().layer(), request.shard().kv_head()};
  {
    std::shared_lock lock(session.mutex());
    TANDEM_RETURN_IF_ERROR(CheckOpen(session));
    const Shard* shard = session.shard(e.key_.layer, e.key_.kv_head);
    if (shard == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("session '", session.id(),
                                                     "' does not own (layer ", e.key_.layer,
                                                     ", kv_head ", e.key_.kv_head, ")"));
    }
    const uint64_t held = shard->held();
    const uint64_t to = request.to_entry() == 0 ? held : request.to_entry();
    if (request.from_entry() > held || to > held) {
      return absl::OutOfRangeError(
          absl::StrCat("entries [", request.from_entry(), ", ", to, ") of (layer ", e.key_.layer,
                       ", kv_head ", e.key_.kv_head, ") are not all held: it holds ", held));
    }
    if (request.from_entry() > to) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_entry ", request.from_entry(), " > to_entry ", to));
    }
    e.serial_ = shard->serial();
    e.next_ = request.from_entry();
    e.end_ = to;
  }
  // Bytes per entry in a chunk: K and V rows (of the session's kv_dtype, as AppendKv takes
  // them), the MAW float, the flag.
  const uint64_t entry_bytes = 2 * session.options().input_row_bytes() + sizeof(float) + 1;
  const uint64_t by_bytes = std::max<uint64_t>(1, max_chunk_bytes / entry_bytes);
  const uint32_t wanted =
      request.max_chunk_entries() == 0 ? kDefaultChunkEntries : request.max_chunk_entries();
  e.chunk_entries_ = static_cast<uint32_t>(std::min<uint64_t>(wanted, by_bytes));
  return e;
}

absl::Status ShardExport::Next(v1::ExportShardChunk* chunk) {
  if (done()) return absl::FailedPreconditionError("the export is complete");
  const Session& session = *session_;
  std::shared_lock lock(session.mutex());
  TANDEM_RETURN_IF_ERROR(CheckOpen(session));
  const Shard* shard = session.shard(key_.layer, key_.kv_head);
  if (shard == nullptr || shard->serial() != serial_ || shard->held() < end_) {
    return absl::AbortedError(absl::StrCat("shard (layer ", key_.layer, ", kv_head ", key_.kv_head,
                                           ") of session '", session.id(),
                                           "' was dropped during the export"));
  }
  const uint64_t n = std::min<uint64_t>(chunk_entries_, end_ - next_);
  const auto& g = session.geometry();
  const v1::DType dtype = ProtoDType(session.options().dtype);
  const size_t row = session.options().input_row_bytes();
  chunk->Clear();
  chunk->set_first_entry(next_);
  chunk->set_num_entries(static_cast<uint32_t>(n));
  chunk->set_held(shard->held());
  auto init = [n](v1::Tensor* t, v1::DType type, std::initializer_list<int64_t> shape,
                  size_t bytes) {
    t->set_dtype(type);
    t->mutable_shape()->Assign(shape.begin(), shape.end());
    std::string* data = t->mutable_data();
    data->resize(bytes);
    return reinterpret_cast<std::byte*>(data->data());
  };
  const int64_t rows = static_cast<int64_t>(n);
  std::byte* k = init(chunk->mutable_k(), dtype, {rows, g.head_dim}, n * row);
  std::byte* v = init(chunk->mutable_v(), dtype, {rows, g.head_dim}, n * row);
  auto* maw = reinterpret_cast<float*>(
      init(chunk->mutable_maw(), v1::DTYPE_F32, {rows}, n * sizeof(float)));
  std::string* flags = chunk->mutable_selected();
  flags->resize(n);
  uint8_t* selected = reinterpret_cast<uint8_t*>(flags->data());
  if (!session.options().int8_storage) {
    TANDEM_RETURN_IF_ERROR(shard->ReadEntries(next_, n, k, v, maw, selected));
  } else {
    // Stored rows out, dequantised to the session's kv_dtype: the importing node quantises
    // again (an int8 node gets the same codes back: see int8_rows.h) or keeps them as sent.
    const size_t stored = shard->format().row_bytes();
    std::vector<std::byte> rows(2 * n * stored);
    TANDEM_RETURN_IF_ERROR(
        shard->ReadEntries(next_, n, rows.data(), rows.data() + n * stored, maw, selected));
    kv_store::ConvertRows(rows.data(), KvDType::kInt8, n, g.head_dim, k, session.options().dtype);
    kv_store::ConvertRows(rows.data() + n * stored, KvDType::kInt8, n, g.head_dim, v,
                          session.options().dtype);
  }
  next_ += n;
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::ExportShard(
    const v1::ExportShardRequest& request,
    absl::FunctionRef<absl::Status(const v1::ExportShardChunk&)> emit, uint64_t max_chunk_bytes) {
  TANDEM_ASSIGN_OR_RETURN(ShardExport e, StartExport(request, max_chunk_bytes));
  v1::ExportShardChunk chunk;
  while (!e.done()) {
    TANDEM_RETURN_IF_ERROR(e.Next(&chunk));
    TANDEM_RETURN_IF_ERROR(emit(chunk));
  }
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention
