// tandem: the client CLI.
//
//   tandem generate --model=DIR [--server=HOST:PORT] (--prompt=TEXT | --prompt-file=F)
//          [--max-tokens --temperature --top-p --top-k --seed --stop --ignore-eos --mode --beta
//           --window --sink --session-id --backend --cpu-nodes --prefill-chunk --max-context
//           --quantization]
//       Generates from a prompt, streaming the text to stdout, then prints one summary line.
//       Without --server an Engine runs in-process (with an embedded CPU attention node unless
//       --cpu-nodes is given); with --server it calls a tandem-gpu-worker.
//   tandem tokenize --model=DIR [--server=HOST:PORT] --text=TEXT [--add-bos]
//       Prints the token ids (space-separated), then the count.
//   tandem attend --server=HOST:PORT [geometry and size flags]
//       The attention round trip: opens a session on a CPU attention node, streams random KV
//       (with MAW) into it, runs decode-style Attend calls for every layer, checks layer 0's
//       result against a double-precision reference computed here, re-selects, closes, and
//       prints results and timings. Without --server an embedded node runs in-process.
//   tandem stats --server=HOST:PORT
//       Prints the node's Stats.
//   tandem capacity --server=HOST:PORT [--context=N --prompt-tokens=N --batch=N --mode --window
//          --sink --selection --select-tokens --beta --json]
//       Asks a tandem-gpu-worker's GetCapacity: the device, host and CPU-node memory a context
//       needs there, whether it fits and the largest context that fits. Exit 0 if it fits, 1 if
//       not (or on an error).
//
// Flags may be spelled with hyphens or underscores (--max-tokens or --max_tokens). Exit
// status: 0 on success, 1 when the command fails, 2 for a bad command line.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "parse_flags.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "tandem/common/bf16.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/generation_service.h"
#include "tandem/gpu_worker/model_config.h"
#include "tandem/gpu_worker/tokenizer.h"
#include "tandem/gpu_worker/worker_server.h"
#include "tandem/security/credentials.h"
#include "tandem/security/token_file.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"
#include "tandem/v1/generation.grpc.pb.h"

// Shared.
ABSL_FLAG(std::string, server, "",
          "attend/stats: CPU attention node host:port; generate/tokenize: tandem-gpu-worker "
          "host:port; empty = in-process");
ABSL_FLAG(std::string, tls_ca, "",
          "with --server: PEM CA the server's certificate is verified against (TLS)");
ABSL_FLAG(std::string, tls_cert, "",
          "with --server: PEM client certificate for a mutual-TLS server (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name the server's certificate must carry when it differs from --server's host");
ABSL_FLAG(std::string, token_file, "",
          "generate/tokenize with --server: file whose first line is the bearer token to send "
          "(needs TLS; a file, so the token is not visible in the process list)");
ABSL_FLAG(std::optional<double>, beta, std::nullopt,
          "selection threshold (>= 0, 0 = dense, exact); attend: default 0; generate: default "
          "the engine's");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "random seed; attend: default 1; generate: default a random one");
ABSL_FLAG(unsigned, deadline_ms, 30000, "deadline of every short RPC");

// attend, stats.
ABSL_FLAG(unsigned, layers, 4, "layers");
ABSL_FLAG(unsigned, q_heads, 32, "query heads");
ABSL_FLAG(unsigned, kv_heads, 8, "KV heads");
ABSL_FLAG(unsigned, head_dim, 128, "head dimension");
ABSL_FLAG(unsigned, tokens, 16384, "offloaded tokens per (layer, kv-head)");
ABSL_FLAG(unsigned, block_tokens, 64, "tokens per KV block");
ABSL_FLAG(unsigned, chunk_tokens, 1024, "tokens per AppendKv message");
ABSL_FLAG(unsigned, window_entries, 512, "GPU window size the MAW values refer to");
ABSL_FLAG(std::string, dtype, "bf16", "KV dtype: bf16 or f32");
ABSL_FLAG(unsigned, decode_steps, 16, "Attend calls per layer");

