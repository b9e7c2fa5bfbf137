#!/usr/bin/env python3
"""Simulates page-selection policies on a Llama checkpoint in PyTorch (a GPU host), to choose
which to build into tandem (issue 28). Not a test of tandem: a reference of the same semantics.

Teacher-forced perplexity of the first --tokens tokens of each book (no BOS), every layer's
attention replaced by what a hybrid step attends, for each query position t (chunk 1):
  device:    the sink tokens [0, sink) and the window [sink + o(t), t], where
             o(t) = floor((t + 1 - window - sink) / 16) * 16 offloaded entries (block eviction);
  offloaded: positions [sink, sink + o(t)), cut into pages of --page_tokens entries; a page is a
             candidate once all of its entries are offloaded.
Pages are chosen per (query, kv head) by Quest's bound (max over the GQA group of
sum_d max(q_d lo_d, q_d hi_d), post-RoPE keys) under a policy:
  uniform   the best budget/page_tokens pages of every kv head;
  mass      budget * num_kv_heads pages per (query, layer) shared across kv heads: a page's
            estimated share of its head's softmax mass, exp(scale * bound + log page_tokens -
            L), where L = logaddexp(logsumexp of the head's page terms, the window's exact
            LSE, max over the group); the best shares over all heads win (each head at most
            --mass_cap * budget tokens);
  :mix      half of the budget by the bound, the rest by q.mean among the others (tandem's
            default, PagePolicy::centroid_share 0.5); :mix:rerank names twice the pages that way
            and keeps the half of highest true mass (a node-side exact re-rank; not yet run);
  :oracle   pages by their true mass (the room any page score has);
  +rest     (suffix) the unselected candidate pages enter the softmax as estimates: page_tokens *
            exp(scale * q.mean_k + 0.5 * scale^2 * sum_d q_d^2 var_d) with value mean_v
            (var: 'exact' per-page variance, 'minmax' (hi - lo)^2 / 12, 'none').
Prints one JSON line per (config, length): perplexity and its ratio to full attention.

--policies: comma-separated, each `full`, `window` or
PAGE_TOKENS:BUDGET[:uniform|mass][:capF][:bound|centroid|oracle|mix][:rerank][:rest=KIND]
[:pcaR | :bpcaR (pages by the logsumexp of their keys' scores in a rank-R basis of the
first --pca_calib offloaded keys, Loki's idea; bpca: half by the bound, half that way)]
[:recentF (that share of the budget on the most recent pages)][:sN (N sinks)][:l0xS (layer 0
budget times S)]. On the GPU host, with the model and books copied into .carry/shared:
  python3 bench/selection_policy_sim.py --model .carry/shared/models/gutenberg-14m-64k \
      --books .carry/shared/data/gutenberg-eval --lengths 65536 --max_books 2 \
      --policies full,16:2048,16:2048:mix,16:2048:mix:rerank,16:2048:oracle
(--max_books counts books long enough for the length; about 10-20 s a policy at 64K.)
"""
import argparse
import json
import math
import os
import sys
import time

import torch
from safetensors.torch import load_file


def load_model(model_dir, device):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, name)))
    weights = {k: v.to(device=device, dtype=torch.float32) for k, v in weights.items()}
    return cfg, weights


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Policy:
    def __init__(self, label, budget=0, page_tokens=16, alloc="uniform", rest="", mass_cap=4.0,
                 window_only=False, full=False, l0_scale=1.0, score="bound", recent=0.0,
                 sink=None):
        self.label, self.budget, self.page_tokens = label, budget, page_tokens
        self.alloc, self.rest, self.mass_cap = alloc, rest, mass_cap
        self.window_only, self.full, self.l0_scale = window_only, full, l0_scale
        self.score, self.recent, self.sink = score, recent, sink
        self.rerank = False   # mix names 2x the pages; the best half by true mass is kept
        self.pca_rank = 0     # pca / bpca: scores from a rank-R projection of the keys


