// GPT-2's byte <-> unicode map, used by byte-level BPE (GPT-2, Llama-3, Qwen2): every byte is
// written as one printable character so that vocabularies and merges can be plain strings.
// Bytes 33..126, 161..172 and 174..255 stand for the code point of the same number; the other 68
// bytes (controls, space, DEL, NBSP, soft hyphen) map, in increasing order, to U+0100..U+0143
// (so space is "Ġ" U+0120 and '\n' is "Ċ" U+010A).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::gpu_worker::tokenizer_internal {

// The code point that stands for `byte`.
uint32_t ByteToCodepoint(uint8_t byte);

// The byte that code point `cp` stands for, or -1 when `cp` is not one of the 256 characters.
int CodepointToByte(uint32_t cp);

// Appends the characters (UTF-8) that stand for each byte of `bytes` to `dst`.
void ByteLevelEncode(std::string_view bytes, std::string* dst);

// The bytes a byte-level token stands for. Characters outside the map (as in added tokens) and
// ill-formed UTF-8 are kept as they are, as Hugging Face's ByteLevel decoder does.
std::string ByteLevelDecode(std::string_view token);

}  // namespace tandem::gpu_worker::tokenizer_internal