// generate, tokenize.
ABSL_FLAG(std::string, model, "", "model directory (required without --server)");
ABSL_FLAG(std::string, prompt, "", "generate: the prompt text");
ABSL_FLAG(std::string, prompt_file, "", "generate: read the prompt from this file");
ABSL_FLAG(int64_t, max_tokens, 128, "generate: tokens to generate at most");
ABSL_FLAG(double, temperature, 0.0, "generate: sampling temperature; 0 = greedy");
ABSL_FLAG(double, top_p, 1.0, "generate: nucleus sampling mass, (0, 1]");
ABSL_FLAG(int32_t, top_k, 0, "generate: sample among the top k tokens; 0 = all");
ABSL_FLAG(std::vector<std::string>, stop, {},
          "generate: stop strings; repeat the flag or give a comma list (\\, for a comma)");
ABSL_FLAG(bool, ignore_eos, false, "generate: keep going past the end-of-sequence token");
ABSL_FLAG(std::optional<int32_t>, logprobs, std::nullopt,
          "generate: after the text, list each token's log-probability (of the raw logits) and "
          "the N most likely tokens of its step, N in 0..20");
ABSL_FLAG(std::string, mode, "",
          "generate: gpu, hybrid, offload or exact; empty = the engine's default");
ABSL_FLAG(std::optional<int64_t>, window, std::nullopt, "generate: hybrid device window, tokens");
ABSL_FLAG(std::optional<int64_t>, sink, std::nullopt, "generate: hybrid sink tokens");
ABSL_FLAG(std::string, selection, "",
          "generate: hybrid selection, maw or pages; empty = the engine's default");
ABSL_FLAG(std::optional<int64_t>, select_tokens, std::nullopt,
          "generate: selection=pages budget, offloaded entries per (layer, kv head, token)");
ABSL_FLAG(std::optional<int64_t>, dense_layers, std::nullopt,
          "generate: selection=pages, first layers that attend over every entry");
ABSL_FLAG(std::string, session_id, "", "generate: keep and continue this session (--server)");
ABSL_FLAG(std::string, backend, "auto", "in-process engine: auto, cpu or cuda");
ABSL_FLAG(std::vector<std::string>, cpu_nodes, {},
          "in-process engine: CPU attention nodes host:port,...; empty = one embedded node");
ABSL_FLAG(std::string, transport, "auto",
          "in-process engine: Attend/AppendKv transport to CPU nodes: auto, shm or grpc");
ABSL_FLAG(int64_t, prefill_chunk, 512, "in-process engine: prompt tokens per forward chunk");
ABSL_FLAG(int64_t, max_context, 0, "in-process engine: context limit; 0 = the model's");
ABSL_FLAG(std::string, quantization, "",
          "in-process engine: fp8 quantizes a bf16/f32 checkpoint's projections to FP8 (e4m3, "
          "one scale per output row) as they load; none or \"\": the checkpoint as it is");
ABSL_FLAG(unsigned, generate_deadline_s, 3600, "generate: deadline of the Generate call");
ABSL_FLAG(std::string, text, "", "tokenize: the text");
ABSL_FLAG(int64_t, context, 0, "capacity: positions per sequence; 0 = the worker's max_context");
ABSL_FLAG(int64_t, prompt_tokens, 0, "capacity: prompt tokens of them; 0 = all");
ABSL_FLAG(int64_t, batch, 1, "capacity: sequences held at once");
ABSL_FLAG(bool, json, false, "capacity: print the answer as JSON (proto3 JSON mapping)");
ABSL_FLAG(bool, add_bos, false, "tokenize: prepend the BOS token");

namespace {

namespace v1 = tandem::v1;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPromptFileBytes = size_t{64} << 20;  // the worker's default message limit

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
      "stats %-7s sessions=%u blocks=%llu used=%s stored=%s selected=%s threads=%u "
      "scan=%.2f GB/s\n",
      when, s.sessions(), static_cast<unsigned long long>(s.blocks_in_use()),
      tandem::FormatBytes(s.used_bytes()).c_str(), tandem::FormatBytes(s.stored_bytes()).c_str(),
      tandem::FormatBytes(s.selected_bytes()).c_str(), s.threads(),
      s.scan_bytes_per_second() / 1e9);
}

// K, V of one layer: [kv_heads, tokens, head_dim] as floats already rounded to the KV dtype,
// and MAW [kv_heads, tokens].
struct LayerKv {
  std::vector<float> k, v, maw;
};

