#include "tandem/gpu_worker/safetensors.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model_test_util.h"
#include "tandem/common/bf16.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::ReadFile;
using testing::TempDir;
using testing::WriteFile;

// Tensors of every dtype with distinct, recognisable contents.
struct SampleTensors {
  std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 1e-30f};  // [2, 3]
  std::vector<bf16_t> bf16 = {FloatToBf16(1.0f), FloatToBf16(-3.5f), FloatToBf16(0.125f),
                              FloatToBf16(65504.0f)};                            // [4]
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x3555};  // [3, 2]
  std::vector<int32_t> i32 = {7, -1, 2147483647, 0, 42};                         // [5]
  float scalar = 9.75f;                                                          // []

  std::vector<TensorToWrite> ToWrite() const {
    return {
        {"a.f32", DType::kF32, {2, 3}, f32.data(), f32.size() * 4},
        {"b.bf16", DType::kBF16, {4}, bf16.data(), bf16.size() * 2},
        {"c.f16", DType::kF16, {3, 2}, f16.data(), f16.size() * 2},
        {"d.i32", DType::kI32, {5}, i32.data(), i32.size() * 4},
        {"e.scalar", DType::kF32, {}, &scalar, 4},
        {"f.empty", DType::kBF16, {0, 3}, nullptr, 0},
    };
  }
};

void ExpectSameTensor(const TensorView* view, const TensorToWrite& want) {
  ASSERT_NE(view, nullptr) << want.name;
  EXPECT_EQ(view->name, want.name);
  EXPECT_EQ(view->dtype, want.dtype) << want.name;
  EXPECT_EQ(view->shape, want.shape) << want.name;
  ASSERT_EQ(view->bytes, want.bytes) << want.name;
  if (want.bytes > 0) {
    EXPECT_EQ(std::memcmp(view->data, want.data, want.bytes), 0) << want.name;
  }
}

// A raw safetensors file: the 8-byte length, `header` verbatim, then `data_bytes` bytes 0..255.
std::string RawFile(const std::string& header, size_t data_bytes) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>(header.size() >> (8 * i));
  file += header;
  for (size_t i = 0; i < data_bytes; ++i) file.push_back(static_cast<char>(i));
  return file;
}

TEST(SafetensorsTest, WriteThenOpenRoundTrips) {
  TempDir dir;
  const SampleTensors sample;
  const std::vector<TensorToWrite> tensors = sample.ToWrite();
  const auto path = dir.path() / "t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());

  // The layout is the reference one: an 8-byte aligned header, then the data back to back.
  const std::string raw = ReadFile(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, raw.data(), 8);
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_bytes + 24 + 8 + 12 + 20 + 4);

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), tensors.size());
  EXPECT_EQ((*file)->path(), path);
  for (const TensorToWrite& t : tensors) ExpectSameTensor((*file)->Find(t.name), t);
  EXPECT_EQ((*file)->Find("a.f32")->numel(), 6);
  EXPECT_EQ((*file)->Find("e.scalar")->numel(), 1);
  EXPECT_EQ((*file)->Find("f.empty")->numel(), 0);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  // The first tensor's data starts right after the header, 8-byte aligned.
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*file)->Find("a.f32")->data) % 8, 0u);
  EXPECT_EQ(static_cast<const float*>((*file)->Find("a.f32")->data)[1], -2.25f);

  // Moving the file keeps the views (they point into the mapping, which does not move).
  SafetensorsFile moved(std::move(**file));
  file->reset();
  ExpectSameTensor(moved.Find("c.f16"), tensors[2]);
}

