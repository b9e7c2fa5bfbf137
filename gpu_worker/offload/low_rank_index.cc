#include "tandem/gpu_worker/low_rank_index.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/linalg/symmetric_eigen.h"

namespace tandem::gpu_worker {
namespace {

// The top-R eigenvectors of `matrices` Gram matrices gram [matrices, D, D] f32 into
// [matrices, D, R] f32, on up to one thread per matrix (each is independent, ~5 ms at D = 128).
// Matrix m is kv head m % heads of layers[m / heads] (for the error message).
absl::StatusOr<std::vector<float>> SolveBases(const std::vector<float>& gram,
                                              const std::vector<int64_t>& layers, int64_t heads,
                                              int64_t D, int64_t R) {
  const int64_t matrices = static_cast<int64_t>(layers.size()) * heads;
  std::vector<float> bases(static_cast<size_t>(matrices * D * R), 0.0f);
  std::vector<absl::Status> status(matrices);
  auto solve = [&](int64_t m) {
    std::vector<double> a(gram.begin() + m * D * D, gram.begin() + (m + 1) * D * D);
    status[m] = linalg::TopEigenvectors(a.data(), D, R, nullptr, bases.data() + m * D * R);
  };
  // Half the cores at a lower priority (nice 10): the job runs beside decode steps, whose CPU
  // node threads and append copies it would otherwise slow (measured: a settle slice's appends
  // +40 ms with 16 threads at normal priority on a 16-core host).
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency() / 2, 1,
                                              std::min<int64_t>(matrices, 16));
  auto run = [&](int64_t t) {
    (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 10);   // best effort
    for (int64_t m = t; m < matrices; m += threads) solve(m);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);   // (the job's own thread: std::async started it for this job alone)
  for (std::thread& thread : pool) thread.join();
  for (int64_t m = 0; m < matrices; ++m) {
    if (!status[m].ok()) {
      return absl::Status(status[m].code(),
                          absl::StrCat("low-rank key basis of layer ", layers[m / heads],
                                       ", kv head ", m % heads, ": ", status[m].message()));
    }
  }
  return bases;
}

}  // namespace

