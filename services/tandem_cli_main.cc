// tandem: the client CLI.
//
//   tandem attend --server=HOST:PORT [geometry and size flags]
//       The attention round trip: opens a session on a CPU attention node, streams random KV
//       (with MAW) into it, runs decode-style Attend calls for every layer, checks layer 0's
//       result against a double-precision reference computed here, re-selects, closes, and
//       prints results and timings. Without --server an embedded node runs in-process.
//   tandem stats --server=HOST:PORT
//       Prints the node's Stats.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/common/bf16.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

ABSL_FLAG(std::string, server, "", "CPU attention node host:port; empty = embedded node");
ABSL_FLAG(unsigned, layers, 4, "layers");
ABSL_FLAG(unsigned, q_heads, 32, "query heads");
ABSL_FLAG(unsigned, kv_heads, 8, "KV heads");
ABSL_FLAG(unsigned, head_dim, 128, "head dimension");
ABSL_FLAG(unsigned, tokens, 16384, "offloaded tokens per (layer, kv-head)");
ABSL_FLAG(unsigned, block_tokens, 64, "tokens per KV block");
ABSL_FLAG(unsigned, chunk_tokens, 1024, "tokens per AppendKv message");
ABSL_FLAG(unsigned, window_entries, 512, "GPU window size the MAW values refer to");
ABSL_FLAG(double, beta, 0.0, "selection threshold (0 = dense, exact)");
ABSL_FLAG(std::string, dtype, "bf16", "KV dtype: bf16 or f32");
ABSL_FLAG(unsigned, decode_steps, 16, "Attend calls per layer");
ABSL_FLAG(unsigned, deadline_ms, 30000, "deadline of every RPC");
ABSL_FLAG(unsigned, seed, 1, "random seed");

namespace {

namespace v1 = tandem::v1;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms)));
  return ctx;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

void PrintStats(const char* when, const v1::StatsResponse& s) {
  std::printf(
      "stats %-7s sessions=%u blocks=%llu used=%.1f MiB stored=%.1f MiB selected=%.1f MiB "
      "threads=%u scan=%.2f GB/s\n",
      when, s.sessions(), static_cast<unsigned long long>(s.blocks_in_use()),
      s.used_bytes() / 1048576.0, s.stored_bytes() / 1048576.0,
      s.selected_bytes() / 1048576.0, s.threads(), s.scan_bytes_per_second() / 1e9);
}

// K, V of one layer: [kv_heads, tokens, head_dim] as floats already rounded to the KV dtype,
// and MAW [kv_heads, tokens].
struct LayerKv {
  std::vector<float> k, v, maw;
};

LayerKv MakeLayer(unsigned layer, bool bf16) {
  const size_t heads = absl::GetFlag(FLAGS_kv_heads), tokens = absl::GetFlag(FLAGS_tokens),
               dim = absl::GetFlag(FLAGS_head_dim);
  std::mt19937 rng(absl::GetFlag(FLAGS_seed) * 7919u + layer);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::exponential_distribution<float> expo(1.0f);
  LayerKv kv;
  kv.k.resize(heads * tokens * dim);
  kv.v.resize(kv.k.size());
  kv.maw.resize(heads * tokens);
  for (float& x : kv.k) x = normal(rng);
  for (float& x : kv.v) x = normal(rng);
  // MAW: mean 1/window, heavy tail, as an attention weight averaged over steps would be.
  const float mean = 1.0f / absl::GetFlag(FLAGS_window_entries);
  for (float& x : kv.maw) x = mean * expo(rng) * expo(rng);
  if (bf16) {
    for (float& x : kv.k) x = tandem::Bf16ToFloat(tandem::FloatToBf16(x));
    for (float& x : kv.v) x = tandem::Bf16ToFloat(tandem::FloatToBf16(x));
  }
  return kv;
}

