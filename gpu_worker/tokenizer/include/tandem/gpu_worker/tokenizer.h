// Tokenizers of Hugging Face model directories: byte-level BPE from tokenizer.json (GPT-2,
// Llama-3, Qwen2, SmolLM) and SentencePiece from tokenizer.model (Llama-2, TinyLlama), plus a
// stream decoder that turns generated ids into valid UTF-8 text deltas.
//
// Thread safety: a loaded Tokenizer is immutable; Encode/Decode/TokenBytes may be called from any
// number of threads at once. A StreamDecoder is not thread-safe and must not outlive its Tokenizer.
//
// Errors: LoadTokenizer returns NOT_FOUND when the directory has neither tokenizer.json nor
// tokenizer.model, INVALID_ARGUMENT for malformed files (bad JSON, missing or mistyped fields,
// merges naming unknown tokens, regexes that do not compile, a corrupt SentencePiece model,
// special token ids out of range) and UNIMPLEMENTED for well-formed files that use a feature this
// implementation does not have (e.g. a Metaspace pre-tokenizer or byte_fallback; when
// tokenizer.model exists as well, it is used instead). Nothing throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::gpu_worker {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text` (any bytes; invalid UTF-8 is encoded byte by byte by byte-level BPE).
  // add_bos: prepend bos_id() when adds_bos() (tokenizer_config's add_bos_token, else
  // SentencePiece: yes, tokenizer.json: only when its TemplateProcessing post-processor lists the
  // BOS token; byte-level models like gutenberg-14m or GPT-2 add none). parse_special: special
  // added tokens written literally in the text (e.g. "<|endoftext|>") become those tokens;
  // non-special added tokens are always matched, as Hugging Face does.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_bos,
                                                      bool parse_special = false) const = 0;

  // Text of `ids` as valid UTF-8 (invalid byte sequences become U+FFFD). Special tokens are left
  // out when skip_special, else written as their text ("<s>", "<|endoftext|>"). When
  // strips_leading_space() (SentencePiece's dummy prefix) one leading space of the whole text is
  // removed, as Hugging Face's decode does. Ids outside [0, vocab_size) contribute nothing.
  virtual std::string Decode(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;

  // Raw bytes token `id` contributes when it follows other text (SentencePiece: "▁" -> " ",
  // <0xNN> byte pieces -> that byte; byte-level BPE: the bytes its characters stand for). Special
  // tokens and out-of-range ids: "". May be an incomplete UTF-8 sequence.
  virtual std::string TokenBytes(int32_t id) const = 0;

  virtual int32_t vocab_size() const = 0;                   // ids are in [0, vocab_size)
  virtual int32_t bos_id() const = 0;                       // -1 if none
  virtual const std::vector<int32_t>& eos_ids() const = 0;  // may be empty
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual std::string_view kind() const = 0;  // "bpe" or "sentencepiece"

  // Whether Encode(add_bos=true) prepends bos_id() (see Encode).
  virtual bool adds_bos() const { return bos_id() >= 0; }
  // Whether the tokenizer adds a space in front of the text itself (SentencePiece's dummy
  // prefix), so that decoding from the start of a text drops one leading space.
  virtual bool strips_leading_space() const { return false; }
};

// Loads model_dir/tokenizer.json when present (byte-level BPE), else model_dir/tokenizer.model
// (SentencePiece). BOS: tokenizer_config.json "bos_token" (a string or {"content": ...}) resolved
// through the vocab, else bos_token_id of generation_config.json, else of config.json, else the
// SentencePiece model's own, else the first token of a TemplateProcessing post-processor. EOS ids:
// the union, in this order, of generation_config.json and config.json eos_token_id (an int or a
// list) and tokenizer_config.json "eos_token"; the SentencePiece model's own when none is given.
// Whether BOS is added: tokenizer_config.json add_bos_token when present, else as in Encode.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::filesystem::path& model_dir);

// The byte-level BPE tokenizer of a tokenizer.json's text alone, as LoadTokenizer builds it for a
// directory holding only that file (no tokenizer_config / config / generation_config: BOS only
// from a TemplateProcessing post-processor, no EOS). For tests and the fuzz target of
// tests/fuzz. Errors as LoadTokenizer's for tokenizer.json (INVALID_ARGUMENT "tokenizer.json is
// not valid JSON" for text that does not parse, UNIMPLEMENTED for unsupported features).
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(std::string_view tokenizer_json);

// A prompt's ids as the worker tokenizes prompt_text: special tokens written in `text`
// ("<|im_start|>", "<s>") become their ids, as Hugging Face's tokenizers do by default (a rendered
// chat template relies on it), and add_bos prepends BOS when the tokenizer adds one and the text
// does not already start with it (templates often write it), so a prompt never starts with two.
absl::StatusOr<std::vector<int32_t>> EncodePrompt(const Tokenizer& tokenizer,
                                                  std::string_view text, bool add_bos);

// EncodePrompt's BOS step for ids encoded with add_bos = false (e.g. off the scheduler thread,
// before it is known whether the prompt starts a sequence).
void AddPromptBos(const Tokenizer& tokenizer, std::vector<int32_t>* ids);

// The most bytes of text one token stands for (its TokenBytes, or a special token's text): a
// text of N bytes needs at least N / MaxTokenBytes tokens, up to normalisation (SentencePiece
// may collapse whitespace runs; NFC may compose characters). One pass over the vocabulary.
size_t MaxTokenBytes(const Tokenizer& tokenizer);

// A prompt text longer than room_tokens x max_token_bytes x kPromptBytesSlack bytes, counting
// each run of whitespace as one byte (SentencePiece collapses them), cannot fit room_tokens (the
// slack covers normalisation that composes characters): INVALID_ARGUMENT saying so, so that a
// 10 MB prompt for a 4K-token model is refused in milliseconds instead of tokenized.
inline constexpr uint64_t kPromptBytesSlack = 4;
absl::Status CheckPromptTextFits(std::string_view text, int64_t room_tokens,
                                 size_t max_token_bytes);

// Token `id` on its own, as log-probability candidates report it (OpenAI's `token` and `bytes`).
struct TokenPiece {
  // The bytes the token contributes after other text (TokenBytes; SentencePiece "▁the" is
  // " the"), or a special token's text ("<|eot_id|>"). May be a partial UTF-8 character.
  std::string raw;
  std::string text;   // raw with each ill-formed UTF-8 sequence replaced by U+FFFD
};
// Out-of-range ids give two empty strings.
TokenPiece DescribeToken(const Tokenizer& tokenizer, int32_t id);

// Turns a stream of token ids into valid UTF-8 text deltas. Push returns the text that became
// complete: bytes of an unfinished UTF-8 sequence are held back until a later Push completes them;
// bytes that can never become valid are written as U+FFFD at once. Flush returns what is held back
// (as U+FFFD) and resets the pending bytes. `at_start`: true when the first pushed token starts the
// text (then the dummy-prefix space is dropped, as Decode does, when strips_leading_space());
// false when continuing after a prompt. Special tokens give "" when skip_special, else their text.
// The concatenation of all deltas plus Flush() equals Decode(ids) for at_start == true.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool at_start, bool skip_special = true);

  std::string Push(int32_t id);
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  bool strip_next_space_;  // a leading space is still to be dropped
  std::string pending_;    // bytes of an unfinished UTF-8 sequence, at most 3
};

}  // namespace tandem::gpu_worker
