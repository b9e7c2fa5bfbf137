#include "tandem/gpu_worker/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "json_fields.h"
#include "nlohmann/json.hpp"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit
constexpr char kMetadataKey[] = "__metadata__";

absl::Status FileError(const std::filesystem::path& path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", message));
}

absl::Status TensorError(const std::filesystem::path& path, absl::string_view tensor,
                         absl::string_view message) {
  return absl::InvalidArgumentError(
      absl::StrCat(path.string(), ": tensor \"", tensor, "\": ", message));
}

// The safetensors dtype names; "" for a DType with no safetensors spelling.
absl::string_view SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "";
}

bool ParseSafetensorsDType(absl::string_view name, DType* dtype) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kF8E4M3}) {
    if (SafetensorsDTypeName(d) == name) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

// Number of elements of `shape`, or -1 if a dimension is negative or the product exceeds
// int64 / 8 (so numel * element size cannot overflow either).
int64_t CheckedNumel(const std::vector<int64_t>& shape) {
  constexpr int64_t kLimit = std::numeric_limits<int64_t>::max() / 8;
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return -1;
    if (dim != 0 && numel > kLimit / dim) return -1;
    numel *= dim;
  }
  return numel;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Parses one header entry {"dtype", "shape", "data_offsets"} into *view (data pointing at
// `data` + begin), checking it against the `data_size`-byte data buffer.
absl::Status ParseTensorEntry(const std::filesystem::path& path, const std::string& name,
                              const json& entry, const uint8_t* data, uint64_t data_size,
                              TensorView* view, uint64_t* begin_out) {
  if (!entry.is_object()) {
    return TensorError(path, name, absl::StrCat("expected an object, found ", entry.type_name()));
  }
  const std::string where = absl::StrCat(path.string(), ": tensor \"", name, "\"");
  const json* dtype_field = internal::FindField(entry, "dtype");
  const json* shape_field = internal::FindField(entry, "shape");
  const json* offsets_field = internal::FindField(entry, "data_offsets");
  if (dtype_field == nullptr || shape_field == nullptr || offsets_field == nullptr) {
    return TensorError(path, name, "needs dtype, shape and data_offsets");
  }
  TANDEM_ASSIGN_OR_RETURN(std::string dtype_name,
                          internal::JsonToString(*dtype_field, absl::StrCat(where, " dtype")));
  if (!ParseSafetensorsDType(dtype_name, &view->dtype)) {
    return TensorError(
        path, name,
        absl::StrCat("dtype \"", dtype_name, "\" is not supported (F32, BF16, F16, I32, F8_E4M3)"));
  }
  if (!shape_field->is_array()) {
    return internal::TypeError(absl::StrCat(where, " shape"), "a list", *shape_field);
  }
  view->shape.clear();
  for (const json& dim : *shape_field) {
    TANDEM_ASSIGN_OR_RETURN(int64_t d, internal::JsonToInt64(dim, absl::StrCat(where, " shape")));
    view->shape.push_back(d);
  }
  const int64_t numel = CheckedNumel(view->shape);
  if (numel < 0) {
    return TensorError(path, name,
                       absl::StrCat("shape ", ShapeString(view->shape),
                                    " has a negative dimension or is too large"));
  }
  if (!offsets_field->is_array() || offsets_field->size() != 2) {
    return TensorError(path, name, "data_offsets must be a list [begin, end]");
  }
  TANDEM_ASSIGN_OR_RETURN(
      int64_t begin, internal::JsonToInt64((*offsets_field)[0], absl::StrCat(where, " begin")));
  TANDEM_ASSIGN_OR_RETURN(int64_t end,
                          internal::JsonToInt64((*offsets_field)[1], absl::StrCat(where, " end")));
  if (begin < 0 || begin > end || static_cast<uint64_t>(end) > data_size) {
    return TensorError(
        path, name,
        absl::StrCat("data_offsets [", begin, ", ", end, "] are not a range within the ", data_size,
                     "-byte data buffer"));
  }
  const uint64_t expected = static_cast<uint64_t>(numel) * DTypeBytes(view->dtype);
  if (static_cast<uint64_t>(end - begin) != expected) {
    return TensorError(path, name,
                       absl::StrCat("data_offsets span ", end - begin, " bytes but ", dtype_name,
                                    " ", ShapeString(view->shape), " needs ", expected));
  }
  view->name = name;
  view->data = data + begin;
  view->bytes = static_cast<size_t>(expected);
  *begin_out = static_cast<uint64_t>(begin);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTextFile(const std::filesystem::path& path, uintmax_t max_bytes) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path.string(), ": ", ec.message()));
  if (size > max_bytes) return FileError(path, absl::StrCat("larger than ", max_bytes, " bytes"));
  std::ifstream in(path, std::ios::binary);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
    return FileError(path, "read failed");
  }
  return text;
}

