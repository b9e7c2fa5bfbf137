#include "tandem/gpu_worker/shard_migrator.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "node_rpc.h"
#include "spdlog/spdlog.h"
#include "tandem/common/grpc_status.h"

namespace tandem::gpu_worker {
namespace {

std::string ShardName(const MigrationJob& job) {
  return absl::StrCat("shard (", job.layer, ", ", job.kv_head, ")");
}

}  // namespace

ShardMigrator::ShardMigrator(NodePool& pool, const ShardMigratorOptions& options)
    : pool_(pool), options_(options), thread_([this] { Loop(); }) {}

ShardMigrator::~ShardMigrator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cancel_ = true;
    queue_.clear();
    CancelActiveLocked();
  }
  cv_.notify_all();
  thread_.join();
}

void ShardMigrator::Enqueue(const MigrationJob& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(job);
  }
  cv_.notify_all();
}

std::vector<ShardMigrator::Finished> ShardMigrator::TakeFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(finished_, {});
}

size_t ShardMigrator::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + (busy_ ? 1 : 0);
}

uint64_t ShardMigrator::bytes_copied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_copied_;
}

void ShardMigrator::CancelActiveLocked() {
  if (active_export_ != nullptr) active_export_->TryCancel();
  if (active_append_ != nullptr) active_append_->TryCancel();
}

std::vector<MigrationJob> ShardMigrator::CancelAll() {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<MigrationJob> dropped(queue_.begin(), queue_.end());
  queue_.clear();
  cancel_ = true;
  CancelActiveLocked();
  idle_cv_.wait(lock, [this] { return !busy_; });
  cancel_ = false;
  // The interrupted job reported itself as finished with an error: hand it back here instead.
  for (const Finished& f : finished_) dropped.push_back(f.job);
  finished_.clear();
  return dropped;
}

void ShardMigrator::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const MigrationJob job = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<uint64_t> copied = CopyRange(job, 0);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    lock.lock();
    Finished f;
    f.job = job;
    f.seconds = took.count();
    if (copied.ok()) {
      f.copied = *copied;
    } else {
      f.status = copied.status();
    }
    finished_.push_back(std::move(f));
    busy_ = false;
    idle_cv_.notify_all();
  }
}

absl::StatusOr<uint64_t> ShardMigrator::CopyRange(const MigrationJob& job, uint64_t from_entry) {
  const size_t row = static_cast<size_t>(options_.head_dim) * DTypeBytes(options_.kv_dtype);
  v1::ExportShardRequest export_request;
  export_request.set_session_id(options_.session_id);
  export_request.mutable_shard()->set_layer(job.layer);
  export_request.mutable_shard()->set_kv_head(job.kv_head);
  export_request.set_from_entry(from_entry);
  export_request.set_max_chunk_entries(options_.chunk_entries);
  grpc::ClientContext export_ctx;
  SetDeadline(export_ctx, options_.deadline_ms);
  std::unique_ptr<grpc::ClientReader<v1::ExportShardChunk>> reader =
      pool_.stub(job.from).ExportShard(&export_ctx, export_request);

  grpc::ClientContext append_ctx;
  SetDeadline(append_ctx, options_.deadline_ms);
  v1::AppendKvResponse append_response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendKvRequest>> writer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_export_ = &export_ctx;
    active_append_ = &append_ctx;
    if (cancel_) CancelActiveLocked();
  }
  // Unregisters the contexts before they go out of scope, whatever path returns.
  struct Unregister {
    ShardMigrator* self;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->active_export_ = self->active_append_ = nullptr;
    }
  } unregister{this};

  uint64_t next = from_entry;
  uint64_t bytes = 0;
  bool cancelled = false;
  v1::ExportShardChunk chunk;
  while (reader->Read(&chunk)) {
    const uint64_t n = chunk.num_entries();
    // The chunk comes from another process: check it against what was asked before using it.
    if (chunk.first_entry() != next || n == 0 || chunk.k().data().size() != n * row ||
        chunk.v().data().size() != n * row || chunk.maw().data().size() != n * sizeof(float) ||
        chunk.selected().size() != n) {
      export_ctx.TryCancel();
      (void)reader->Finish();
      if (writer != nullptr) {
        append_ctx.TryCancel();
        (void)writer->Finish();
      }
      return absl::DataLossError(absl::StrCat("CPU node ", pool_.address(job.from), ": ",
                                              ShardName(job), " export chunk at entry ",
                                              chunk.first_entry(), " is malformed"));
    }
    if (writer == nullptr) writer = pool_.stub(job.to).AppendKv(&append_ctx, &append_response);
    v1::AppendKvRequest request;
    request.set_session_id(options_.session_id);
    request.set_layer(job.layer);
    request.add_kv_heads(job.kv_head);
    for (auto [dst, src] : {std::pair{request.mutable_k(), chunk.mutable_k()},
                            std::pair{request.mutable_v(), chunk.mutable_v()}}) {
      dst->set_dtype(src->dtype());
      dst->add_shape(1);
      dst->add_shape(static_cast<int64_t>(n));
      dst->add_shape(options_.head_dim);
      dst->mutable_data()->swap(*src->mutable_data());
    }
    auto* maw = request.mutable_maw();
    maw->set_dtype(v1::DTYPE_F32);
    maw->add_shape(1);
    maw->add_shape(static_cast<int64_t>(n));
    maw->mutable_data()->swap(*chunk.mutable_maw()->mutable_data());
    request.mutable_selected()->swap(*chunk.mutable_selected());
    request.set_window_entries(0);   // ignored: `selected` decides
    if (!writer->Write(request)) break;   // Finish() below says why
    next += n;
    bytes += n * (2 * row + sizeof(float));
    {
      std::lock_guard<std::mutex> lock(mu_);
      bytes_copied_ += n * (2 * row + sizeof(float));
      cancelled = cancel_;
    }
    if (cancelled) {
      export_ctx.TryCancel();
      break;
    }
  }
  const grpc::Status read_status = reader->Finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled = cancelled || cancel_;
  }
  grpc::Status write_status;
  if (writer != nullptr) {
    writer->WritesDone();
    write_status = writer->Finish();
  }
  if (cancelled) return absl::CancelledError(absl::StrCat(ShardName(job), " copy cancelled"));
  if (!read_status.ok()) {
    return absl::Status(FromGrpcStatus(read_status).code(),
                        absl::StrCat("CPU node ", pool_.address(job.from), ": ExportShard of ",
                                     ShardName(job), ": ", read_status.error_message()));
  }
  if (!write_status.ok()) {
    return absl::Status(FromGrpcStatus(write_status).code(),
                        absl::StrCat("CPU node ", pool_.address(job.to), ": AppendKv of ",
                                     ShardName(job), ": ", write_status.error_message()));
  }
  spdlog::debug("{}: copied entries [{}, {}) from {} to {} ({} bytes)", ShardName(job),
                from_entry, next, pool_.address(job.from), pool_.address(job.to), bytes);
  return next;
}

}  // namespace tandem::gpu_worker
