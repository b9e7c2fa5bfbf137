// Fuzzes config.json parsing (ParseModelConfig) and what is derived from an accepted config: the
// RoPE inverse frequencies (at the default and at a fuzzed sequence length), the attention
// scaling and the context limit. An accepted config must satisfy the header's contract.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "tandem/gpu_worker/model_config.h"

namespace gw = tandem::gpu_worker;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<gw::ModelConfig> parsed = gw::ParseModelConfig(text);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument,
               parsed.status().ToString());
    return 0;
  }
  const gw::ModelConfig& c = *parsed;
  const std::string what =
      absl::StrCat("accepted config: hidden ", c.hidden_size, " heads ", c.num_q_heads, "/",
                   c.num_kv_heads, " head_dim ", c.head_dim);
  FUZZ_CHECK(c.hidden_size > 0 && c.num_layers > 0 && c.vocab_size > 0, what);
  FUZZ_CHECK(c.num_q_heads > 0 && c.num_kv_heads > 0 && c.num_q_heads % c.num_kv_heads == 0, what);
  FUZZ_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, what);
  FUZZ_CHECK(c.sliding_window >= 0, what);

  const int64_t limit = gw::ModelContextLimit(c);
  FUZZ_CHECK(limit > 0, absl::StrCat(what, ": context limit ", limit));
  const float scaling = gw::RopeAttentionScaling(c);
  FUZZ_CHECK(std::isfinite(scaling), absl::StrCat(what, ": attention scaling ", scaling));
  // The sequence length a dynamic rope is evaluated at: the last bytes pick one up to the limit.
  const int64_t seq_len = size == 0 ? 0 : static_cast<int64_t>(data[size - 1]) * 1000 % (limit + 1);
  for (int64_t len : {int64_t{0}, seq_len, limit}) {
    const std::vector<float> inv_freq = gw::RopeInvFreq(c, len);
    FUZZ_CHECK(static_cast<int64_t>(inv_freq.size()) == c.head_dim / 2,
               absl::StrCat(what, ": ", inv_freq.size(), " inverse frequencies"));
    for (float f : inv_freq) {
      FUZZ_CHECK(std::isfinite(f) && f >= 0.0f,
                 absl::StrCat(what, ": inverse frequency ", f, " at length ", len));
    }
  }
  return 0;
}
