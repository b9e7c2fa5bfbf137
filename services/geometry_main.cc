// tandem-geometry: writes a model directory with random weights for a model geometry, e.g.
//   tandem-geometry --preset=llama3-8b --seed=1 --out=/data/llama3-8b-random
//   tandem-geometry --preset=tiny --set=layers=4,hidden=512 --out=/tmp/tiny
//   tandem-geometry --preset=llama3-8b --config_only --out=DIR   (for --random_weights)
// The directory (config.json + safetensors) loads like a checkpoint, and holds the weights that
// DeviceModel::CreateRandom generates on the device for the same geometry and seed
// (random_model_writer.h).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "tandem/common/byte_size.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/random_model_writer.h"

ABSL_FLAG(std::string, preset, "llama3-8b",
          "geometry preset (llama3-8b, llama3-70b, qwen3-8b, tiny)");
ABSL_FLAG(std::string, set, "",
          "overrides key=value,...: layers, hidden, ffn, q_heads, kv_heads, head_dim, vocab, "
          "max_positions, rope_theta, rms_norm_eps, dtype (bf16|f32), tie_embeddings, "
          "rope_scaling=none");
ABSL_FLAG(uint64_t, seed, 0, "weight seed");
ABSL_FLAG(std::string, out, "", "output directory (created if missing)");
ABSL_FLAG(uint64_t, shard_mib, 5120, "most MiB of weights per safetensors shard");
ABSL_FLAG(unsigned, threads, 0, "generating threads (0 = available cores)");
ABSL_FLAG(bool, config_only, false,
          "write config.json only (for tandem-gpu-worker --random_weights, which makes the "
          "weights on the device)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes config.json and random safetensors weights for a model geometry.\n"
      "  tandem-geometry --preset=llama3-8b [--set=layers=4,...] [--seed=N] --out=DIR");
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  using namespace tandem::gpu_worker;
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "--out is required\n");
    return 2;
  }
  absl::StatusOr<ModelConfig> config = GeometryPreset(absl::GetFlag(FLAGS_preset));
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  if (absl::Status s = ApplyGeometryOverrides(absl::GetFlag(FLAGS_set), *config); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_config_only)) {
    absl::StatusOr<std::string> json = GeometryConfigJson(*config);
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    std::ofstream file(std::filesystem::path(out) / "config.json");
    if (!json.ok() || ec || !(file << *json)) {
      std::fprintf(stderr, "cannot write %s/config.json: %s\n", out.c_str(),
                   json.ok() ? (ec ? ec.message().c_str() : "write failed")
                             : json.status().ToString().c_str());
      return 1;
    }
    std::printf("wrote %s/config.json\n", out.c_str());
    return 0;
  }
  RandomModelWriteOptions options;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.max_shard_bytes = absl::GetFlag(FLAGS_shard_mib) << 20;
  options.threads = absl::GetFlag(FLAGS_threads);
  absl::StatusOr<RandomModelWriteResult> written = WriteRandomModel(*config, out, options);
  if (!written.ok()) {
    std::fprintf(stderr, "%s\n", written.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s: %s (%llu bytes) of %s weights in %s (seed %llu)\n", out.c_str(),
              tandem::FormatBytes(written->weight_bytes).c_str(),
              static_cast<unsigned long long>(written->weight_bytes),
              std::string(DTypeName(config->weight_dtype)).c_str(),
              absl::StrJoin(written->weight_files, ", ").c_str(),
              static_cast<unsigned long long>(options.seed));
  return 0;
}
