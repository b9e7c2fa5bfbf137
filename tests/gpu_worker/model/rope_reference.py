#!/usr/bin/env python3
"""Tiny Llama-family models with long-context RoPE scalings, and reference forwards of them.

  rope_reference.py write-models DIR     # plain Python: DIR/<name>/{config.json,
                                         #   model.safetensors,prompt.json}
  rope_reference.py reference DIR OUT    # PyTorch + transformers: OUT/<name>.json (copied to
                                         #   DIR/<name>/reference.json), OUT/transformers_src.txt
  rope_reference.py python-reference DIR # plain Python (f64): DIR/<name>/python_reference.json

The checked-in fixtures (tests/gpu_worker/model/rope_fixtures/) are these outputs;
rope_reference_test.cc runs tandem's forward on the same weights and compares with both.
python-reference first checks its own rope tables and logits against reference.json
(transformers) and stops if they differ, so it is transformers' semantics on a second prompt.
The checked-in reference.json files were made by `reference` with transformers 5.17 on the GPU
host (scripts/gpu_host_gateway.sh, part rope) from the random prompts in prompt.json.

Models (f32, 2 layers, hidden 32, head_dim 16, prompts of 100 tokens > 64 original positions):
  qwen2_yarn     Qwen2.5-style: rope_scaling {type yarn, factor 4, original 64}, max 64,
                 q/k/v biases, tied embeddings, use_sliding_window false with sliding_window 32
                 (must be ignored: full attention)
  llama_yarn     DeepSeek-style yarn knobs: max 256, original 64, factor 4, beta_fast 16,
                 beta_slow 2, mscale 1.0 / mscale_all_dim 0.5 (attention factor from their ratio),
                 truncate false
  mistral_dynamic  {type dynamic, factor 2}, max 64, sliding_window null
  qwen3_yarn     Qwen3-style: RMSNorm of every q and k head (q_norm / k_norm, [head_dim]) before
                 RoPE, no biases, tied embeddings, yarn factor 4 over 64 original positions (the
                 Qwen3 model cards' long-context recipe)

Each reference holds the prompt ids and runs:
  "single":  one forward of the whole prompt (no cache): log p(prompt[t+1] | prompt[..t]) for
             every t < L-1 and the last position's logits.
  "chunked": the prompt fed with a cache in chunks CHUNKS (the per-forward semantics of
             transformers' generate(): dynamic NTK recomputes inv_freq from each forward's max
             position + 1; cached keys keep their rotation); same outputs.
  "chunked_b" (python-reference): the same in chunks CHUNKS_B, for a second sequence batched
             beside the first in tandem's test.
"""
import json
import math
import os
import random
import struct
import sys
import traceback

HIDDEN = 32
FFN = 64
LAYERS = 2
Q_HEADS = 2
KV_HEADS = 1
HEAD_DIM = 16
VOCAB = 64
PROMPT_LEN = 100
CHUNKS = [48, 32] + [1] * 20  # the prompt again: 48 (< 64), 32 (crossing 64), then decode steps
CHUNKS_B = [70, 30]  # python-reference only: another sequence batched beside CHUNKS' first two
QK_STD = 0.3  # q/k projections: sharp attention, so RoPE errors show in the logits

MODELS = {
    "qwen2_yarn": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "max_position_embeddings": 64,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32,
        "max_window_layers": 2,
    },
    "llama_yarn": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 16.0,
                         "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                         "truncate": False},
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "mistral_dynamic": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "qwen3_yarn": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": 64,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
}


assert sum(CHUNKS) == PROMPT_LEN and sum(CHUNKS_B) == PROMPT_LEN


