#include "tandem/gpu_worker/remote_kv.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

// Largest payload of one AppendKv message; a longer eviction is split by tokens.
constexpr size_t kAppendMessageBytes = 4 << 20;

v1::DType WireType(DType dtype) { return dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32; }

void SetDeadline(grpc::ClientContext& ctx, int ms) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

absl::Status NodeError(const std::string& address, const char* what, const grpc::Status& s) {
  absl::Status status = FromGrpcStatus(s);
  return absl::Status(status.code(),
                      absl::StrCat("CPU node ", address, ": ", what, ": ", status.message()));
}

}  // namespace

RemoteKv::RemoteKv(NodePool& pool, const RemoteKvOptions& options)
    : pool_(pool),
      options_(options),
      opened_(pool.size(), false),
      lost_(pool.size(), false),
      last_selection_(options.num_layers),
      share_sum_(options.num_layers, 0.0),
      share_count_(options.num_layers, 0) {}

size_t RemoteKv::NodeOf(int64_t layer, int64_t kv_head) const {
  return static_cast<size_t>(layer * options_.num_kv_heads + kv_head) % pool_.size();
}

std::vector<uint32_t> RemoteKv::HeadsOf(size_t node, int64_t layer) const {
  std::vector<uint32_t> heads;
  for (int64_t h = 0; h < options_.num_kv_heads; ++h) {
    if (NodeOf(layer, h) == node) heads.push_back(static_cast<uint32_t>(h));
  }
  return heads;
}

absl::StatusOr<std::unique_ptr<RemoteKv>> RemoteKv::Open(NodePool& pool,
                                                         const RemoteKvOptions& options) {
  if (pool.size() == 0) return absl::FailedPreconditionError("no CPU attention nodes");
  if (options.kv_dtype != DType::kBF16 && options.kv_dtype != DType::kF32) {
    return absl::InvalidArgumentError("offloaded KV must be bf16 or f32");
  }
  auto kv = std::unique_ptr<RemoteKv>(new RemoteKv(pool, options));
  for (size_t n = 0; n < pool.size(); ++n) {
    v1::OpenSessionRequest request;
    request.set_session_id(options.session_id);
    auto* g = request.mutable_geometry();
    g->set_num_layers(options.num_layers);
    g->set_num_q_heads(options.num_q_heads);
    g->set_num_kv_heads(options.num_kv_heads);
    g->set_head_dim(options.head_dim);
    request.set_block_size(options.block_tokens);
    request.set_kv_dtype(WireType(options.kv_dtype));
    request.set_beta(options.beta);
    bool any = false;
    for (int64_t l = 0; l < options.num_layers; ++l) {
      for (uint32_t h : kv->HeadsOf(n, l)) {
        auto* shard = request.add_shards();
        shard->set_layer(l);
        shard->set_kv_head(h);
        any = true;
      }
    }
    if (!any) continue;   // more nodes than shards
    grpc::ClientContext ctx;
    SetDeadline(ctx, options.control_deadline_ms);
    v1::OpenSessionResponse response;
    const grpc::Status s = pool.stub(n).OpenSession(&ctx, request, &response);
    if (!s.ok()) return NodeError(pool.address(n), "OpenSession", s);
    kv->opened_[n] = true;
  }
  return kv;
}

RemoteKv::~RemoteKv() { (void)Close(); }