// A shard name from an index must name a file directly inside the model directory.
bool IsPlainFileName(const std::string& name) {
  const std::filesystem::path p(name);
  return !name.empty() && p == p.filename() && name != "." && name != "..";
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::filesystem::path& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file->fd_ < 0) {
    const int err = errno;
    const std::string message = absl::StrCat(path.string(), ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    return absl::InvalidArgumentError(message);
  }
  struct stat st;
  if (::fstat(file->fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    return FileError(path, "not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return FileError(path, absl::StrCat("only ", file_size, " bytes: too short for a header"));
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, file->fd_, 0);
  if (map == MAP_FAILED) {
    return FileError(path, absl::StrCat("mmap failed: ", std::strerror(errno)));
  }
  file->map_ = map;
  file->map_bytes_ = file_size;
  TANDEM_RETURN_IF_ERROR(file->Parse(static_cast<const uint8_t*>(map), file_size));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string_view bytes, const std::filesystem::path& name) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = name;
  TANDEM_RETURN_IF_ERROR(file->Parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  return file;
}

absl::Status SafetensorsFile::Parse(const uint8_t* base, uint64_t file_size) {
  if (file_size < 8) {
    return FileError(path_, absl::StrCat("only ", file_size, " bytes: too short for a header"));
  }

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | base[i];  // little-endian
  if (header_bytes > file_size - 8 || header_bytes > kMaxHeaderBytes) {
    return FileError(path_, absl::StrCat("header length ", header_bytes, " exceeds the file (",
                                         file_size, " bytes) or the 100 MB limit"));
  }
  const std::string_view header_text(reinterpret_cast<const char*>(base + 8), header_bytes);
  TANDEM_ASSIGN_OR_RETURN(json header, internal::ParseJsonObject(
                                           header_text, absl::StrCat(path_.string(), ": header")));
  const uint8_t* data = base + 8 + header_bytes;
  const uint64_t data_size = file_size - 8 - header_bytes;

  std::vector<std::pair<uint64_t, size_t>> order;  // (begin, index into tensors_)
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (it->is_null()) continue;
      if (!it->is_object()) return FileError(path_, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return FileError(path_,
                           absl::StrCat("__metadata__ value of \"", m.key(), "\" is not a string"));
        }
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorView view;
    uint64_t begin = 0;
    TANDEM_RETURN_IF_ERROR(ParseTensorEntry(path_, it.key(), *it, data, data_size, &view, &begin));
    order.emplace_back(begin, tensors_.size());
    tensors_.push_back(std::move(view));
  }

  // Order by offset and reject overlapping byte ranges (empty tensors overlap nothing).
  std::sort(order.begin(), order.end());
  std::vector<TensorView> sorted;
  sorted.reserve(order.size());
  uint64_t covered_end = 0;
  const TensorView* covered_by = nullptr;
  for (const auto& [begin, index] : order) {
    TensorView& view = tensors_[index];
    if (view.bytes > 0) {
      if (covered_by != nullptr && begin < covered_end) {
        return TensorError(path_, view.name,
                           absl::StrCat("byte range overlaps tensor \"", covered_by->name, "\""));
      }
      covered_end = begin + view.bytes;
      covered_by = &view;
    }
  }
  for (const auto& [begin, index] : order) sorted.push_back(std::move(tensors_[index]));
  tensors_ = std::move(sorted);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  return absl::OkStatus();
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    // The views point into the mapping, which does not move.
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);
  map_ = nullptr;
  map_bytes_ = 0;
  fd_ = -1;
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<std::unique_ptr<SafetensorsArchive>> SafetensorsArchive::Open(
    const std::filesystem::path& model_dir) {
  std::unique_ptr<SafetensorsArchive> archive(new SafetensorsArchive());
  const std::filesystem::path single = model_dir / "model.safetensors";
  const std::filesystem::path index_path = model_dir / "model.safetensors.index.json";
  std::error_code ec;
  if (std::filesystem::exists(single, ec)) {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single));
    for (const TensorView& view : file->tensors()) archive->by_name_[view.name] = &view;
    archive->files_.push_back(std::move(file));
  } else if (std::filesystem::exists(index_path, ec)) {
    TANDEM_ASSIGN_OR_RETURN(std::string text, ReadTextFile(index_path, kMaxHeaderBytes));
    TANDEM_ASSIGN_OR_RETURN(json index, internal::ParseJsonObject(text, index_path.string()));
    const json* weight_map = internal::FindField(index, "weight_map");
    if (weight_map == nullptr || !weight_map->is_object()) {
      return FileError(index_path, "weight_map is missing or not an object");
    }
    std::map<std::string, SafetensorsFile*> shards;  // shard file name -> opened file
    for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
      const std::string& name = it.key();
      if (!it->is_string() || !IsPlainFileName(it->get<std::string>())) {
        return TensorError(index_path, name,
                           "weight_map value is not a file name in the model "
                           "directory");
      }
      const std::string shard_name = it->get<std::string>();
      auto shard = shards.find(shard_name);
      if (shard == shards.end()) {
        absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened =
            SafetensorsFile::Open(model_dir / shard_name);
        if (!opened.ok()) {
          return TensorError(
              index_path, name,
              absl::StrCat("cannot open shard \"", shard_name, "\": ", opened.status().message()));
        }
        shard = shards.emplace(shard_name, opened->get()).first;
        archive->files_.push_back(*std::move(opened));
      }
      const TensorView* view = shard->second->Find(name);
      if (view == nullptr) {
        return TensorError(index_path, name,
                           absl::StrCat("listed in shard \"", shard_name, "\" but absent there"));
      }
      archive->by_name_[name] = view;
    }
  } else {
    return absl::NotFoundError(absl::StrCat(model_dir.string(),
                                            ": has neither model.safetensors "
                                            "nor model.safetensors.index.json"));
  }
  for (const auto& [name, view] : archive->by_name_) archive->total_bytes_ += view->bytes;
  return archive;
}

