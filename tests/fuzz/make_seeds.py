#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into corpus/<target>/ (run from anywhere; needs
protoc). The seeds are small valid inputs (and a few near-misses) that reach past the first
checks, so libFuzzer starts from real requests and files. Re-running rewrites the same files."""
import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def encode(message, text, proto):
    """protobuf text format -> wire bytes, through protoc --encode."""
    return subprocess.run(
        ["protoc", "--encode=" + message, "-I", os.path.join(ROOT, "proto"),
         os.path.join(ROOT, "proto", "tandem", "v1", proto)],
        input=text.encode(), stdout=subprocess.PIPE, check=True).stdout


# --- safetensors: [u64 N][N bytes of JSON][data] ---
def safetensors(header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


write("safetensors_fuzzer", "two_tensors", safetensors(
    {"__metadata__": {"format": "pt"},
     "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "b": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [8, 12]}},
    struct.pack("<ff", 1.0, -2.0) + b"\x80\x3f\x00\x40"))
write("safetensors_fuzzer", "all_dtypes", safetensors(
    {"i": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
     "h": {"dtype": "F16", "shape": [2, 1], "data_offsets": [4, 8]},
     "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
     "scalar": {"dtype": "F32", "shape": [], "data_offsets": [8, 12]}},
    bytes(range(12))))
write("safetensors_fuzzer", "overlap", safetensors(
    {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)))

# --- config.json ---
base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16"}
write("model_config_fuzzer", "llama_plain", json.dumps(base))
write("model_config_fuzzer", "llama3_scaling", json.dumps(dict(base, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})))
write("model_config_fuzzer", "yarn_v5", json.dumps(dict(
    {k: v for k, v in base.items() if k != "rope_theta"}, model_type="qwen2",
    rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    use_sliding_window=False, sliding_window=4096)))
write("model_config_fuzzer", "mistral_dynamic", json.dumps(dict(
    base, model_type="mistral", head_dim=32, sliding_window=None,
    rope_scaling={"type": "dynamic", "factor": 2.0})))
write("model_config_fuzzer", "linear_tied", json.dumps(dict(
    base, tie_word_embeddings=True, attention_bias=True,
    rope_scaling={"rope_type": "linear", "factor": 2.0})))

# --- tokenizer.json (+ NUL + text) ---
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


b2u = bytes_to_unicode()
vocab = {b2u[b]: b for b in range(256)}
merges = []
for pair in [("t", "h"), ("th", "e"), ("Ġ", "th"), ("Ġth", "e"), ("a", "n"), ("an", "d"),
             ("Ġ", "a"), ("i", "n"), ("in", "g")]:
    vocab["".join(pair)] = len(vocab)
    merges.append(" ".join(pair))
added = [{"id": len(vocab), "content": "<|endoftext|>", "special": True, "lstrip": False,
          "rstrip": False, "normalized": False, "single_word": False},
         {"id": len(vocab) + 1, "content": "<tool>", "special": False, "lstrip": True,
          "rstrip": True, "normalized": False, "single_word": False}]
gpt2 = {"version": "1.0", "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges}}
text = "the and thing <|endoftext|> <tool> caf\u00e9 \U0001F600 12 34\n\n\xff".encode("utf-8") + b"\xc3"
write("tokenizer_json_fuzzer", "gpt2_bytes", json.dumps(gpt2).encode() + b"\0" + text)
llama3 = dict(gpt2)
llama3["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
llama3["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [], "special_tokens": {"<|endoftext|>": {
                                "id": "<|endoftext|>", "ids": [len(vocab)],
                                "tokens": ["<|endoftext|>"]}}}
llama3["model"] = dict(gpt2["model"], ignore_merges=True,
                       merges=[m.split(" ") for m in merges])
write("tokenizer_json_fuzzer", "llama3_split", json.dumps(llama3).encode() + b"\0" +
      b"I'll say the thing, 12345!\r\n  and\tthen")

# --- GenerateRequest ---
gen = "tandem.v1.GenerateRequest"
for name, text in [
        ("text_sampling", 'session_id: "chat-1" prompt_text: "Once upon a time" max_tokens: 32 '
                          'temperature: 0.7 top_p: 0.9 top_k: 40 stop: "\\n\\n" stop: "END" '
                          'seed: 7 logprobs: true top_logprobs: 3'),
        ("ids_hybrid", 'prompt_ids { ids: [1, 2, 3, 4000] } max_tokens: 8 mode: "hybrid" '
                       'beta: 0.5 window: 256 sink: 4 selection: "pages" select_tokens: 64 '
                       'dense_layers: 1 ignore_eos: true'),
        ("offload_maw", 'prompt_text: "x" max_tokens: 2048 mode: "offload" selection: "maw"'),
        ("bad_mode", 'prompt_text: "hi" max_tokens: 1 mode: "tpu"')]:
    write("generate_request_fuzzer", name, encode(gen, text, "generation.proto"))
write("generate_request_fuzzer", "bad_utf8",
      encode(gen, 'max_tokens: 4', "generation.proto") + b"\x12\x02\xc3\x28")

# --- CPU attention node requests: [base kind][method][message] ---
# Methods: 0 OpenSession, 1 AppendKv, 2 Attend, 3 Reselect, 4 ReshardSession, 5 ExportShard,
# 6 CloseSession. The base session "fuzz": 2 layers, H_q 4, H_kv 2, D 8, 20 entries per shard.
def f32(values):
    return "".join("\\x%02x" % b for b in struct.pack("<%df" % len(values), *values))


def node(name, kind, method, message, text):
    write("node_requests_fuzzer", name,
          bytes([kind, method]) + encode("tandem.v1." + message, text, "cpu_attention.proto"))


q = f32([0.1 * i for i in range(4 * 8)])
node("open_fork", 0, 0, "OpenSessionRequest",
     'session_id: "child" geometry { num_layers: 2 num_q_heads: 4 num_kv_heads: 2 head_dim: 8 } '
     'block_size: 16 kv_dtype: DTYPE_F32 beta: 0.5 fork_from { parent_session_id: "fuzz" '
     'prefix_tokens: 10 }')
node("open_pages", 2, 0, "OpenSessionRequest",
     'session_id: "p" geometry { num_layers: 1 num_q_heads: 2 num_kv_heads: 1 head_dim: 16 } '
     'kv_dtype: DTYPE_BF16 selection: SELECTION_PAGES page_tokens: 4 shards { layer: 0 kv_head: 0 }')
node("append", 0, 1, "AppendKvRequest",
     'session_id: "fuzz" layer: 1 kv_heads: 1 window_entries: 1 '
     'k { dtype: DTYPE_F32 shape: [1, 2, 8] data: "%s" } v { dtype: DTYPE_F32 shape: [1, 2, 8] '
     'data: "%s" } maw { dtype: DTYPE_F32 shape: [1, 2] data: "%s" }'
     % (f32([1.0] * 16), f32([0.5] * 16), f32([0.2, 3.0])))
node("append_selected", 0, 1, "AppendKvRequest",
     'session_id: "fuzz" layer: 0 kv_heads: 0 '
     'k { dtype: DTYPE_F32 shape: [1, 1, 8] data: "%s" } v { dtype: DTYPE_F32 shape: [1, 1, 8] '
     'data: "%s" } maw { dtype: DTYPE_F32 shape: [1, 1] data: "%s" } selected: "\\x01"'
     % (f32([1.0] * 8), f32([0.5] * 8), f32([0.0])))
node("attend", 0, 2, "AttendRequest",
     'layer: 0 queries { session_id: "fuzz" q { dtype: DTYPE_F32 shape: [1, 4, 8] data: "%s" } }'
     % q)
node("attend_bf16", 1, 2, "AttendRequest",
     'layer: 1 queries { session_id: "fuzz" q { dtype: DTYPE_F32 shape: [1, 4, 8] data: "%s" } }'
     % q)
node("attend_pages", 2, 2, "AttendRequest",
     'layer: 1 queries { session_id: "fuzz" q { dtype: DTYPE_F32 shape: [1, 4, 8] data: "%s" } '
     'pages_per_head: 2 pages: [0, 2, 1, 1] }' % q)
node("reselect", 0, 3, "ReselectRequest",
     'session_id: "fuzz" layer: 1 q { dtype: DTYPE_F32 shape: [1, 4, 8] data: "%s" } beta: 2.0'
     % q)
node("reshard", 0, 4, "ReshardSessionRequest",
     'session_id: "fuzz" drop { layer: 0 kv_head: 1 } add { layer: 1 kv_head: 1 }')
node("export", 1, 5, "ExportShardRequest",
     'session_id: "fuzz" shard { layer: 1 kv_head: 0 } from_entry: 3 to_entry: 17 '
     'max_chunk_entries: 5')
node("close", 0, 6, "CloseSessionRequest", 'session_id: "fuzz"')

# --- shm messages: [base kind][RequestHeader (64 bytes)][arrays] ---
def header(kind, layer, tokens, heads=0, window=0, payload=0, pages_per_head=0):
    return struct.pack("<7I9I", kind, layer, tokens, heads, window, payload, pages_per_head,
                       *([0] * 9))


def pad64(b):
    return b + bytes(-len(b) % 64)


qs = struct.pack("<32f", *[0.05 * i for i in range(32)])
write("shm_request_fuzzer", "attend", bytes([0]) + header(1, 0, 1) + qs)
write("shm_request_fuzzer", "attend_bf16", bytes([1]) + header(1, 1, 1) + qs)
write("shm_request_fuzzer", "attend_pages", bytes([2]) + pad64(header(1, 1, 1, pages_per_head=2)
                                                               + qs) + struct.pack("<4i", 0, 1, 2, 0))
# Append of 2 entries to kv head 1 of layer 0 (f32 rows of 32 bytes): heads | k | v | maw.
n = 2
append = pad64(header(2, 0, n, heads=1, window=1) + struct.pack("<I", 1))
append += pad64(struct.pack("<16f", *([0.25] * 16)))
append += pad64(struct.pack("<16f", *([0.5] * 16)))
append += struct.pack("<2f", 0.1, 4.0)
write("shm_request_fuzzer", "append", bytes([0]) + append)
# The same entries at a payload offset of 128 (the client's second half of the request area).
moved = pad64(header(2, 0, n, heads=1, window=1, payload=128)) + bytes(64) + struct.pack("<I", 1)
moved = pad64(moved) + pad64(struct.pack("<16f", *([0.25] * 16)))
moved += pad64(struct.pack("<16f", *([0.5] * 16))) + struct.pack("<2f", 0.1, 4.0)
write("shm_request_fuzzer", "append_offset", bytes([0]) + moved)
print("seeds written under", CORPUS, file=sys.stderr)