absl::Status RemoteKv::Append(int64_t layer, const void* k, const void* v, const float* maw,
                              int64_t num_tokens, int64_t window_entries) {
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0 || window_entries <= 0) {
    return absl::InvalidArgumentError("RemoteKv::Append: bad layer, token count or window");
  }
  const size_t elem = DTypeBytes(options_.kv_dtype);
  const size_t row = options_.head_dim * elem;
  for (size_t n = 0; n < pool_.size(); ++n) {
    if (!opened_[n] || lost_[n]) continue;
    const std::vector<uint32_t> heads = HeadsOf(n, layer);
    if (heads.empty()) continue;
    const int64_t per_message = std::max<int64_t>(
        1, static_cast<int64_t>(kAppendMessageBytes / (2 * row * heads.size())));
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.control_deadline_ms);
    v1::AppendKvResponse response;
    auto writer = pool_.stub(n).AppendKv(&ctx, &response);
    bool write_ok = true;
    for (int64_t t0 = 0; t0 < num_tokens && write_ok; t0 += per_message) {
      const int64_t count = std::min(per_message, num_tokens - t0);
      v1::AppendKvRequest request;
      request.set_session_id(options_.session_id);
      request.set_layer(layer);
      request.set_window_entries(window_entries);
      for (uint32_t h : heads) request.add_kv_heads(h);
      std::string* kd = nullptr;
      std::string* vd = nullptr;
      for (auto [tensor, data] : {std::pair{request.mutable_k(), &kd},
                                  std::pair{request.mutable_v(), &vd}}) {
        tensor->set_dtype(WireType(options_.kv_dtype));
        tensor->add_shape(heads.size());
        tensor->add_shape(count);
        tensor->add_shape(options_.head_dim);
        *data = tensor->mutable_data();
        (*data)->resize(heads.size() * count * row);
      }
      auto* mt = request.mutable_maw();
      mt->set_dtype(v1::DTYPE_F32);
      mt->add_shape(heads.size());
      mt->add_shape(count);
      std::string* md = mt->mutable_data();
      md->resize(heads.size() * count * sizeof(float));
      for (size_t i = 0; i < heads.size(); ++i) {
        const size_t src = (heads[i] * num_tokens + t0) * row;
        std::memcpy(kd->data() + i * count * row, static_cast<const char*>(k) + src, count * row);
        std::memcpy(vd->data() + i * count * row, static_cast<const char*>(v) + src, count * row);
        std::memcpy(md->data() + i * count * sizeof(float), maw + heads[i] * num_tokens + t0,
                    count * sizeof(float));
      }
      write_ok = writer->Write(request);
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (!s.ok()) {
      lost_[n] = true;
      return NodeError(pool_.address(n), "AppendKv", s);
    }
  }
  if (layer == options_.num_layers - 1) offloaded_tokens_ += num_tokens;
  return absl::OkStatus();
}

absl::Status RemoteKv::StartAttend(int64_t layer, const float* q, int64_t num_tokens) {
  if (!calls_.empty()) return absl::FailedPreconditionError("an Attend is already in flight");
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0) {
    return absl::InvalidArgumentError("RemoteKv::StartAttend: bad layer or token count");
  }
  attend_layer_ = layer;
  attend_tokens_ = num_tokens;
  const size_t q_bytes = num_tokens * options_.num_q_heads * options_.head_dim * sizeof(float);
  for (size_t n = 0; n < pool_.size(); ++n) {
    if (!opened_[n] || lost_[n] || HeadsOf(n, layer).empty()) continue;
    auto call = std::make_unique<PendingCall>();
    call->node = n;
    call->request.set_layer(layer);
    auto* query = call->request.add_queries();
    query->set_session_id(options_.session_id);
    auto* qt = query->mutable_q();
    qt->set_dtype(v1::DTYPE_F32);
    qt->add_shape(num_tokens);
    qt->add_shape(options_.num_q_heads);
    qt->add_shape(options_.head_dim);
    qt->mutable_data()->assign(reinterpret_cast<const char*>(q), q_bytes);
    SetDeadline(call->context, options_.attend_deadline_ms);
    calls_.push_back(std::move(call));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_ = calls_.size();
  }
  for (auto& call : calls_) {
    PendingCall* c = call.get();
    pool_.stub(c->node).async()->Attend(&c->context, &c->request, &c->response,
                                        [this, c](grpc::Status status) {
                                          std::lock_guard<std::mutex> lock(mu_);
                                          c->status = std::move(status);
                                          if (--outstanding_ == 0) done_cv_.notify_all();
                                        });
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> RemoteKv::FinishAttend(float* o, float* lse) {
  if (attend_layer_ < 0) return absl::FailedPreconditionError("no Attend in flight");
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return outstanding_ == 0; });
  }
  const int64_t T = attend_tokens_, Hq = options_.num_q_heads, D = options_.head_dim;
  const int64_t G = Hq / options_.num_kv_heads;
  std::fill_n(o, T * Hq * D, 0.0f);
  std::fill_n(lse, T * Hq, -std::numeric_limits<float>::infinity());
  const int64_t layer = attend_layer_;
  bool degraded = false;
  // A node without a call (lost, or its session never opened) owns heads nobody answers for.
  std::vector<bool> answered(pool_.size(), false);
  LayerSelection selection;
  for (auto& call : calls_) {
    if (!call->status.ok() || call->response.results_size() != 1) continue;
    const v1::AttendResult& r = call->response.results(0);
    const int64_t own = r.kv_heads_size();
    if (r.o().data().size() != static_cast<size_t>(T * own * G * D) * 4 ||
        r.lse().data().size() != static_cast<size_t>(T * own * G) * 4) {
      continue;
    }
    const float* ro = reinterpret_cast<const float*>(r.o().data().data());
    const float* rl = reinterpret_cast<const float*>(r.lse().data().data());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < own; ++h) {
        const int64_t kv_head = r.kv_heads(h);
        if (kv_head >= options_.num_kv_heads) continue;
        for (int64_t j = 0; j < G; ++j) {
          const int64_t src_row = t * own * G + h * G + j;
          const int64_t dst_row = t * Hq + kv_head * G + j;
          std::memcpy(o + dst_row * D, ro + src_row * D, D * sizeof(float));
          lse[dst_row] = rl[src_row];
        }
      }
    }
    for (int i = 0; i < r.selected_size() && i < r.held_size(); ++i) {
      selection.selected += r.selected(i);
      selection.held += r.held(i);
    }
    answered[call->node] = true;
  }
  for (size_t n = 0; n < pool_.size(); ++n) {
    if (!HeadsOf(n, layer).empty() && !answered[n]) degraded = true;
  }
  calls_.clear();
  attend_layer_ = -1;
  last_selection_[layer] = selection;
  if (selection.held > 0) {
    share_sum_[layer] += static_cast<double>(selection.selected) / selection.held;
    share_count_[layer] += 1;
  }
  if (degraded) ++degraded_attends_;
  return degraded;
}