LayerKv MakeLayer(unsigned layer, bool bf16) {
  const size_t heads = absl::GetFlag(FLAGS_kv_heads), tokens = absl::GetFlag(FLAGS_tokens),
               dim = absl::GetFlag(FLAGS_head_dim);
  std::mt19937 rng(absl::GetFlag(FLAGS_seed).value_or(1) * 7919u + layer);
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
  const float beta = static_cast<float>(absl::GetFlag(FLAGS_beta).value_or(0.0));
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
  std::printf("OpenSession      %8.3f ms  (block %u tokens, %s/block)\n",
              1e3 * Seconds(t0, Clock::now()), opened.block_size(),
              tandem::FormatBytes(opened.bytes_per_block()).c_str());
  // On an early return (a failed or timed-out call) the node would keep the session's blocks
  // until someone closes it: close it here, best effort.
  absl::Cleanup close_on_error = [&stub, &session] {
    v1::CloseSessionRequest req;
    req.set_session_id(session);
    v1::CloseSessionResponse resp;
    auto ctx = Context();
    const grpc::Status s = stub.CloseSession(ctx.get(), req, &resp);
    std::fprintf(stderr, "closed session %s after the error: %s\n", session.c_str(),
                 s.ok() ? "ok" : s.error_message().c_str());
  };

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
  std::printf("AppendKv         %8.3f s   %llu entries (%llu selected), %s K+V, %.2f GB/s "
              "(client encode + stream)\n",
              append_seconds, static_cast<unsigned long long>(appended.entries_appended()),
              static_cast<unsigned long long>(appended.entries_selected()),
              tandem::FormatBytes(append_bytes).c_str(), append_bytes / append_seconds / 1e9);

  // Decode-style Attend: one token's query per layer per step.
  std::mt19937 rng(absl::GetFlag(FLAGS_seed).value_or(1));
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
    std::move(close_on_error).Cancel();
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

// --- generate, tokenize ---------------------------------------------------------------------

namespace gw = tandem::gpu_worker;

// Stop strings of one --stop value: comma-separated, "\," for a literal comma; empty pieces
// are dropped.
std::vector<std::string> SplitStops(absl::string_view value) {
  std::vector<std::string> stops(1);
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] == '\\' && i + 1 < value.size() && value[i + 1] == ',') {
      stops.back().push_back(',');
      ++i;
    } else if (value[i] == ',') {
      stops.emplace_back();
    } else {
      stops.back().push_back(value[i]);
    }
  }
  stops.erase(std::remove(stops.begin(), stops.end(), std::string()), stops.end());
  return stops;
}

// The command line as absl should see it: hyphenated flag names rewritten to absl's
// underscores (--max-tokens -> --max_tokens), and every --stop taken out into `stops` (absl
// keeps only the last value of a repeated flag; stop strings accumulate).
struct CommandLine {
  std::vector<std::string> args;
  std::vector<std::string> stops;
};

absl::StatusOr<CommandLine> NormalizeCommandLine(int argc, char** argv) {
  CommandLine out;
  out.args.emplace_back(argv[0]);
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (flags_done || arg.size() < 2 || arg[0] != '-') {
      out.args.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      out.args.push_back(arg);
      continue;
    }
    const size_t dashes = arg[1] == '-' ? 2 : 1;
    const size_t eq = arg.find('=');
    const bool has_value = eq != std::string::npos;
    std::string name = arg.substr(dashes, has_value ? eq - dashes : std::string::npos);
    std::replace(name.begin(), name.end(), '-', '_');
    if (name == "stop") {
      if (!has_value && i + 1 >= argc) return absl::InvalidArgumentError("--stop needs a value");
      for (std::string& stop : SplitStops(has_value ? arg.substr(eq + 1) : argv[++i])) {
        out.stops.push_back(std::move(stop));
      }
      continue;
    }
    out.args.push_back(absl::StrCat(std::string(dashes, '-'), name,
                                    has_value ? absl::string_view(arg).substr(eq) : ""));
    // "--flag value": keep the value as it is, even when it starts with a dash.
    if (!has_value && i + 1 < argc) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag != nullptr && !flag->IsOfType<bool>()) out.args.emplace_back(argv[++i]);
    }
  }
  return out;
}