absl::Status ValidateLowRankOptions(const LowRankOptions& options, int64_t head_dim) {
  if (options.rank != LowRankOptions::kHalfHeadDim &&
      (options.rank < 0 || options.rank > head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank keys: rank ", options.rank,
                                                   " must be in 0..head_dim (", head_dim,
                                                   "), or -1 for head_dim / 2"));
  }
  if (options.calib_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("low-rank keys: calib_tokens must be >= 1, got ", options.calib_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<LowRankIndex> LowRankIndex::Create(Backend& backend, const WindowGeometry& geometry,
                                                  const LowRankOptions& options,
                                                  int64_t reserve_tokens) {
  if (geometry.num_layers <= 0 || geometry.num_kv_heads <= 0 || geometry.head_dim <= 0) {
    return absl::InvalidArgumentError("low-rank keys: layers, kv heads and head_dim must be > 0");
  }
  if (geometry.dtype != DType::kF32 && geometry.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("low-rank keys: the KV dtype must be f32 or bf16");
  }
  TANDEM_RETURN_IF_ERROR(ValidateLowRankOptions(options, geometry.head_dim));
  if (!options.enabled()) return absl::InvalidArgumentError("low-rank keys: rank 0 (none)");
  const int64_t rank = options.RankFor(geometry.head_dim);
  if (reserve_tokens < 0) return absl::InvalidArgumentError("low-rank keys: negative reserve");
  LowRankIndex index;
  index.backend_ = &backend;
  index.geometry_ = geometry;
  index.rank_ = rank;
  index.calib_tokens_ = options.calib_tokens;
  index.layers_.resize(geometry.num_layers);
  TANDEM_RETURN_IF_ERROR(index.Reserve(reserve_tokens));
  return index;
}

LowRankIndex::~LowRankIndex() = default;

size_t LowRankIndex::BytesFor(const WindowGeometry& g, const LowRankOptions& options,
                              int64_t tokens) {
  if (!options.enabled()) return 0;
  const auto rank = static_cast<size_t>(options.RankFor(g.head_dim));
  const size_t per_head = static_cast<size_t>(tokens) * (rank + 4) + g.head_dim * rank * 4 +
                          static_cast<size_t>(std::min(tokens, options.calib_tokens)) * g.head_dim *
                              DTypeBytes(g.dtype);
  return static_cast<size_t>(g.num_layers) * g.num_kv_heads * per_head;
}

size_t LowRankIndex::BufferBytes(DeviceBuffer Layer::*buffer, int64_t capacity_tokens) const {
  const size_t heads = geometry_.num_kv_heads;
  if (buffer == &Layer::coords) return heads * capacity_tokens * rank_;
  if (buffer == &Layer::scales) return heads * capacity_tokens * 4;
  if (buffer == &Layer::basis) return heads * geometry_.head_dim * rank_ * 4;
  return heads * capacity_tokens * KeyBytes();  // staging of that capacity
}

std::vector<LowRankIndex::Part> LowRankIndex::PartsOf(const Layer& layer) const {
  const size_t heads = geometry_.num_kv_heads;
  if (!layer.basis_made()) {
    if (layer.tokens == 0) return {};
    return {{&Layer::staging, layer.staging_capacity * KeyBytes(), layer.tokens * KeyBytes(),
             heads}};
  }
  return {{&Layer::coords, static_cast<size_t>(capacity_tokens_ * rank_),
           static_cast<size_t>(layer.tokens * rank_), heads},
          {&Layer::scales, static_cast<size_t>(capacity_tokens_) * 4,
           static_cast<size_t>(layer.tokens) * 4, heads},
          {&Layer::basis, 0, BufferBytes(&Layer::basis, 0), 1}};
}

size_t LowRankIndex::resident_bytes() const {
  size_t bytes = 0;
  for (const Layer& layer : layers_) {
    bytes += BufferBytes(&Layer::coords, capacity_tokens_) +
             BufferBytes(&Layer::scales, capacity_tokens_);
    if (layer.basis_made()) bytes += BufferBytes(&Layer::basis, 0);
    if (!layer.basis_made()) bytes += BufferBytes(&Layer::staging, layer.staging_capacity);
  }
  return bytes;
}

absl::Status LowRankIndex::Reserve(int64_t tokens) {
  if (parked()) return absl::FailedPreconditionError("low-rank keys: parked (Unpark first)");
  if (tokens <= capacity_tokens_) return absl::OkStatus();
  const int64_t grown = std::max(tokens, capacity_tokens_ + capacity_tokens_ / 2);
  std::vector<DeviceBuffer> coords(layers_.size()), scales(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    absl::StatusOr<DeviceBuffer> c = backend_->Allocate(BufferBytes(&Layer::coords, grown));
    absl::StatusOr<DeviceBuffer> s =
        c.ok() ? backend_->Allocate(BufferBytes(&Layer::scales, grown)) : c.status();
    if (!s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "low-rank keys of ", grown, " offloaded tokens need ",
          FormatBytes((BufferBytes(&Layer::coords, grown) + BufferBytes(&Layer::scales, grown)) *
                      layers_.size()),
          " of device memory (rank ", rank_, "): ", s.status().message()));
    }
    coords[l] = std::move(*c);
    scales[l] = std::move(*s);
  }
  // The rows written, head by head, into the wider rows.
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (!layer.basis_made() || layer.tokens == 0) continue;
    for (int64_t g = 0; g < geometry_.num_kv_heads; ++g) {
      TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(
          coords[l].as<int8_t>() + g * grown * rank_,
          layer.coords.as<int8_t>() + g * capacity_tokens_ * rank_, layer.tokens * rank_));
      TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(scales[l].as<float>() + g * grown,
                                                    layer.scales.as<float>() + g * capacity_tokens_,
                                                    layer.tokens * 4));
    }
  }
  // Staging for the keys reserved, up to the calibration, in the layers still calibrating:
  // allocated here, so that what a session holds is what it reserved.
  const int64_t staging = std::min(calib_tokens_, grown);
  std::vector<DeviceBuffer> stagings(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (layer.basis_made() || layer.staging_capacity >= staging) continue;
    absl::StatusOr<DeviceBuffer> s = backend_->Allocate(BufferBytes(&Layer::staging, staging));
    if (!s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "low-rank keys: staging the first ", staging, " keys needs ",
          FormatBytes(BufferBytes(&Layer::staging, staging)), " per layer: ", s.status().message()));
    }
    stagings[l] = std::move(*s);
    const size_t key = KeyBytes();
    for (int64_t g = 0; g < geometry_.num_kv_heads && layer.tokens > 0; ++g) {
      TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(
          stagings[l].as<char>() + g * staging * key,
          layer.staging.as<char>() + g * layer.staging_capacity * key, layer.tokens * key));
    }
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    layer.coords = std::move(coords[l]);
    layer.scales = std::move(scales[l]);
    if (stagings[l]) {
      layer.staging = std::move(stagings[l]);
      layer.staging_capacity = staging;
    }
  }
  capacity_tokens_ = grown;
  return absl::OkStatus();
}