TEST(SafetensorsTest, WriteRejectsInconsistentTensors) {
  TempDir dir;
  const float values[4] = {1, 2, 3, 4};
  const auto path = dir.path() / "bad.safetensors";
  EXPECT_EQ(WriteSafetensors(path, {{"x", DType::kF32, {3}, values, 16}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(
                path, {{"x", DType::kF32, {4}, values, 16}, {"x", DType::kF32, {4}, values, 16}})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(path, {{"x", DType::kF32, {-4}, values, 16}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(path, {{"", DType::kF32, {4}, values, 16}}).code(),
            absl::StatusCode::kInvalidArgument);
}

struct Corruption {
  const char* name;
  std::string file;
  const char* message_part;
};

TEST(SafetensorsTest, CorruptFilesAreInvalidArgument) {
  TempDir dir;
  const std::string big_length = std::string("\x00\x00\x00\x00\x00\x01\x00\x00", 8) + "{}";
  const std::vector<Corruption> cases = {
      {"empty", "", "too short"},
      {"truncated length", std::string("\x10\x00\x00", 3), "too short"},
      {"header past the file", big_length, "header length"},
      {"bad json", RawFile("{\"x\": {\"dtype\": ", 0), "not valid JSON"},
      {"not an object", RawFile("[1, 2, 3]", 0), "expected a JSON object"},
      {"entry not an object", RawFile(R"({"w": 5})", 0), "\"w\""},
      {"missing shape", RawFile(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
       "needs dtype, shape and data_offsets"},
      {"unknown dtype",
       RawFile(R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", 8), "I64"},
      {"negative shape",
       RawFile(R"({"w": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}})", 8),
       "negative"},
      {"overflowing shape",
       RawFile(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296],
                   "data_offsets": [0, 0]}})",
               0),
       "too large"},
      {"end past data",
       RawFile(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12),
       "data_offsets"},
      {"begin after end",
       RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 16),
       "data_offsets"},
      {"offsets not a pair",
       RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4), "data_offsets"},
      {"offsets not ints",
       RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}})", 4), "\"w\""},
      {"size mismatch",
       RawFile(R"({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 16]}})", 16),
       "needs 8"},
      {"overlap",
       RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                   "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
               24),
       "overlaps"},
      {"metadata not strings", RawFile(R"({"__metadata__": {"format": 1}})", 0), "__metadata__"},
  };
  for (const Corruption& c : cases) {
    const auto path = dir.path() / "corrupt.safetensors";
    WriteFile(path, c.file);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(file.status().message(), HasSubstr(c.message_part)) << c.name;
    EXPECT_THAT(file.status().message(), HasSubstr("corrupt.safetensors")) << c.name;
  }
  // The well-formed neighbours of the cases above open, so the checks are not over-eager.
  const auto ok_path = dir.path() / "ok.safetensors";
  WriteFile(ok_path, RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
      "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
                             24));
  EXPECT_TRUE(SafetensorsFile::Open(ok_path).ok());
}

TEST(SafetensorsTest, HeaderLengthOverTheLimitIsRejectedWithoutReadingIt) {
  TempDir dir;
  const auto path = dir.path() / "huge.safetensors";
  // A sparse file of 101 MiB + 8 whose header length claims all of it.
  const uint64_t header_bytes = 101ull << 20;
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>(header_bytes >> (8 * i));
  WriteFile(path, length);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(header_bytes + 8)), 0);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("100 MB"));
}