const TensorView* SafetensorsArchive::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<const TensorView*> SafetensorsArchive::tensors() const {
  std::vector<const TensorView*> views;
  views.reserve(by_name_.size());
  for (const auto& [name, view] : by_name_) views.push_back(view);
  return views;
}

absl::Status WriteSafetensors(const std::filesystem::path& path,
                              const std::vector<TensorToWrite>& tensors) {
  json header = json::object();
  header[kMetadataKey] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey || header.contains(t.name)) {
      return TensorError(path, t.name, "name is empty, reserved or repeated");
    }
    const absl::string_view dtype_name = SafetensorsDTypeName(t.dtype);
    const int64_t numel = CheckedNumel(t.shape);
    if (dtype_name.empty() || numel < 0) {
      return TensorError(path, t.name, "bad dtype or shape");
    }
    const uint64_t expected = static_cast<uint64_t>(numel) * DTypeBytes(t.dtype);
    if (t.bytes != expected || (t.bytes > 0 && t.data == nullptr)) {
      return TensorError(
          path, t.name,
          absl::StrCat(t.bytes, " bytes given but ", ShapeString(t.shape), " needs ", expected));
    }
    header[t.name] = {{"dtype", static_cast<std::string>(dtype_name)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + expected}}};
    offset += expected;
  }
  std::string text;
  try {
    text = header.dump();  // throws only for names that are not valid UTF-8
  } catch (const json::exception& e) {
    return FileError(path, absl::StrCat("cannot encode the header: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(text.size() >> (8 * i));
  out.write(reinterpret_cast<const char*>(length), sizeof(length));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorToWrite& t : tensors) {
    out.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(t.bytes));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