absl::Status LowRankIndex::Append(int64_t layer_index, const void* k_cache, int64_t capacity,
                                  int64_t first_slot, int64_t count) {
  if (layer_index < 0 || layer_index >= geometry_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("low-rank keys: layer ", layer_index));
  }
  if (count <= 0) return absl::OkStatus();
  Layer& layer = layers_[layer_index];
  TANDEM_RETURN_IF_ERROR(Reserve(layer.tokens + count));
  if (layer.state == State::kStaging) {
    const int64_t staged = std::min(count, calib_tokens_ - layer.tokens);
    TANDEM_RETURN_IF_ERROR(Stage(layer, k_cache, capacity, first_slot, staged));
    if (layer.tokens == calib_tokens_) layer.state = State::kDue;
    first_slot += staged;
    count -= staged;
    if (count == 0) return absl::OkStatus();
  }
  // Keys beyond the staging are projected, which needs the basis now.
  if (!layer.basis_made()) TANDEM_RETURN_IF_ERROR(Advance(/*wait=*/true));
  return Project(layer, k_cache, capacity, first_slot, count);
}

bool LowRankIndex::calibrating() const {
  return std::any_of(layers_.begin(), layers_.end(), [](const Layer& layer) {
    return layer.state == State::kDue || layer.state == State::kSolving;
  });
}

int64_t LowRankIndex::tokens_until_due() const {
  int64_t most = 0;
  for (const Layer& layer : layers_) {
    if (layer.state == State::kStaging) most = std::max(most, calib_tokens_ - layer.tokens);
  }
  return most;
}

absl::Status LowRankIndex::Advance(bool wait) {
  if (parked()) return absl::OkStatus();   // (Park installed any job; Unpark keeps what is due)
  if (job_.has_value() &&
      (wait || job_->bases.wait_for(std::chrono::seconds(0)) == std::future_status::ready)) {
    TANDEM_RETURN_IF_ERROR(InstallBases());
  }
  if (!job_.has_value()) TANDEM_RETURN_IF_ERROR(StartBases());
  if (wait) TANDEM_RETURN_IF_ERROR(InstallBases());
  return absl::OkStatus();
}

absl::Status LowRankIndex::Stage(Layer& layer, const void* k_cache, int64_t capacity,
                                 int64_t first_slot, int64_t count) {
  const size_t key = KeyBytes();
  if (layer.staging_capacity < layer.tokens + count) {   // (Append reserved them)
    return absl::InternalError("low-rank keys: staging smaller than the keys reserved");
  }
  for (int64_t g = 0; g < geometry_.num_kv_heads; ++g) {
    TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(
        layer.staging.as<char>() + (g * layer.staging_capacity + layer.tokens) * key,
        static_cast<const char*>(k_cache) + (g * capacity + first_slot) * key, count * key));
  }
  layer.tokens += count;
  return absl::OkStatus();
}

absl::Status LowRankIndex::StartBases() {
  std::vector<int64_t> due;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    if (layers_[l].state == State::kDue) due.push_back(l);
  }
  if (due.empty()) return absl::OkStatus();
  const int64_t heads = geometry_.num_kv_heads, D = geometry_.head_dim;
  const size_t layer_floats = static_cast<size_t>(heads * D * D);
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer gram,
                          backend_->Allocate(due.size() * layer_floats * sizeof(float)));
  for (size_t i = 0; i < due.size(); ++i) {
    const Layer& layer = layers_[due[i]];
    KeyGramParams p;
    p.k = layer.staging.data();
    p.capacity = layer.staging_capacity;
    p.first_slot = 0;
    p.count = calib_tokens_;
    p.dtype = geometry_.dtype;
    p.num_kv_heads = heads;
    p.head_dim = D;
    p.gram = gram.as<float>() + i * layer_floats;
    TANDEM_RETURN_IF_ERROR(backend_->KeyGram(p));
  }
  std::vector<float> host(due.size() * layer_floats);
  TANDEM_RETURN_IF_ERROR(backend_->CopyToHost(host.data(), gram.data(), host.size() * 4));
  for (int64_t l : due) layers_[l].state = State::kSolving;
  // The job owns its inputs: the index may move (or die: the future's destructor waits).
  BasisJob job;
  job.layers = due;
  job.started = std::chrono::steady_clock::now();
  job.bases = std::async(std::launch::async,
                         [host = std::move(host), due, heads, D, R = rank_] {
                           return SolveBases(host, due, heads, D, R);
                         });
  job_ = std::move(job);
  return absl::OkStatus();
}