def config_json(name):
    c = {
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": Q_HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    c.update(MODELS[name])
    return c


def tensor_shapes(config):
    """(name, shape, std) of every weight in the Hugging Face layout; std 0 marks a norm (1 + noise)."""
    h, d = HIDDEN, HEAD_DIM
    qd, kd = Q_HEADS * d, KV_HEADS * d
    out = [("model.embed_tokens.weight", [VOCAB, h], 1.0), ("model.norm.weight", [h], 0.0)]
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", [VOCAB, h], 1.0 / math.sqrt(h)))
    bias = config["model_type"] == "qwen2"
    qk_norm = config["model_type"] == "qwen3"
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        out.append((p + "input_layernorm.weight", [h], 0.0))
        out.append((p + "self_attn.q_proj.weight", [qd, h], QK_STD))
        out.append((p + "self_attn.k_proj.weight", [kd, h], QK_STD))
        out.append((p + "self_attn.v_proj.weight", [kd, h], 1.0 / math.sqrt(h)))
        if bias:
            out.append((p + "self_attn.q_proj.bias", [qd], 0.5))
            out.append((p + "self_attn.k_proj.bias", [kd], 0.5))
            out.append((p + "self_attn.v_proj.bias", [kd], 0.5))
        if qk_norm:
            out.append((p + "self_attn.q_norm.weight", [d], 0.0))
            out.append((p + "self_attn.k_norm.weight", [d], 0.0))
        out.append((p + "self_attn.o_proj.weight", [h, qd], 1.0 / math.sqrt(qd)))
        out.append((p + "post_attention_layernorm.weight", [h], 0.0))
        out.append((p + "mlp.gate_proj.weight", [FFN, h], 1.0 / math.sqrt(h)))
        out.append((p + "mlp.up_proj.weight", [FFN, h], 1.0 / math.sqrt(h)))
        out.append((p + "mlp.down_proj.weight", [h, FFN], 1.0 / math.sqrt(FFN)))
    return out


def write_safetensors(path, tensors):
    """tensors: list of (name, shape, list of floats) written as F32."""
    header, blobs, offset = {}, [], 0
    for name, shape, values in tensors:
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for blob in blobs:
            f.write(blob)


def write_models(root):
    for index, name in enumerate(MODELS):
        rng = random.Random(1000 + index)
        config = config_json(name)
        tensors = []
        for tname, shape, std in tensor_shapes(config):
            n = math.prod(shape)
            if std == 0.0:
                values = [1.0 + rng.gauss(0.0, 0.1) for _ in range(n)]
            else:
                values = [rng.gauss(0.0, std) for _ in range(n)]
            tensors.append((tname, shape, values))
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(d, "model.safetensors"), tensors)
        prompt_rng = random.Random(2000 + index)
        prompt = [prompt_rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
        with open(os.path.join(d, "prompt.json"), "w") as f:
            json.dump(prompt, f)
            f.write("\n")


def rounded(values):
    return [float(f"{v:.9g}") for v in values]  # round-trips f32


def reference(root, out):
    import inspect

    import torch
    import transformers

    torch.manual_seed(0)
    with open(os.path.join(out, "transformers_src.txt"), "w") as src:
        src.write(f"transformers {transformers.__version__} torch {torch.__version__}\n")
        import transformers.modeling_rope_utils as ru
        from transformers.models.llama import modeling_llama
        from transformers.models.qwen2 import configuration_qwen2
        from transformers.models.mistral import configuration_mistral
        from transformers.models.qwen3 import modeling_qwen3
        for owner, attr in ((ru, "_compute_yarn_parameters"),
                            (ru, "_compute_dynamic_ntk_parameters"), (ru, "dynamic_rope_update"),
                            (ru, "RotaryEmbeddingConfigMixin"), (ru, "standardize_rope_params"),
                            (modeling_llama, "LlamaRotaryEmbedding"),
                            (configuration_qwen2, "Qwen2Config"),
                            (configuration_mistral, "MistralConfig"),
                            (modeling_qwen3, "Qwen3Attention")):
            try:
                src.write(f"# ---- {attr}\n{inspect.getsource(getattr(owner, attr))}\n")
            except (AttributeError, TypeError, OSError) as e:
                src.write(f"# ---- {attr}: {e!r}\n")

    for name in MODELS:
        try:
            reference_one(root, out, name)
        except Exception:  # report and go on: one call of the GPU host covers every model
            traceback.print_exc()


def reference_one(root, out, name):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    d = os.path.join(root, name)
    with open(os.path.join(d, "prompt.json")) as f:
        prompt = json.load(f)
    ids = torch.tensor([prompt], dtype=torch.long)
    result = {"model": name, "transformers": transformers.__version__, "prompt": prompt,
              "chunks": CHUNKS}

    def load():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                     attn_implementation="eager")
        return model.eval()

    def summarize(logits):
        logp = torch.log_softmax(logits.double(), dim=-1)
        target_logp = [logp[t, prompt[t + 1]].item() for t in range(len(prompt) - 1)]
        return {"target_logprobs": rounded(target_logp),
                "last_logits": rounded(logits[-1].tolist())}

    with torch.no_grad():
        model = load()  # fresh: dynamic NTK keeps state between forwards
        result["rope"] = {
            "inv_freq_init": rounded(model.model.rotary_emb.inv_freq.tolist()),
            "attention_scaling": getattr(model.model.rotary_emb, "attention_scaling", None),
        }
        logits = model(ids).logits[0]
        result["rope"]["inv_freq_after_single"] = rounded(
            model.model.rotary_emb.inv_freq.tolist())
        result["single"] = summarize(logits)

        model = load()
        cache, parts, start = None, [], 0
        for n in CHUNKS:
            step = model(ids[:, start:start + n], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            parts.append(step.logits[0])
            start += n
        result["chunked"] = summarize(torch.cat(parts, dim=0))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(name, "ok", flush=True)


# ---- A plain-Python (f64) forward of the same models, for machines without PyTorch. ----------
# It follows transformers 5 (modeling_llama / modeling_qwen2 / modeling_mistral / modeling_qwen3 with eager
# attention, modeling_rope_utils for the rope tables); `python-reference` checks its rope tables
# and its logits against the transformers reference.json of each model before writing anything.


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        values = list(struct.unpack(f"<{(end - begin) // 4}f", data[begin:end]))
        shape = t["shape"]
        out[name] = values if len(shape) == 1 else [
            values[r * shape[1]:(r + 1) * shape[1]] for r in range(shape[0])]
    return out


def rope_tables(config, seq_len):
    """(inv_freq, attention_scaling) as transformers 5 computes them (f64 here)."""
    rs = config.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    base, dim = config["rope_theta"], config["head_dim"]
    max_pos = config["max_position_embeddings"]
    plain = lambda b: [1.0 / b ** (i / dim) for i in range(0, dim, 2)]
    if kind == "default":
        return plain(base), 1.0
    if kind == "dynamic":
        factor = rs["factor"]
        seq_len = max(seq_len, max_pos)
        b = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return plain(b), 1.0
    assert kind == "yarn", kind
    factor = rs["factor"]
    original = rs.get("original_max_position_embeddings") or max_pos
    mscale = lambda scale, m=1: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = rs.get("attention_factor")
    if attention is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attention = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    corr = lambda rot: (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = corr(beta_fast), corr(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for j, i in enumerate(range(0, dim, 2)):
        pos_freq = base ** (i / dim)
        extrapolation_factor = 1 - min(max((j - low) / (high - low), 0.0), 1.0)
        inv.append((1.0 / (factor * pos_freq)) * (1 - extrapolation_factor)
                   + (1.0 / pos_freq) * extrapolation_factor)
    return inv, attention


class PyModel:
    def __init__(self, d):
        with open(os.path.join(d, "config.json")) as f:
            self.c = json.load(f)
        self.w = read_safetensors(os.path.join(d, "model.safetensors"))

    @staticmethod
    def matvec(m, x, bias=None):
        out = [sum(a * b for a, b in zip(row, x)) for row in m]
        return [o + b for o, b in zip(out, bias)] if bias else out

    def norm(self, x, w):
        inv = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + self.c["rms_norm_eps"])
        return [v * inv * g for v, g in zip(x, w)]

    def rope(self, x, pos, inv_freq, scale):
        half = len(x) // 2
        out = list(x)
        for i in range(half):
            c, s = math.cos(pos * inv_freq[i]) * scale, math.sin(pos * inv_freq[i]) * scale
            out[i] = x[i] * c - x[i + half] * s
            out[i + half] = x[i + half] * c + x[i] * s
        return out

    def forward(self, ids, cache):
        """Feeds ids at the next positions; cache: per layer [(k_heads, v_heads)] per position
        (post-RoPE keys). Returns the logits of every fed token."""
        c, w = self.c, self.w
        D, Hq, Hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        start = len(cache[0])
        inv_freq, scale = rope_tables(c, start + len(ids))  # this forward's max position + 1
        xs = [list(w["model.embed_tokens.weight"][t]) for t in ids]
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            bias = lambda n: w.get(p + f"self_attn.{n}_proj.bias")
            new = []
            for t, x in enumerate(xs):
                h = self.norm(x, w[p + "input_layernorm.weight"])
                q = self.matvec(w[p + "self_attn.q_proj.weight"], h, bias("q"))
                k = self.matvec(w[p + "self_attn.k_proj.weight"], h, bias("k"))
                v = self.matvec(w[p + "self_attn.v_proj.weight"], h, bias("v"))
                pos = start + t
                q = [q[hd * D:(hd + 1) * D] for hd in range(Hq)]
                k = [k[hd * D:(hd + 1) * D] for hd in range(Hkv)]
                if p + "self_attn.q_norm.weight" in w:  # qwen3: each head normed before RoPE
                    q = [self.norm(x, w[p + "self_attn.q_norm.weight"]) for x in q]
                    k = [self.norm(x, w[p + "self_attn.k_norm.weight"]) for x in k]
                q = [self.rope(x, pos, inv_freq, scale) for x in q]
                k = [self.rope(x, pos, inv_freq, scale) for x in k]
                v = [v[hd * D:(hd + 1) * D] for hd in range(Hkv)]
                new.append((q, k, v))
            for q, k, v in new:
                cache[l].append((k, v))
            for t, (q, _, _) in enumerate(new):
                keys = cache[l][:start + t + 1]
                attn = []
                for hd in range(Hq):
                    g = hd // (Hq // Hkv)
                    scores = [sum(a * b for a, b in zip(q[hd], kv[0][g])) / math.sqrt(D)
                              for kv in keys]
                    m = max(scores)
                    e = [math.exp(sc - m) for sc in scores]
                    z = sum(e)
                    attn += [sum(e[j] * keys[j][1][g][i] for j in range(len(keys))) / z
                             for i in range(D)]
                o = self.matvec(w[p + "self_attn.o_proj.weight"], attn)
                x = [a + b for a, b in zip(xs[t], o)]
                h = self.norm(x, w[p + "post_attention_layernorm.weight"])
                gate = self.matvec(w[p + "mlp.gate_proj.weight"], h)
                up = self.matvec(w[p + "mlp.up_proj.weight"], h)
                act = [gv / (1 + math.exp(-gv)) * uv for gv, uv in zip(gate, up)]
                down = self.matvec(w[p + "mlp.down_proj.weight"], act)
                xs[t] = [a + b for a, b in zip(x, down)]
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return [self.matvec(head, self.norm(x, w["model.norm.weight"])) for x in xs]

    def run(self, prompt, chunks):
        cache = [[] for _ in range(self.c["num_hidden_layers"])]
        logits, start = [], 0
        for n in chunks:
            logits += self.forward(prompt[start:start + n], cache)
            start += n
        return logits


def summarize_plain(prompt, logits):
    targets = []
    for t in range(len(prompt) - 1):
        m = max(logits[t])
        lse = m + math.log(sum(math.exp(v - m) for v in logits[t]))
        targets.append(logits[t][prompt[t + 1]] - lse)
    return {"target_logprobs": rounded(targets), "last_logits": rounded(logits[-1])}


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def python_reference(root):
    for name in MODELS:
        d = os.path.join(root, name)
        model = PyModel(d)
        with open(os.path.join(d, "reference.json")) as f:
            hf = json.load(f)
        # Its rope tables against transformers'.
        inv, scale = rope_tables(model.c, 0)
        assert max_diff(inv, hf["rope"]["inv_freq_init"]) < 1e-6, name
        assert abs(scale - hf["rope"]["attention_scaling"]) < 1e-9, name
        inv, _ = rope_tables(model.c, len(hf["prompt"]))
        assert max_diff(inv, hf["rope"]["inv_freq_after_single"]) < 1e-6, name
        # Its forward against transformers' logits on transformers' prompt.
        got = summarize_plain(hf["prompt"], model.run(hf["prompt"], [len(hf["prompt"])]))
        for key in ("target_logprobs", "last_logits"):
            diff = max_diff(got[key], hf["single"][key])
            assert diff < 1e-4, (name, key, diff)
        with open(os.path.join(d, "prompt.json")) as f:
            prompt = json.load(f)
        result = {"model": name, "reference": "rope_reference.py python-reference (f64)",
                  "prompt": prompt, "chunks": CHUNKS,
                  "single": summarize_plain(prompt, model.run(prompt, [len(prompt)])),
                  "chunked": summarize_plain(prompt, model.run(prompt, CHUNKS)),
                  "chunks_b": CHUNKS_B,
                  "chunked_b": summarize_plain(prompt, model.run(prompt, CHUNKS_B))}
        with open(os.path.join(d, "python_reference.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(name, "ok", flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "write-models":
        write_models(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "python-reference":
        python_reference(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "reference":
        reference(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
