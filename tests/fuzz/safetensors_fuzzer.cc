// Fuzzes the safetensors reader: any bytes as a whole .safetensors file
// (SafetensorsFile::FromBytes, the parse behind Open). A file that is accepted must describe
// tensors inside its data buffer, in offset order, without overlap, each as long as its dtype and
// shape say.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "tandem/gpu_worker/safetensors.h"

using tandem::gpu_worker::DTypeBytes;
using tandem::gpu_worker::SafetensorsFile;
using tandem::gpu_worker::TensorView;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto file = SafetensorsFile::FromBytes(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument,
               file.status().ToString());
    FUZZ_CHECK(!file.status().message().empty(), "an error without a message");
    return 0;
  }
  const uint8_t* end = data + size;
  const uint8_t* previous_end = nullptr;
  uint64_t checksum = 0;
  for (const TensorView& view : (*file)->tensors()) {
    FUZZ_CHECK(view.bytes == static_cast<size_t>(view.numel()) * DTypeBytes(view.dtype), view.name);
    const uint8_t* begin = static_cast<const uint8_t*>(view.data);
    FUZZ_CHECK(begin >= data + 8 && begin + view.bytes <= end, view.name + ": outside the file");
    if (view.bytes > 0) {
      FUZZ_CHECK(previous_end == nullptr || begin >= previous_end, view.name + ": overlaps");
      previous_end = begin + view.bytes;
      // Touch both ends so AddressSanitizer sees any view past the buffer.
      checksum += begin[0] + begin[view.bytes - 1];
    }
    FUZZ_CHECK((*file)->Find(view.name) == &view, view.name + ": Find disagrees");
  }
  static volatile uint64_t sink;
  sink = checksum;
  return 0;
}
