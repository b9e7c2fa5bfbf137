#!/usr/bin/env python3
"""Times torch.nn.functional.scaled_dot_product_attention for the prefill cases of
tandem-kernel-bench (bench/kernel_bench.cc), so run_kernel_bench.sh can print their ratio.

Shapes: q [1, Hq, T, D], k/v [1, Hkv, P + T, D], bf16, GQA. A chunk of T new tokens at
positions [P, P + T) sees keys [0, P + t]: is_causal when P = 0, the bottom-right causal mask
(torch.nn.attention.bias.causal_lower_right) otherwise, or an explicit boolean mask where that
is refused. GQA goes through enable_gqa=True, or K/V repeated per query head where a backend
refuses it. Every SDPA backend torch offers is tried (default choice, flash, efficient, cudnn);
each prints one JSON line with its median time over repetitions timed by torch.cuda.Event pairs,
and TFLOPS = 4·Hq·D·(visible (query, key) pairs) / time, the formula tandem-kernel-bench uses.

  python3 bench/sdpa_reference.py [--cases 2048:0,2048:8192] [--seconds 0.3]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def lower_right_bias(t, s):
    try:
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(t, s)
    except Exception:  # older torch
        return None


def make_call(q, k, v, prefix, enable_gqa, mask_kind):
    t, s = q.shape[2], k.shape[2]
    if not enable_gqa:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    if prefix == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    if mask_kind == "lower_right":
        bias = lower_right_bias(t, s)
        if bias is None:
            raise RuntimeError("no causal_lower_right")
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **kwargs)
    rows = torch.arange(t, device=q.device)[:, None]
    cols = torch.arange(s, device=q.device)[None, :]
    mask = cols <= rows + prefix
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def time_median(fn, target_seconds, max_reps):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(stop) * 1e-3
    reps = int(min(max(target_seconds / max(once, 1e-6), 5), max_reps))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda._sleep(int(2e6))  # keeps the device busy while every repetition is queued
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e-3 for a, b in events), reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases",
                        default="2048:0,2048:8192,2048:32768,4096:0,16384:0,16384:16384")
    parser.add_argument("--q_heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--max_reps", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda")
    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    print(json.dumps({"bench": "sdpa_env", "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(0)}), flush=True)
    for spec in args.cases.split(","):
        chunk, prefix = (int(x) for x in spec.split(":"))
        s = prefix + chunk
        gen = torch.Generator(device=dev).manual_seed(chunk * 7 + prefix)
        q = torch.rand(1, args.q_heads, chunk, args.head_dim, device=dev, generator=gen,
                       dtype=torch.float32).mul_(2).sub_(1).to(torch.bfloat16)
        k = torch.rand(1, args.kv_heads, s, args.head_dim, device=dev, generator=gen,
                       dtype=torch.float32).mul_(2).sub_(1).to(torch.bfloat16)
        v = torch.rand_like(k, dtype=torch.float32).mul_(2).sub_(1).to(torch.bfloat16)
        pairs = chunk * prefix + chunk * (chunk + 1) / 2
        flops = 4.0 * pairs * args.q_heads * args.head_dim
        for name, backend in backends:
            result = None
            errors = []
            for enable_gqa in (True, False):
                for mask_kind in (("lower_right", "explicit") if prefix else ("causal",)):
                    try:
                        fn = make_call(q, k, v, prefix, enable_gqa, mask_kind)
                        if backend is None:
                            seconds, reps = time_median(fn, args.seconds, args.max_reps)
                        else:
                            with sdpa_kernel([backend]):
                                seconds, reps = time_median(fn, args.seconds, args.max_reps)
                        result = {"bench": "sdpa", "backend": name, "chunk": chunk,
                                  "prefix": prefix, "ms": seconds * 1e3,
                                  "tflops": flops / seconds / 1e12, "gqa": "enable_gqa"
                                  if enable_gqa else "repeat_kv", "mask": mask_kind,
                                  "reps": reps}
                        break
                    except Exception as e:  # a backend that refuses this shape or mask
                        errors.append(f"{'gqa' if enable_gqa else 'repeat'}/{mask_kind}: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                        torch.cuda.synchronize()
                if result:
                    break
            if result is None:
                result = {"bench": "sdpa", "backend": name, "chunk": chunk, "prefix": prefix,
                          "error": errors}
            print(json.dumps(result), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