absl::Status RemoteKv::Reselect(int64_t layer, const float* q, int64_t num_tokens,
                                std::optional<float> beta) {
  const size_t q_bytes = num_tokens * options_.num_q_heads * options_.head_dim * sizeof(float);
  for (size_t n = 0; n < pool_.size(); ++n) {
    if (!opened_[n] || lost_[n] || HeadsOf(n, layer).empty()) continue;
    v1::ReselectRequest request;
    request.set_session_id(options_.session_id);
    request.set_layer(layer);
    auto* qt = request.mutable_q();
    qt->set_dtype(v1::DTYPE_F32);
    qt->add_shape(num_tokens);
    qt->add_shape(options_.num_q_heads);
    qt->add_shape(options_.head_dim);
    qt->mutable_data()->assign(reinterpret_cast<const char*>(q), q_bytes);
    if (beta.has_value()) request.set_beta(*beta);
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.control_deadline_ms);
    v1::ReselectResponse response;
    const grpc::Status s = pool_.stub(n).Reselect(&ctx, request, &response);
    if (!s.ok()) return NodeError(pool_.address(n), "Reselect", s);
  }
  if (beta.has_value()) options_.beta = *beta;
  return absl::OkStatus();
}

absl::Status RemoteKv::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (attend_layer_ >= 0) {   // never leave a completion pointing at this object
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return outstanding_ == 0; });
  }
  absl::Status first_error;
  for (size_t n = 0; n < pool_.size(); ++n) {
    if (!opened_[n]) continue;
    v1::CloseSessionRequest request;
    request.set_session_id(options_.session_id);
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.control_deadline_ms);
    v1::CloseSessionResponse response;
    const grpc::Status s = pool_.stub(n).CloseSession(&ctx, request, &response);
    if (!s.ok() && first_error.ok()) first_error = NodeError(pool_.address(n), "CloseSession", s);
  }
  return first_error;
}

std::vector<double> RemoteKv::MeanSelectedShare() const {
  std::vector<double> share(options_.num_layers, 0.0);
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    if (share_count_[l] > 0) share[l] = share_sum_[l] / share_count_[l];
  }
  return share;
}

}  // namespace tandem::gpu_worker