absl::Status LowRankIndex::InstallBases() {
  if (!job_.has_value()) return absl::OkStatus();
  BasisJob job = std::move(*job_);
  job_.reset();
  const auto asked = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<float>> bases = job.bases.get();
  const auto got = std::chrono::steady_clock::now();
  spdlog::debug("low-rank bases of {} layers: installed {:.1f} ms after their start, {:.1f} ms "
                "of it waited for", job.layers.size(),
                1e3 * std::chrono::duration<double>(got - job.started).count(),
                1e3 * std::chrono::duration<double>(got - asked).count());
  if (!bases.ok()) {   // due again: a later Advance retries, the caller hears why
    for (int64_t l : job.layers) layers_[l].state = State::kDue;
    return bases.status();
  }
  const size_t layer_floats = static_cast<size_t>(geometry_.num_kv_heads * geometry_.head_dim *
                                                  rank_);
  for (size_t i = 0; i < job.layers.size(); ++i) {
    Layer& layer = layers_[job.layers[i]];
    TANDEM_ASSIGN_OR_RETURN(layer.basis, backend_->Allocate(layer_floats * 4));
    TANDEM_RETURN_IF_ERROR(backend_->CopyToDevice(
        layer.basis.data(), bases->data() + i * layer_floats, layer_floats * 4));
    layer.state = State::kMade;
    const int64_t staged = layer.tokens;
    layer.tokens = 0;
    TANDEM_RETURN_IF_ERROR(
        Project(layer, layer.staging.data(), layer.staging_capacity, 0, staged));
    // (The projection is queued on the backend's stream; freeing waits for it where needed.)
    layer.staging.Reset();
    layer.staging_capacity = 0;
  }
  return absl::OkStatus();
}

absl::Status LowRankIndex::Project(Layer& layer, const void* k, int64_t capacity,
                                   int64_t first_slot, int64_t count) {
  ProjectKeysParams p;
  p.k = k;
  p.capacity = capacity;
  p.first_slot = first_slot;
  p.count = count;
  p.dtype = geometry_.dtype;
  p.num_kv_heads = geometry_.num_kv_heads;
  p.head_dim = geometry_.head_dim;
  p.basis = layer.basis.as<float>();
  p.rank = rank_;
  p.coords = layer.coords.as<int8_t>();
  p.scales = layer.scales.as<float>();
  p.max_tokens = capacity_tokens_;
  p.first_token = layer.tokens;
  TANDEM_RETURN_IF_ERROR(backend_->ProjectKeys(p));
  layer.tokens += count;
  return absl::OkStatus();
}

absl::StatusOr<LowRankKeys> LowRankIndex::Keys(int64_t layer_index, int64_t page_tokens,
                                               float softmax_scale) const {
  if (layer_index < 0 || layer_index >= geometry_.num_layers || !ready(layer_index)) {
    return absl::FailedPreconditionError(
        absl::StrCat("low-rank keys: layer ", layer_index, " has no basis yet"));
  }
  const Layer& layer = layers_[layer_index];
  LowRankKeys keys;
  keys.basis = layer.basis.as<float>();
  keys.coords = layer.coords.as<int8_t>();
  keys.scales = layer.scales.as<float>();
  keys.rank = rank_;
  keys.max_tokens = capacity_tokens_;
  keys.page_tokens = page_tokens;
  keys.softmax_scale = softmax_scale;
  return keys;
}