void EncodeKv(const std::vector<float>& src, size_t heads, size_t tokens, size_t dim,
              size_t first, size_t count, bool bf16, v1::Tensor* t) {
  std::vector<float> slice(heads * count * dim);
  for (size_t h = 0; h < heads; ++h) {
    std::copy_n(src.begin() + (h * tokens + first) * dim, count * dim,
                slice.begin() + h * count * dim);
  }
  const int64_t shape[] = {static_cast<int64_t>(heads), static_cast<int64_t>(count),
                           static_cast<int64_t>(dim)};
  if (bf16) {
    tandem::cpu_attention::EncodeBf16(slice, shape, t);
  } else {
    tandem::cpu_attention::EncodeF32(slice, shape, t);
  }
}

absl::Status RunAttend(v1::CpuAttention::Stub& stub) {
  const unsigned layers = absl::GetFlag(FLAGS_layers), q_heads = absl::GetFlag(FLAGS_q_heads),
                 kv_heads = absl::GetFlag(FLAGS_kv_heads), dim = absl::GetFlag(FLAGS_head_dim),
                 tokens = absl::GetFlag(FLAGS_tokens),
                 chunk = std::max(1u, absl::GetFlag(FLAGS_chunk_tokens)),
                 window = absl::GetFlag(FLAGS_window_entries);
  const float beta = static_cast<float>(absl::GetFlag(FLAGS_beta));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "bf16" && dtype != "f32") {
    return absl::InvalidArgumentError("--dtype must be bf16 or f32");
  }
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    return absl::InvalidArgumentError("--q_heads must be a positive multiple of --kv_heads");
  }
  const bool bf16 = dtype == "bf16";
  const std::string session = absl::StrCat("tandem-cli-", getpid());
  std::printf("session %s: %u layers, %u q heads, %u kv heads, head_dim %u, %u tokens, %s, "
              "beta %g\n",
              session.c_str(), layers, q_heads, kv_heads, dim, tokens, dtype.c_str(), beta);

  {
    v1::StatsResponse stats;
    auto ctx = Context();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Stats(ctx.get(), {}, &stats)));
    PrintStats("before", stats);
  }

  v1::OpenSessionRequest open;
  open.set_session_id(session);
  open.mutable_geometry()->set_num_layers(layers);
  open.mutable_geometry()->set_num_q_heads(q_heads);
  open.mutable_geometry()->set_num_kv_heads(kv_heads);
  open.mutable_geometry()->set_head_dim(dim);
  open.set_block_size(absl::GetFlag(FLAGS_block_tokens));
  open.set_kv_dtype(bf16 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
  open.set_beta(beta);
  v1::OpenSessionResponse opened;
  auto t0 = Clock::now();
  {
    auto ctx = Context();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.OpenSession(ctx.get(), open, &opened)));
  }
  std::printf("OpenSession      %8.3f ms  (block %u tokens, %llu bytes/block)\n",
              1e3 * Seconds(t0, Clock::now()), opened.block_size(),
              static_cast<unsigned long long>(opened.bytes_per_block()));

  // Append: layer by layer, `chunk` tokens of every kv head per message, one stream.
  LayerKv layer0;
  double append_seconds = 0, generate_seconds = 0;
  uint64_t append_bytes = 0;
  v1::AppendKvResponse appended;
  {
    auto ctx = Context();
    auto writer = stub.AppendKv(ctx.get(), &appended);
    for (unsigned l = 0; l < layers; ++l) {
      auto g0 = Clock::now();
      LayerKv kv = MakeLayer(l, bf16);
      auto g1 = Clock::now();
      generate_seconds += Seconds(g0, g1);
      for (unsigned first = 0; first < tokens; first += chunk) {
        const unsigned count = std::min(chunk, tokens - first);
        v1::AppendKvRequest msg;
        msg.set_session_id(session);
        msg.set_layer(l);
        msg.set_window_entries(window);
        EncodeKv(kv.k, kv_heads, tokens, dim, first, count, bf16, msg.mutable_k());
        EncodeKv(kv.v, kv_heads, tokens, dim, first, count, bf16, msg.mutable_v());
        EncodeKv(kv.maw, kv_heads, tokens, 1, first, count, false, msg.mutable_maw());
        msg.mutable_maw()->mutable_shape()->RemoveLast();  // [heads, count]
        append_bytes += msg.k().data().size() + msg.v().data().size();
        if (!writer->Write(msg)) break;  // the server ended the stream: Finish says why
      }
      append_seconds += Seconds(g1, Clock::now());
      if (l == 0) layer0 = std::move(kv);
    }
    writer->WritesDone();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(writer->Finish()));
  }
  std::printf("AppendKv         %8.3f s   %llu entries (%llu selected), %.1f MiB K+V, %.2f GB/s "
              "(client encode + stream)\n",
              append_seconds, static_cast<unsigned long long>(appended.entries_appended()),
              static_cast<unsigned long long>(appended.entries_selected()),
              append_bytes / 1048576.0, append_bytes / append_seconds / 1e9);

  // Decode-style Attend: one token's query per layer per step.
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> latency_ms, compute_ms;
  double max_rel_error = 0, max_lse_error = 0;
  uint64_t scanned = 0;
  for (unsigned step = 0; step < absl::GetFlag(FLAGS_decode_steps); ++step) {
    for (unsigned l = 0; l < layers; ++l) {
      std::vector<float> q(size_t{q_heads} * dim);
      for (float& x : q) x = normal(rng);
      v1::AttendRequest req;
      req.set_layer(l);
      v1::AttendQuery* query = req.add_queries();
      query->set_session_id(session);
      const int64_t q_shape[] = {1, q_heads, dim};
      tandem::cpu_attention::EncodeF32(q, q_shape, query->mutable_q());
      v1::AttendResponse resp;
      auto ctx = Context();
      auto a = Clock::now();
      TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Attend(ctx.get(), req, &resp)));
      latency_ms.push_back(1e3 * Seconds(a, Clock::now()));
      compute_ms.push_back(resp.compute_micros() / 1e3);
      scanned += resp.bytes_scanned();
      if (l != 0 || step != 0) continue;
      // Check layer 0 against the reference over the entries the node should have selected.
      const v1::AttendResult& r = resp.results(0);
      const float* o = reinterpret_cast<const float*>(r.o().data().data());
      const float* lse = reinterpret_cast<const float*>(r.lse().data().data());
      const unsigned G = q_heads / kv_heads;
      const float threshold = beta / window;
      for (unsigned h = 0; h < kv_heads; ++h) {
        std::vector<float> k_sel, v_sel;
        for (unsigned t = 0; t < tokens; ++t) {
          if (beta != 0 && !(layer0.maw[h * tokens + t] > threshold)) continue;
          const size_t at = (size_t{h} * tokens + t) * dim;
          k_sel.insert(k_sel.end(), layer0.k.begin() + at, layer0.k.begin() + at + dim);
          v_sel.insert(v_sel.end(), layer0.v.begin() + at, layer0.v.begin() + at + dim);
        }
        std::vector<double> ref_o, ref_lse;
        tandem::cpu_attention::ReferenceAttention(q.data() + size_t{h} * G * dim, k_sel.data(),
                                                  v_sel.data(), k_sel.size() / dim, 1, G, dim,
                                                  1.0 / std::sqrt(double(dim)), &ref_o, &ref_lse);
        max_rel_error = std::max(max_rel_error, tandem::cpu_attention::RelativeError(
                                                    o + size_t{h} * G * dim, ref_o.data(), ref_o.size()));
        for (unsigned j = 0; j < G; ++j) {
          if (std::isinf(ref_lse[j])) continue;
          max_lse_error = std::max(max_lse_error, std::abs(lse[h * G + j] - ref_lse[j]));
        }
      }
    }
  }
  std::printf("Attend           p50 %.3f ms  p99 %.3f ms  (node compute p50 %.3f ms) over %zu "
              "calls, %.2f GB/s scanned\n",
              Percentile(latency_ms, 0.5), Percentile(latency_ms, 0.99),
              Percentile(compute_ms, 0.5), latency_ms.size(),
              scanned / (1e-3 * std::accumulate(compute_ms.begin(), compute_ms.end(), 0.0)) /
                  1e9);
  std::printf("check layer 0    max relative error of O %.2e, max |LSE error| %.2e vs a "
              "double-precision reference\n",
              max_rel_error, max_lse_error);

  // Re-selection with a fresh prompt's queries (what a multi-turn append triggers).
  if (beta != 0) {
    v1::ReselectRequest req;
    req.set_session_id(session);
    req.set_layer(0);
    std::vector<float> q(size_t{8} * q_heads * dim);
    for (float& x : q) x = normal(rng);
    const int64_t shape[] = {8, q_heads, dim};
    tandem::cpu_attention::EncodeF32(q, shape, req.mutable_q());
    v1::ReselectResponse resp;
    auto ctx = Context();
    auto a = Clock::now();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Reselect(ctx.get(), req, &resp)));
    uint64_t selected = 0, held = 0;
    for (int i = 0; i < resp.selected_size(); ++i) {
      selected += resp.selected(i);
      held += resp.held(i);
    }
    std::printf("Reselect layer 0 %8.3f ms  %llu of %llu entries selected\n",
                1e3 * Seconds(a, Clock::now()), static_cast<unsigned long long>(selected),
                static_cast<unsigned long long>(held));
  }

  {
    v1::StatsResponse stats;
    auto ctx = Context();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Stats(ctx.get(), {}, &stats)));
    PrintStats("loaded", stats);
  }
  {
    v1::CloseSessionRequest req;
    req.set_session_id(session);
    v1::CloseSessionResponse resp;
    auto ctx = Context();
    auto a = Clock::now();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.CloseSession(ctx.get(), req, &resp)));
    std::printf("CloseSession     %8.3f ms  %llu blocks released\n",
                1e3 * Seconds(a, Clock::now()),
                static_cast<unsigned long long>(resp.blocks_released()));
  }
  {
    v1::StatsResponse stats;
    auto ctx = Context();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Stats(ctx.get(), {}, &stats)));
    PrintStats("after", stats);
  }
  // Exact mode must match the reference; a failure here is a wrong answer, not a slow one.
  const double tolerance = bf16 ? 1e-3 : 1e-5;
  if (max_rel_error > tolerance || max_lse_error > 1e-3) {
    return absl::InternalError(absl::StrFormat(
        "layer 0 result differs from the reference: relative error %.3g (tolerance %.0e), LSE "
        "error %.3g",
        max_rel_error, tolerance, max_lse_error));
  }
  return absl::OkStatus();
}