def parse_policy(spec):
    # full | window | P:BUDGET[:alloc][:rest=exact|minmax|none][:l0xS]
    if spec == "full":
        return Policy("full", full=True)
    if spec == "window":
        return Policy("window only", window_only=True)
    parts = spec.split(":")
    p = Policy(spec, budget=int(parts[1]), page_tokens=int(parts[0]))
    for part in parts[2:]:
        if part in ("uniform", "mass"):
            p.alloc = part
        elif part.startswith("cap"):
            p.mass_cap = float(part[3:])
        elif part.startswith("rest="):
            p.rest = part[5:]
        elif part in ("bound", "centroid", "oracle", "mix"):
            p.score = part
        elif part.startswith("bpca") or part.startswith("pca"):
            p.score = "bpca" if part.startswith("b") else "pca"
            p.pca_rank = int(part[len(p.score):])
        elif part == "rerank":
            p.rerank = True
        elif part.startswith("recent"):
            p.recent = float(part[6:])
        elif part.startswith("s") and part[1:].isdigit():
            p.sink = int(part[1:])
        elif part.startswith("l0x"):
            p.l0_scale = float(part[3:])
        else:
            raise ValueError(spec)
    return p


def pick(chosen, scores, k):
    """chosen | the k best of scores (-inf: never)."""
    if k <= 0:
        return chosen
    vals, idx = scores.topk(k, dim=-1)
    add = torch.zeros_like(chosen)
    add.scatter_(-1, idx, vals > float("-inf"))
    return chosen | add