TEST(SafetensorsTest, EveryTruncationAndRandomHeaderDamageFailsCleanly) {
  TempDir dir;
  const SampleTensors sample;
  const auto path = dir.path() / "t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, sample.ToWrite()).ok());
  const std::string good = ReadFile(path);
  const auto damaged = dir.path() / "damaged.safetensors";
  for (size_t size = 0; size < good.size(); ++size) {
    WriteFile(damaged, good.substr(0, size));
    EXPECT_EQ(SafetensorsFile::Open(damaged).status().code(), absl::StatusCode::kInvalidArgument)
        << "truncated to " << size;
  }
  // Random byte damage in the length and header: any outcome but a crash is acceptable, and an
  // accepted file's views must lie inside it.
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, good.data(), 8);
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 500; ++trial) {
    std::string bad = good;
    const size_t pos = rng() % (8 + header_bytes);
    bad[pos] = static_cast<char>(rng());
    WriteFile(damaged, bad);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(damaged);
    if (!file.ok()) {
      EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    for (const TensorView& view : (*file)->tensors()) EXPECT_LE(view.bytes, good.size());
  }
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  TempDir dir;
  EXPECT_EQ(SafetensorsFile::Open(dir.path() / "nope.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsArchive::Open(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, SingleFileArchive) {
  TempDir dir;
  const SampleTensors sample;
  const std::vector<TensorToWrite> tensors = sample.ToWrite();
  ASSERT_TRUE(WriteSafetensors(dir.path() / "model.safetensors", tensors).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsArchive>> archive =
      SafetensorsArchive::Open(dir.path());
  ASSERT_TRUE(archive.ok()) << archive.status();
  EXPECT_EQ((*archive)->num_tensors(), tensors.size());
  EXPECT_EQ((*archive)->total_bytes(), 24u + 8 + 12 + 20 + 4);
  EXPECT_EQ((*archive)->files().size(), 1u);
  for (const TensorToWrite& t : tensors) ExpectSameTensor((*archive)->Find(t.name), t);
}

// Writes `tensors` as two shards (first two tensors, the rest) plus the index.
void WriteSharded(const std::filesystem::path& dir, const std::vector<TensorToWrite>& tensors) {
  const std::vector<TensorToWrite> first(tensors.begin(), tensors.begin() + 2);
  const std::vector<TensorToWrite> second(tensors.begin() + 2, tensors.end());
  ASSERT_TRUE(WriteSafetensors(dir / "model-00001-of-00002.safetensors", first).ok());
  ASSERT_TRUE(WriteSafetensors(dir / "model-00002-of-00002.safetensors", second).ok());
  std::string map;
  for (size_t i = 0; i < tensors.size(); ++i) {
    absl::StrAppend(&map, i ? ", " : "", "\"", tensors[i].name, "\": \"model-0000", i < 2 ? 1 : 2,
                    "-of-00002.safetensors\"");
  }
  WriteFile(dir / "model.safetensors.index.json",
            absl::StrCat(R"({"metadata": {"total_size": 68}, "weight_map": {)", map, "}}"));
}

TEST(SafetensorsTest, ShardedArchiveLoadsTheSameTensors) {
  TempDir dir;
  const SampleTensors sample;
  const std::vector<TensorToWrite> tensors = sample.ToWrite();
  WriteSharded(dir.path(), tensors);
  absl::StatusOr<std::unique_ptr<SafetensorsArchive>> archive =
      SafetensorsArchive::Open(dir.path());
  ASSERT_TRUE(archive.ok()) << archive.status();
  EXPECT_EQ((*archive)->files().size(), 2u);  // each shard opened once
  EXPECT_EQ((*archive)->num_tensors(), tensors.size());
  EXPECT_EQ((*archive)->total_bytes(), 68u);
  for (const TensorToWrite& t : tensors) ExpectSameTensor((*archive)->Find(t.name), t);
  std::vector<std::string> names;
  for (const TensorView* view : (*archive)->tensors()) names.push_back(view->name);
  EXPECT_THAT(names, ElementsAre("a.f32", "b.bf16", "c.f16", "d.i32", "e.scalar", "f.empty"));
}

TEST(SafetensorsTest, BadIndexesAreInvalidArgument) {
  const SampleTensors sample;
  const std::vector<TensorToWrite> tensors = sample.ToWrite();
  struct Case {
    const char* name;
    std::string index;
    const char* message_part;
  };
  const std::vector<Case> cases = {
      {"missing shard", R"({"weight_map": {"a.f32": "model-00003-of-00002.safetensors"}})",
       "model-00003-of-00002.safetensors"},
      {"tensor not in shard", R"({"weight_map": {"zz": "model-00001-of-00002.safetensors"}})",
       "\"zz\""},
      {"path escape", R"({"weight_map": {"a.f32": "../model-00001-of-00002.safetensors"}})",
       "file name"},
      {"no weight_map", R"({"metadata": {}})", "weight_map"},
      {"not json", "{{", "not valid JSON"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    WriteSharded(dir.path(), tensors);
    WriteFile(dir.path() / "model.safetensors.index.json", c.index);
    absl::StatusOr<std::unique_ptr<SafetensorsArchive>> archive =
        SafetensorsArchive::Open(dir.path());
    EXPECT_EQ(archive.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(archive.status().message(), HasSubstr(c.message_part)) << c.name;
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