absl::StatusOr<std::string> ReadPromptFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open --prompt-file '", path, "'"));
  std::string text;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxPromptFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt-file '", path, "' exceeds ", tandem::FormatBytes(kMaxPromptFileBytes)));
    }
  }
  return text;
}

absl::StatusOr<v1::GenerateRequest> GenerateRequestFromFlags(
    const std::vector<std::string>& stops) {
  v1::GenerateRequest r;
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string prompt_file = absl::GetFlag(FLAGS_prompt_file);
  if (prompt.empty() == prompt_file.empty()) {
    return absl::InvalidArgumentError("give one of --prompt and --prompt-file");
  }
  if (!prompt_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(*r.mutable_prompt_text(), ReadPromptFile(prompt_file));
  } else {
    r.set_prompt_text(prompt);
  }
  r.set_session_id(absl::GetFlag(FLAGS_session_id));
  r.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  r.set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  r.set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  r.set_top_k(absl::GetFlag(FLAGS_top_k));
  if (const std::optional<uint64_t> seed = absl::GetFlag(FLAGS_seed)) r.set_seed(*seed);
  for (const std::string& stop : stops) r.add_stop(stop);
  r.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  if (const std::optional<int32_t> n = absl::GetFlag(FLAGS_logprobs)) {
    r.set_logprobs(true);
    r.set_top_logprobs(*n);
  }
  r.set_mode(absl::GetFlag(FLAGS_mode));
  if (const std::optional<double> beta = absl::GetFlag(FLAGS_beta)) {
    r.set_beta(static_cast<float>(*beta));
  }
  if (const std::optional<int64_t> window = absl::GetFlag(FLAGS_window)) r.set_window(*window);
  if (const std::optional<int64_t> sink = absl::GetFlag(FLAGS_sink)) r.set_sink(*sink);
  r.set_selection(absl::GetFlag(FLAGS_selection));
  if (const std::optional<int64_t> t = absl::GetFlag(FLAGS_select_tokens)) r.set_select_tokens(*t);
  if (const std::optional<int64_t> d = absl::GetFlag(FLAGS_dense_layers)) r.set_dense_layers(*d);
  return r;
}

absl::StatusOr<gw::EngineOptions> EngineOptionsFromFlags() {
  gw::EngineOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  if (options.model_dir.empty()) {
    return absl::InvalidArgumentError("--model is required without --server");
  }
  options.backend = absl::GetFlag(FLAGS_backend);
  for (const std::string& node : absl::GetFlag(FLAGS_cpu_nodes)) {
    if (!node.empty()) options.nodes.addresses.push_back(node);
  }
  TANDEM_ASSIGN_OR_RETURN(options.nodes.transport,
                          gw::ParseNodeTransport(absl::GetFlag(FLAGS_transport)));
  options.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.max_context = absl::GetFlag(FLAGS_max_context);
  options.quantization = absl::GetFlag(FLAGS_quantization);
  gw::ModelConfig scratch;  // checks the value before the model is read
  TANDEM_RETURN_IF_ERROR(gw::ApplyQuantizationOption(options.quantization, &scratch));
  return options;
}

