// Fuzzes tokenizer.json loading (ParseTokenizerJson: the byte-level BPE tokenizer LoadTokenizer
// builds) and, when the file is accepted, the tokenizer itself on fuzzed text.
//
// Input: <tokenizer.json text> [NUL <text to encode>]. JSON text never holds a raw NUL, so the
// first NUL splits the two. An accepted tokenizer must give ids in [0, vocab_size), and the
// stream decoder's deltas plus its flush must equal Decode of the same ids (tokenizer.h).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace gw = tandem::gpu_worker;

namespace {

// Longest text encoded per input: BPE is quadratic in a pre-token's length in the worst case,
// and libFuzzer should spend its time on the parser, not on one long word.
constexpr size_t kMaxTextBytes = 4096;

void CheckIds(const gw::Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    FUZZ_CHECK(id >= 0 && id < tokenizer.vocab_size(),
               absl::StrCat("id ", id, " outside the vocab of ", tokenizer.vocab_size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view json = input.substr(0, nul);
  std::string_view text =
      nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);
  if (text.size() > kMaxTextBytes) text = text.substr(0, kMaxTextBytes);

  absl::StatusOr<std::unique_ptr<gw::Tokenizer>> loaded = gw::ParseTokenizerJson(json);
  if (!loaded.ok()) {
    FUZZ_CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument ||
                   loaded.status().code() == absl::StatusCode::kUnimplemented,
               loaded.status().ToString());
    FUZZ_CHECK(!loaded.status().message().empty(), "an error without a message");
    return 0;
  }
  const gw::Tokenizer& tokenizer = **loaded;
  FUZZ_CHECK(tokenizer.vocab_size() > 0, "an empty vocab was accepted");
  FUZZ_CHECK(tokenizer.bos_id() < tokenizer.vocab_size(), "bos outside the vocab");

  for (bool parse_special : {false, true}) {
    absl::StatusOr<std::vector<int32_t>> ids =
        tokenizer.Encode(text, /*add_bos=*/true, parse_special);
    if (!ids.ok()) {
      // A text the vocabulary cannot spell (a byte with no token) is refused, not crashed on.
      FUZZ_CHECK(!ids.status().message().empty(), "an encode error without a message");
      continue;
    }
    CheckIds(tokenizer, *ids);
    const std::string decoded = tokenizer.Decode(*ids, /*skip_special=*/true);
    gw::StreamDecoder stream(tokenizer, /*at_start=*/true, /*skip_special=*/true);
    std::string streamed;
    for (int32_t id : *ids) streamed += stream.Push(id);
    streamed += stream.Flush();
    FUZZ_CHECK(streamed == decoded,
               absl::StrCat("stream decode \"", streamed, "\" != decode \"", decoded, "\""));
    for (int32_t id : *ids) (void)gw::DescribeToken(tokenizer, id);
  }
  // Ids from the text's bytes, in range or not: Decode and TokenBytes take any id.
  std::vector<int32_t> raw_ids;
  for (size_t i = 0; i + 4 <= text.size() && raw_ids.size() < 64; i += 4) {
    int32_t id;
    __builtin_memcpy(&id, text.data() + i, 4);
    raw_ids.push_back(id);
    (void)tokenizer.TokenBytes(id);
  }
  (void)tokenizer.Decode(raw_ids, /*skip_special=*/false);
  return 0;
}
