// Writes a model directory with synthetic weights for any geometry: config.json (what
// GeometryConfigJson gives) and the weights of RandomModelTensors(config, seed) as safetensors,
// which LoadModel reads and DeviceModel::Upload turns into exactly the device weights of
// DeviceModel::CreateRandom(config, backend, seed).
//
// Weights go to model.safetensors, or, when they exceed max_shard_bytes, to
// model-0000i-of-0000N.safetensors shards (whole tensors, in enumeration order, each shard at
// most max_shard_bytes unless one tensor alone is larger) listed by model.safetensors.index.json.
// The data is generated and written one slice at a time (slice_bytes, split over `threads`), so
// host memory stays bounded whatever the model's size. An existing model.safetensors or
// model.safetensors.index.json in `dir` is removed first (SafetensorsArchive would prefer a stale
// one); other files are left alone.
//
// Errors: the config's INVALID_ARGUMENT (RandomModelTensors / GeometryConfigJson);
// INVALID_ARGUMENT for zero max_shard_bytes or slice_bytes; INTERNAL naming the file when it
// cannot be created or written (a partial directory may remain). Not thread-safe per directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/model_config.h"

namespace tandem::gpu_worker {

struct RandomModelWriteOptions {
  uint64_t seed = 0;
  uint64_t max_shard_bytes = uint64_t{5} << 30;  // bytes of tensor data per shard file
  uint64_t slice_bytes = uint64_t{64} << 20;     // bytes generated per step (host memory bound)
  unsigned threads = 0;                          // generating threads; 0 = available cores
};

struct RandomModelWriteResult {
  std::vector<std::string> weight_files;  // file names inside dir, in order
  uint64_t weight_bytes = 0;              // tensor data, all shards
};

absl::StatusOr<RandomModelWriteResult> WriteRandomModel(const ModelConfig& config,
                                                        const std::filesystem::path& dir,
                                                        const RandomModelWriteOptions& options);

}  // namespace tandem::gpu_worker