// Writes a generation as it streams: token text to stdout (flushed per delta), a one-line
// progress bar on stderr during a long prefill, then the summary line.
class StreamPrinter {
 public:
  void Prefill(int64_t total, int64_t processed, double elapsed_s) {
    // The first message tells the chunk size; a bar is worth drawing on a terminal, or for a
    // prompt of more than two chunks.
    if (chunk_ == 0) chunk_ = std::max<int64_t>(processed, 1);
    if (!stderr_tty_ && total <= 2 * chunk_) return;
    constexpr int kWidth = 30;
    const int filled =
        total > 0 ? static_cast<int>(kWidth * std::min<int64_t>(processed, total) / total) : 0;
    std::fprintf(stderr, "\r[prefill] [%s%s] %lld/%lld tokens %.2f s",
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(),
                 static_cast<long long>(processed), static_cast<long long>(total), elapsed_s);
    bar_open_ = processed < total;
    if (!bar_open_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

  // Writes the token's text; keeps the token for the logprobs table when it carries a logprob.
  void Token(const v1::TokenDelta& token) {
    CloseBar();
    std::fwrite(token.text().data(), 1, token.text().size(), stdout);
    std::fflush(stdout);
    if (token.has_logprob()) logprobs_.push_back(token);
  }

  void Final(const v1::GenerateFinal& f) {
    CloseBar();
    if (!logprobs_.empty()) PrintLogprobs();
    // Decode rate: tokens after the first over the time after the first.
    const int64_t n = f.usage().completion_tokens();
    const double decode_s = f.total_seconds() - f.time_to_first_token_seconds();
    const double rate = n > 1 && decode_s > 0   ? (n - 1) / decode_s
                        : f.total_seconds() > 0 ? n / f.total_seconds()
                                                : 0.0;
    std::printf(
        "\n[tandem] %lld tokens | TTFT %.3f s | %.1f tok/s | KV: %lld on device, %lld on "
        "CPU nodes | degraded steps: %llu | finish: %s | mode %s\n",
        static_cast<long long>(n), f.time_to_first_token_seconds(), rate,
        static_cast<long long>(f.device_kv_entries()), static_cast<long long>(f.cpu_kv_entries()),
        static_cast<unsigned long long>(f.degraded_steps()),
        std::string(gw::FinishReasonName(f.finish_reason())).c_str(), f.mode().c_str());
    if (f.has_exact_split()) {
      const v1::ExactSplit& e = f.exact_split();
      std::printf("[tandem] exact split: fetch %.1f%% (%lld entries in host pages), nodes %.1f%% "
                  "(%lld), recompute %.1f%%; modelled step %.4g s (fetch only %.4g s); %s\n",
                  100 * e.fetch_share(), static_cast<long long>(e.host_entries()),
                  100 * e.node_share(), static_cast<long long>(e.node_entries()),
                  100 * e.recompute_share(), e.modelled_step_seconds(),
                  e.modelled_fetch_only_seconds(), e.recompute_reason().c_str());
    }
    std::fflush(stdout);
  }

 private:
  // One line per token: index, id, logprob, then its step's most likely tokens (each alone,
  // C-escaped) with theirs.
  void PrintLogprobs() const {
    std::printf("\n[logprobs] index token_id logprob | top tokens\n");
    for (const v1::TokenDelta& t : logprobs_) {
      std::string line =
          absl::StrFormat("%5d %7d %10.5f |", t.index(), t.token_id(), t.logprob());
      for (int k = 0; k < t.top_logprobs_size(); ++k) {
        const v1::TokenLogprob& c = t.top_logprobs(k);
        absl::StrAppend(&line, absl::StrFormat(" \"%s\" %.4f", absl::Utf8SafeCEscape(c.text()),
                                               c.logprob()));
      }
      std::printf("%s\n", line.c_str());
    }
  }

  void CloseBar() {
    if (!bar_open_) return;
    std::fputc('\n', stderr);
    bar_open_ = false;
  }

  const bool stderr_tty_ = isatty(STDERR_FILENO) != 0;
  int64_t chunk_ = 0;
  bool bar_open_ = false;
  std::vector<v1::TokenDelta> logprobs_;   // tokens that carried logprobs, for the table
};

// The channel to --server with the TLS and token flags' credentials.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ServerChannel(grpc::ChannelArguments args) {
  std::string token;
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    TANDEM_ASSIGN_OR_RETURN(token, tandem::security::ReadClientToken(path));
  }
  TANDEM_ASSIGN_OR_RETURN(
      std::shared_ptr<grpc::ChannelCredentials> credentials,
      tandem::security::ChannelCredentialsFromFiles(
          {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
           absl::GetFlag(FLAGS_tls_ca)},
          token));
  tandem::security::SetTlsServerName(absl::GetFlag(FLAGS_tls_server_name), &args);
  return grpc::CreateCustomChannel(absl::GetFlag(FLAGS_server), credentials, args);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> WorkerChannel() {
  return ServerChannel(gw::GenerationChannelArguments());
}

absl::Status RunGenerate(const std::vector<std::string>& stops) {
  TANDEM_ASSIGN_OR_RETURN(const v1::GenerateRequest request, GenerateRequestFromFlags(stops));
  StreamPrinter printer;
  if (absl::GetFlag(FLAGS_server).empty()) {
    TANDEM_ASSIGN_OR_RETURN(const gw::EngineOptions options, EngineOptionsFromFlags());
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gw::Engine> engine, gw::Engine::Create(options));
    TANDEM_ASSIGN_OR_RETURN(const gw::GenerateRequest converted,
                            gw::ToEngineRequest(request, engine->info().max_context));
    gw::GenerateCallbacks callbacks;
    callbacks.on_prefill = [&](const gw::PrefillProgress& p) {
      printer.Prefill(p.total, p.processed, p.elapsed_s);
    };
    callbacks.on_token = [&](const gw::TokenEvent& token) {
      v1::TokenDelta delta;
      gw::ToProto(token, &delta);
      printer.Token(delta);
      return true;
    };
    TANDEM_ASSIGN_OR_RETURN(const gw::GenerateSummary summary,
                            engine->Generate(converted, callbacks));
    v1::GenerateFinal final;
    gw::ToProto(summary, &final);
    printer.Final(final);
    return absl::OkStatus();
  }

  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, WorkerChannel());
  auto stub = v1::Generation::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_generate_deadline_s)));
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&ctx, request);
  v1::GenerateResponse message;
  bool got_final = false;
  while (reader->Read(&message)) {
    switch (message.event_case()) {
      case v1::GenerateResponse::kPrefill:
        printer.Prefill(message.prefill().total(), message.prefill().processed(),
                        message.prefill().elapsed_seconds());
        break;
      case v1::GenerateResponse::kToken:
        printer.Token(message.token());
        break;
      case v1::GenerateResponse::kFinal:
        printer.Final(message.final());
        got_final = true;
        break;
      case v1::GenerateResponse::EVENT_NOT_SET:
        break;
    }
  }
  TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(reader->Finish()));
  if (!got_final) return absl::InternalError("the stream ended without a final message");
  return absl::OkStatus();
}