absl::StatusOr<LowRankIndex> LowRankIndex::Fork(int64_t reserve_tokens) const {
  if (parked()) return absl::FailedPreconditionError("low-rank keys: parked (Unpark first)");
  int64_t written = 0;
  for (const Layer& layer : layers_) written = std::max(written, layer.tokens);
  TANDEM_ASSIGN_OR_RETURN(LowRankIndex fork,
                          Create(*backend_, geometry_, {rank_, calib_tokens_}, 0));
  // The calibration state first, so that Reserve stages room only where the basis is not made.
  // A basis being made here is due in the fork (made again from the same staged keys).
  for (size_t l = 0; l < layers_.size(); ++l) {
    const State state = layers_[l].state;
    fork.layers_[l].state = state == State::kSolving ? State::kDue : state;
  }
  TANDEM_RETURN_IF_ERROR(fork.Reserve(std::max(reserve_tokens, written)));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& from = layers_[l];
    Layer& to = fork.layers_[l];
    to.tokens = from.tokens;
    // The fork's rows may be wider (its capacity): each part's pitch from its own layout.
    const std::vector<Part> src_parts = PartsOf(from);
    const std::vector<Part> dst_parts = fork.PartsOf(to);
    for (size_t i = 0; i < src_parts.size(); ++i) {
      const Part& part = src_parts[i];
      DeviceBuffer& dst = to.*part.buffer;
      if (!dst) {
        TANDEM_ASSIGN_OR_RETURN(dst, backend_->Allocate((from.*part.buffer).bytes()));
      }
      const size_t dst_pitch = dst_parts[i].pitch;
      for (size_t r = 0; r < part.rows; ++r) {
        TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(
            dst.as<char>() + r * dst_pitch, (from.*part.buffer).as<char>() + r * part.pitch,
            part.row_bytes));
      }
    }
  }
  return fork;
}

size_t LowRankIndex::ParkBytes() const {
  size_t bytes = 0;
  for (const Layer& layer : layers_) {
    for (const Part& part : PartsOf(layer)) bytes += part.rows * part.row_bytes;
  }
  return bytes;
}

absl::Status LowRankIndex::Park(ParkingPool& pool) {
  if (parked()) return absl::FailedPreconditionError("low-rank keys: already parked");
  TANDEM_RETURN_IF_ERROR(InstallBases());   // a job's bases first: parked layers hold no job
  TANDEM_ASSIGN_OR_RETURN(ParkingSpace space, pool.Take(ParkBytes()));
  size_t offset = 0;
  for (const Layer& layer : layers_) {
    for (const Part& part : PartsOf(layer)) {
      TANDEM_RETURN_IF_ERROR(space.CopyRowsFromDevice(offset, (layer.*part.buffer).data(),
                                                      std::max(part.pitch, part.row_bytes),
                                                      part.row_bytes, part.rows));
      offset += part.rows * part.row_bytes;
    }
  }
  parked_ = std::move(space);
  for (Layer& layer : layers_) {
    layer.coords.Reset();
    layer.scales.Reset();
    layer.basis.Reset();
    layer.staging.Reset();
  }
  return absl::OkStatus();
}

absl::Status LowRankIndex::Unpark() {
  if (!parked()) return absl::FailedPreconditionError("low-rank keys: not parked");
  std::vector<Layer> fresh(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& to = fresh[l];
    to.tokens = layers_[l].tokens;
    to.state = layers_[l].state;
    TANDEM_ASSIGN_OR_RETURN(to.coords,
                            backend_->Allocate(BufferBytes(&Layer::coords, capacity_tokens_)));
    TANDEM_ASSIGN_OR_RETURN(to.scales,
                            backend_->Allocate(BufferBytes(&Layer::scales, capacity_tokens_)));
    if (to.basis_made()) {
      TANDEM_ASSIGN_OR_RETURN(to.basis, backend_->Allocate(BufferBytes(&Layer::basis, 0)));
    } else if (layers_[l].staging_capacity > 0) {
      to.staging_capacity = layers_[l].staging_capacity;
      TANDEM_ASSIGN_OR_RETURN(
          to.staging, backend_->Allocate(BufferBytes(&Layer::staging, to.staging_capacity)));
    }
  }
  size_t offset = 0;
  for (Layer& layer : fresh) {
    for (const Part& part : PartsOf(layer)) {
      TANDEM_RETURN_IF_ERROR(parked_.CopyRowsToDevice((layer.*part.buffer).data(),
                                                      std::max(part.pitch, part.row_bytes), offset,
                                                      part.row_bytes, part.rows));
      offset += part.rows * part.row_bytes;
    }
  }
  layers_ = std::move(fresh);
  parked_.Release();
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
