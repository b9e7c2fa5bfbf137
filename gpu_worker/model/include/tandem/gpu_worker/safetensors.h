// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
//   [u64 little-endian N][N bytes of JSON header][data buffer]
// The header maps each tensor name to {"dtype": "F32"|"BF16"|"F16"|"I32"|..., "shape": [...],
// "data_offsets": [begin, end]} (offsets relative to the data buffer) and may hold a
// "__metadata__" object of strings. Tensors are row-major and little-endian.
//
// Files are mmap'ed read-only; TensorView::data points into the mapping, so a view is valid only
// while the SafetensorsFile / SafetensorsArchive that produced it lives. NOTE: a view's data is
// aligned only as far as the writer aligned it (WriteSafetensors and the Python writer pad the
// header to 8 bytes, so offsets that are multiples of the element size give aligned data);
// readers that need alignment should check or memcpy. If the file is truncated by another
// process while mapped, reading a view raises SIGBUS: that cannot be reported as a status.
//
// Errors: Open() returns NOT_FOUND for a missing file and INVALID_ARGUMENT (naming the file and,
// where there is one, the tensor) for any malformed content: a file under 8 bytes, a header
// length past the file or over 100 MB, a header that is not a JSON object, a dtype outside
// F32/BF16/F16/I32/F8_E4M3, a negative shape or one whose size overflows, data_offsets that are not
// [begin <= end <= data size], a byte range that does not equal numel x element size, or two
// tensors whose ranges overlap. Nothing throws and nothing is allocated in proportion to
// untrusted sizes before they are checked against the file.
//
// Thread safety: after Open() returns, all const methods may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major; [] for a scalar
  const void* data = nullptr;  // into the mmap; `bytes` long
  size_t bytes = 0;            // == numel() * DTypeBytes(dtype)
  int64_t numel() const;
};

// One .safetensors file, mmap'ed read-only. Move-only; unmaps and closes in the destructor.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  // The same parse of a whole file's bytes already in memory (tests and the fuzz target of
  // tests/fuzz): nothing is mapped, the views point into `bytes`, which must outlive the result.
  // `name` stands for the path in messages. Errors as Open's, less NOT_FOUND.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(
      std::string_view bytes, const std::filesystem::path& name);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // nullptr if the file has no tensor of that name.
  const TensorView* Find(std::string_view name) const;
  // In data-offset order.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::filesystem::path& path() const { return path_; }
  // The "__metadata__" string pairs (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void Unmap();
  // Reads the header of the `file_size` bytes at `base` into tensors_, index_ and metadata_.
  absl::Status Parse(const uint8_t* base, uint64_t file_size);

  std::filesystem::path path_;
  int fd_ = -1;
  void* map_ = nullptr;  // the whole file, PROT_READ
  size_t map_bytes_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A model's weights: model_dir/model.safetensors if it exists, else the shards listed by
// model_dir/model.safetensors.index.json ({"weight_map": {tensor name: shard file name}}), each
// distinct shard opened once. Every tensor of the weight map must exist in its shard; shard names
// must be plain file names inside model_dir. Move-only (held by unique_ptr).
class SafetensorsArchive {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsArchive>> Open(
      const std::filesystem::path& model_dir);

  // nullptr if absent.
  const TensorView* Find(std::string_view name) const;
  size_t num_tensors() const { return by_name_.size(); }
  // Sum of the bytes of all tensors of the archive.
  uint64_t total_bytes() const { return total_bytes_; }
  // All tensors, ordered by name.
  std::vector<const TensorView*> tensors() const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  SafetensorsArchive() = default;

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> by_name_;
  uint64_t total_bytes_ = 0;
};

// One tensor for WriteSafetensors; `data` is `bytes` bytes of row-major little-endian elements.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};

// Writes `tensors` (in the given order, contiguous) to `path` with metadata {"format": "pt"},
// padding the header with spaces to a multiple of 8 bytes as the reference writer does.
// INVALID_ARGUMENT for an empty or duplicate name, a negative shape, or bytes != numel x element
// size; INTERNAL if the file cannot be written.
absl::Status WriteSafetensors(const std::filesystem::path& path,
                              const std::vector<TensorToWrite>& tensors);

}  // namespace tandem::gpu_worker