absl::Status RunTokenize() {
  const std::string text = absl::GetFlag(FLAGS_text);
  const bool add_bos = absl::GetFlag(FLAGS_add_bos);
  std::vector<int32_t> ids;
  if (absl::GetFlag(FLAGS_server).empty()) {
    const std::string model = absl::GetFlag(FLAGS_model);
    if (model.empty()) return absl::InvalidArgumentError("--model is required without --server");
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<gw::Tokenizer> tokenizer, gw::LoadTokenizer(model));
    TANDEM_ASSIGN_OR_RETURN(ids, gw::EncodePrompt(*tokenizer, text, add_bos));
  } else {
    TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, WorkerChannel());
    auto stub = v1::Generation::NewStub(channel);
    v1::TokenizeRequest request;
    request.set_text(text);
    request.set_add_bos(add_bos);
    v1::TokenizeResponse response;
    auto ctx = Context();
    TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub->Tokenize(ctx.get(), request, &response)));
    ids.assign(response.token_ids().begin(), response.token_ids().end());
  }
  std::printf("%s\n%zu tokens\n", absl::StrJoin(ids, " ").c_str(), ids.size());
  return absl::OkStatus();
}

// GetCapacity of the worker at --server (generation.proto); true when the context fits.
absl::StatusOr<bool> RunCapacity() {
  if (absl::GetFlag(FLAGS_server).empty()) {
    return absl::InvalidArgumentError(
        "capacity needs --server (a running tandem-gpu-worker; tandem-gpu-worker --plan sizes "
        "a configuration without one)");
  }
  v1::GetCapacityRequest request;
  request.set_context(absl::GetFlag(FLAGS_context));
  request.set_prompt(absl::GetFlag(FLAGS_prompt_tokens));
  request.set_batch(absl::GetFlag(FLAGS_batch));
  request.set_mode(absl::GetFlag(FLAGS_mode));
  if (const std::optional<int64_t> w = absl::GetFlag(FLAGS_window)) request.set_window(*w);
  if (const std::optional<int64_t> k = absl::GetFlag(FLAGS_sink)) request.set_sink(*k);
  request.set_selection(absl::GetFlag(FLAGS_selection));
  if (const std::optional<int64_t> t = absl::GetFlag(FLAGS_select_tokens)) {
    request.set_select_tokens(*t);
  }
  if (const std::optional<double> b = absl::GetFlag(FLAGS_beta)) {
    request.set_beta(static_cast<float>(*b));
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, WorkerChannel());
  auto stub = v1::Generation::NewStub(channel);
  v1::GetCapacityResponse response;
  auto ctx = Context();
  TANDEM_RETURN_IF_ERROR(tandem::FromGrpcStatus(stub->GetCapacity(ctx.get(), request, &response)));
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    if (!google::protobuf::util::MessageToJsonString(response, &json, options).ok()) {
      return absl::InternalError("cannot print the answer as JSON");
    }
    std::fputs(json.c_str(), stdout);
  } else {
    std::fputs(response.text().c_str(), stdout);
  }
  return response.fits();
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists the flags of this file (absl's default looks for a file named like the binary).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "tandem_cli_main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "tandem client.\n"
      "  tandem generate --model=DIR [--server=HOST:PORT] --prompt=TEXT [--max-tokens=N "
      "--temperature --top-p --top-k --seed --stop --ignore-eos --mode --beta --window --sink "
      "--selection --select-tokens --dense-layers; in-process: --backend --quantization ...]\n"
      "  tandem tokenize --model=DIR [--server=HOST:PORT] --text=TEXT [--add-bos]\n"
      "  tandem attend [--server=HOST:PORT] [--layers --q_heads --kv_heads --head_dim --tokens "
      "--beta --dtype ...]\n"
      "  tandem stats --server=HOST:PORT\n"
      "  tandem capacity --server=HOST:PORT [--context=N --prompt-tokens=N --batch=N --mode "
      "--window --sink --selection --select-tokens --beta --json]");
  absl::StatusOr<CommandLine> command_line = NormalizeCommandLine(argc, argv);
  if (!command_line.ok()) {
    std::fprintf(stderr, "tandem: %s\n", std::string(command_line.status().message()).c_str());
    return 2;
  }
  std::vector<char*> normalized;
  for (std::string& arg : command_line->args) normalized.push_back(arg.data());
  std::vector<char*> args = tandem::services::ParseCommandLineOrExitTwo(
      static_cast<int>(normalized.size()), normalized.data());
  // stdout carries the generated text: logs go to stderr, warnings and errors only.
  spdlog::set_default_logger(spdlog::stderr_color_mt("tandem"));
  spdlog::set_level(spdlog::level::warn);
  const std::string command = args.size() > 1 ? args[1] : "";
  if (args.size() > 2) {
    std::fprintf(stderr, "tandem: unexpected argument '%s'\n", args[2]);
    return 2;
  }
  if (const absl::Status isa = tandem::CheckCpuIsaEnvironment(); !isa.ok()) {
    std::fprintf(stderr, "tandem: %s\n", std::string(isa.message()).c_str());
    return 2;
  }
  if (command == "generate" || command == "tokenize") {
    const absl::Status status =
        command == "generate" ? RunGenerate(command_line->stops) : RunTokenize();
    if (!status.ok()) {
      std::fprintf(stderr, "tandem: %s\n", status.ToString().c_str());
      return 1;
    }
    return 0;
  }
  if (command == "capacity") {
    const absl::StatusOr<bool> fits = RunCapacity();
    if (!fits.ok()) {
      std::fprintf(stderr, "tandem: %s\n", fits.status().ToString().c_str());
      return 1;
    }
    return *fits ? 0 : 1;
  }
  if (command != "attend" && command != "stats") {
    std::fprintf(stderr,
                 "usage: tandem generate|tokenize|capacity|attend|stats [flags]   (tandem --help "
                 "for flags)\n");
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
    absl::StatusOr<std::shared_ptr<grpc::Channel>> remote =
        ServerChannel(tandem::cpu_attention::CpuAttentionChannelArguments());
    if (!remote.ok()) {
      std::fprintf(stderr, "tandem %s: %s\n", command.c_str(),
                   std::string(remote.status().message()).c_str());
      return 2;
    }
    channel = *std::move(remote);
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