def attention_layer(q, k, v, policy, layer, args, scale):
    """q [H, T, D], k/v [G, T, D] (post-RoPE) -> [H, T, D]."""
    H, T, D = q.shape
    G = k.shape[0]
    R = H // G
    sink = args.sink if policy.sink is None else policy.sink
    window = args.window
    out = torch.empty_like(q)
    pos = torch.arange(T, device=q.device)
    offl = torch.clamp((pos + 1 - window - sink) // 16 * 16, min=0)  # o(t)
    pt = policy.page_tokens
    n_pages = max(0, (T - sink) // pt)
    select_pages = 0
    if not (policy.full or policy.window_only) and n_pages > 0:
        budget = policy.budget * (policy.l0_scale if layer == 0 else 1.0)
        select_pages = max(1, int(budget) // pt)
        kp = k[:, sink:sink + n_pages * pt].reshape(G, n_pages, pt, D)
        vp = v[:, sink:sink + n_pages * pt].reshape(G, n_pages, pt, D)
        lo, hi = kp.amin(2), kp.amax(2)
        mean_k, mean_v = kp.mean(2), vp.mean(2)
        if policy.pca_rank > 0:
            # Loki's idea: keys live near a low-rank subspace. The basis is the top eigenvectors
            # of K^T K over the first --pca_calib offloaded keys (what a session has early), per
            # kv head; every offloaded key keeps its R coordinates ([G, T, R]).
            cal = k[:, sink:sink + min(args.pca_calib, n_pages * pt)]
            evals, evecs = torch.linalg.eigh(torch.einsum("gnd,gne->gde", cal, cal))
            basis = evecs[:, :, -policy.pca_rank:]                      # [G, D, R]
            k_low = torch.einsum("gtd,gdk->gtk", k[:, sink:sink + n_pages * pt], basis)
        if policy.rest == "exact":
            var_k = kp.var(2, unbiased=False)
        elif policy.rest == "minmax":
            var_k = (hi - lo).pow(2) / 12.0
        else:
            var_k = torch.zeros_like(mean_k)
    C = args.query_chunk
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        qc = q[:, c0:c1].reshape(G, R, c1 - c0, D)
        kc, vc = k[:, :c1], v[:, :c1]
        logits = torch.einsum("grcd,gsd->grcs", qc, kc) * scale   # [G, R, C, S]
        tq = pos[c0:c1][:, None]
        s = pos[:c1][None, :]
        causal = s <= tq
        if policy.full:
            mask = causal[None, None]
            logits = logits.masked_fill(~mask, float("-inf"))
            p = torch.softmax(logits, -1)
            out[:, c0:c1] = torch.einsum("grcs,gsd->grcd", p, vc).reshape(H, c1 - c0, D)
            continue
        o_t = offl[c0:c1][:, None]
        device_mask = causal & ((s < sink) | (s >= sink + o_t))   # [C, S]
        mask = device_mask[None, None].expand(G, R, -1, -1)
        rest_terms = None
        if select_pages > 0:
            valid = (torch.arange(n_pages, device=q.device)[None, :] + 1) * pt <= o_t  # [C, P]
            qpos, qneg = qc.clamp(min=0), qc.clamp(max=0)
            bound = (torch.einsum("grcd,gpd->grcp", qpos, hi) +
                     torch.einsum("grcd,gpd->grcp", qneg, lo)).amax(1)   # [G, C, P]
            if policy.score in ("centroid", "mix"):
                centroid = torch.einsum("grcd,gpd->grcp", qc, mean_k).amax(1)
            if policy.score in ("pca", "bpca"):
                # A page's estimated mass: logsumexp of its keys' low-rank scores, max over the
                # group, in units of q.k (as the bound).
                q_low = torch.einsum("grcd,gdk->grck", qc, basis)
                approx = torch.einsum("grck,gtk->grct", q_low, k_low) * scale
                low = approx.reshape(G, R, c1 - c0, n_pages, pt).logsumexp(-1).amax(1) / scale
            if policy.score == "pca":
                bound = low
            if policy.score == "centroid":
                bound = centroid
            elif policy.score == "oracle":
                # The page's true mass (max over the group), in units of the bound's q.k.
                span = logits[..., sink:min(c1, sink + n_pages * pt)]
                span = torch.nn.functional.pad(span, (0, n_pages * pt - span.shape[-1]),
                                               value=float("-inf"))
                bound = span.reshape(G, R, c1 - c0, n_pages, pt).logsumexp(-1).amax(1) / scale
            bound = bound.masked_fill(~valid[None], float("-inf"))
            if policy.score == "bpca":
                centroid = low   # the second half by the low-rank estimate
            if policy.score in ("mix", "bpca") or policy.recent > 0:
                # Half (mix) by bound, the rest by centroid; or the most recent pages first.
                # With rerank, twice the pages are named this way and the node's exact scores
                # of their keys keep the best half (the page's true mass, max over the group).
                kk = min(select_pages * (2 if policy.rerank else 1), n_pages)
                chosen = torch.zeros_like(bound, dtype=torch.bool)
                if policy.recent > 0:
                    n_recent = int(kk * policy.recent)
                    last = (o_t // pt).squeeze(-1)   # [C] candidate pages
                    rec = last[:, None] - 1 - torch.arange(n_recent, device=q.device)[None, :]
                    okr = rec >= 0
                    add = torch.zeros_like(chosen)
                    add.scatter_(-1, rec.clamp(min=0)[None].expand(G, -1, -1), okr[None].expand(G, -1, -1))
                    chosen |= add & valid[None]
                    rest_k = kk - n_recent
                    other = bound.masked_fill(chosen, float("-inf"))
                else:
                    rest_k = kk - kk // 2
                    chosen = pick(chosen, bound, kk // 2)
                    other = centroid.masked_fill(~valid[None] | chosen, float("-inf"))
                chosen = pick(chosen, other, rest_k)
                if policy.rerank:
                    span = logits[..., sink:min(c1, sink + n_pages * pt)]
                    span = torch.nn.functional.pad(span, (0, n_pages * pt - span.shape[-1]),
                                                   value=float("-inf"))
                    mass = span.reshape(G, R, c1 - c0, n_pages, pt).logsumexp(-1).amax(1)
                    mass = mass.masked_fill(~chosen, float("-inf"))
                    chosen = pick(torch.zeros_like(chosen), mass, min(select_pages, n_pages))
            elif policy.alloc == "uniform":
                kk = min(select_pages, n_pages)
                vals, idx = bound.topk(kk, dim=-1)
                chosen = torch.zeros_like(bound, dtype=torch.bool)
                chosen.scatter_(-1, idx, vals > float("-inf"))
            else:
                # Window LSE per (g, c): max over the group of each head's device-entry LSE.
                win = logits.masked_fill(~mask, float("-inf")).logsumexp(-1).amax(1)  # [G, C]
                terms = bound * scale + math.log(pt)
                off = terms.logsumexp(-1)   # [G, C]
                share = terms - torch.logaddexp(off, win)[..., None]
                cap = max(1, int(policy.mass_cap * budget) // pt)
                kk_head = min(cap, n_pages)
                vals, idx = share.topk(kk_head, dim=-1)    # [G, C, kk_head] best per head
                flat_vals = vals.permute(1, 0, 2).reshape(c1 - c0, G * kk_head)
                total = min(select_pages * G, G * kk_head)
                thr = flat_vals.topk(total, dim=-1).values[:, -1:]   # [C, 1]
                keep = (vals >= thr[None]) & (vals > float("-inf"))
                chosen = torch.zeros_like(bound, dtype=torch.bool)
                chosen.scatter_(-1, idx, keep)
            sel_tok = chosen.repeat_interleave(pt, dim=-1)   # [G, C, P*pt]
            full_sel = torch.zeros(G, c1 - c0, c1, dtype=torch.bool, device=q.device)
            width = min(n_pages * pt, max(0, c1 - sink))
            full_sel[:, :, sink:sink + width] = sel_tok[:, :, :width]
            mask = mask | full_sel[:, None]
            if policy.rest:
                unsel = valid[None] & ~chosen   # [G, C, P]
                est = torch.einsum("grcd,gpd->grcp", qc, mean_k) * scale + math.log(pt)
                if policy.rest != "none":
                    est = est + 0.5 * scale * scale * torch.einsum("grcd,gpd->grcp", qc * qc, var_k)
                est = est.masked_fill(~unsel[:, None], float("-inf"))
                rest_terms = est
        logits = logits.masked_fill(~mask, float("-inf"))
        if rest_terms is None:
            p = torch.softmax(logits, -1)
            out[:, c0:c1] = torch.einsum("grcs,gsd->grcd", p, vc).reshape(H, c1 - c0, D)
        else:
            m = torch.maximum(logits.amax(-1), rest_terms.amax(-1))[..., None]
            pa = torch.exp(logits - m)
            pr = torch.exp(rest_terms - m)
            num = torch.einsum("grcs,gsd->grcd", pa, vc) + torch.einsum("grcp,gpd->grcd", pr, mean_v)
            den = pa.sum(-1, keepdim=True) + pr.sum(-1, keepdim=True)
            out[:, c0:c1] = (num / den).reshape(H, c1 - c0, D)
    return out


def forward_nll(ids, cfg, w, policy, args):
    dev = ids.device
    T = ids.shape[0]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim", cfg["hidden_size"] // H)
    eps = cfg["rms_norm_eps"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D))
    ang = torch.arange(T, device=dev, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().float(), ang.sin().float()
    x = w["model.embed_tokens.weight"][ids]
    scale = 1.0 / math.sqrt(D)
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        h = rms_norm(x, w[pre + "input_layernorm.weight"], eps)
        q = (h @ w[pre + "self_attn.q_proj.weight"].T).view(T, H, D).transpose(0, 1)
        k = (h @ w[pre + "self_attn.k_proj.weight"].T).view(T, G, D).transpose(0, 1)
        v = (h @ w[pre + "self_attn.v_proj.weight"].T).view(T, G, D).transpose(0, 1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # The cache holds bf16 keys and values, as tandem's does.
        k = k.to(torch.bfloat16).float()
        v = v.to(torch.bfloat16).float()
        a = attention_layer(q.contiguous(), k.contiguous(), v.contiguous(), policy, layer, args, scale)
        x = x + a.transpose(0, 1).reshape(T, H * D) @ w[pre + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps)
        gate = h @ w[pre + "mlp.gate_proj.weight"].T
        up = h @ w[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    nll = 0.0
    for c0 in range(0, T - 1, 4096):
        c1 = min(T - 1, c0 + 4096)
        logits = x[c0:c1] @ head.T
        nll += torch.nn.functional.cross_entropy(logits, ids[c0 + 1:c1 + 1], reduction="sum").item()
    return nll, T - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--books", required=True)
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--max_books", type=int, default=3)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--query_chunk", type=int, default=512)
    ap.add_argument("--policies", default="full,window,16:512,16:2048")
    ap.add_argument("--pca_calib", type=int, default=4096,
                    help="offloaded keys whose K^T K gives the pca/bpca basis")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    cfg, w = load_model(args.model, dev)
    books = sorted(f for f in os.listdir(args.books) if f.endswith(".txt"))
    texts = [open(os.path.join(args.books, b), encoding="utf-8", errors="replace").read() for b in books]
    all_ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    policies = [parse_policy(s) for s in args.policies.split(",")]
    for length in [int(x) for x in args.lengths.split(",")]:
        chosen = [torch.tensor(i[:length], device=dev) for i in all_ids if len(i) >= length]
        chosen = chosen[:args.max_books]
        full_ppl = None
        for policy in policies:
            start = time.time()
            nll, n = 0.0, 0
            with torch.no_grad():
                for ids in chosen:
                    a, b = forward_nll(ids, cfg, w, policy, args)
                    nll += a
                    n += b
            ppl = math.exp(nll / n)
            if policy.full:
                full_ppl = ppl
            print(json.dumps({"length": length, "books": len(chosen), "policy": policy.label,
                              "ppl": round(ppl, 4),
                              "vs_full_pct": round(100 * (ppl / full_ppl - 1), 3) if full_ppl else None,
                              "seconds": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