absl::Status RunStats(v1::CpuAttention::Stub& stub) {
  v1::StatsResponse stats;
  auto ctx = Context();
  TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub.Stats(ctx.get(), {}, &stats)));
  std::printf("%s", stats.DebugString().c_str());
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tandem client.\n"
      "  tandem attend [--server=HOST:PORT] [--layers --q_heads --kv_heads --head_dim --tokens "
      "--beta --dtype ...]\n"
      "  tandem stats --server=HOST:PORT");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string command = args.size() > 1 ? args[1] : "";
  if (command != "attend" && command != "stats") {
    std::fprintf(stderr, "usage: tandem attend|stats [flags]   (tandem --help for flags)\n");
    return 2;
  }

  std::unique_ptr<tandem::cpu_attention::CpuAttentionServer> embedded;
  std::shared_ptr<grpc::Channel> channel;
  const std::string server = absl::GetFlag(FLAGS_server);
  if (server.empty()) {
    tandem::cpu_attention::ServerOptions options;
    options.address = "";  // in-process only
    options.node.pool_bytes = 16ull << 30;
    auto started = tandem::cpu_attention::CpuAttentionServer::Start(options);
    if (!started.ok()) {
      std::fprintf(stderr, "embedded node: %s\n", started.status().ToString().c_str());
      return 1;
    }
    embedded = std::move(*started);
    channel = embedded->InProcessChannel();
    std::printf("embedded CPU attention node (in-process)\n");
  } else {
    channel = grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(),
                                        tandem::cpu_attention::CpuAttentionChannelArguments());
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      std::fprintf(stderr, "cannot connect to %s within 10 s\n", server.c_str());
      return 1;
    }
    std::printf("connected to CPU attention node %s\n", server.c_str());
  }
  auto stub = v1::CpuAttention::NewStub(channel);
  const absl::Status status = command == "attend" ? RunAttend(*stub) : RunStats(*stub);
  if (!status.ok()) {
    std::fprintf(stderr, "tandem %s failed: %s\n", command.c_str(), status.ToString().c_str());
    return 1;
  }
  return 0;
}
