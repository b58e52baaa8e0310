#!/usr/bin/env python3
"""Independent NumPy reference of the umT5 encoder Wan uses (float64 except the f32 bucket math).

Written from the architecture facts (T5 v1.1 encoder as in Wan's wan/modules/t5.py): T5 RMSNorm
(no mean, no bias, eps 1e-6), attention without 1/sqrt(d) scaling plus a per-layer bidirectional
relative-position bias, padded keys masked (logit replaced by a huge negative), gated FFN
fc2(fc1(h) * gelu_tanh(gate(h))), final norm. Padded ids are run through the full masked pass,
as upstream does; Wan's context is then the valid rows followed by zero rows up to text_len.

Usage: python3 t5_ref.py CASE_DIR   (reads config.json, weights.safetensors, inputs.safetensors;
                                      writes outputs.safetensors)
"""
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def bucket(rel, num_buckets, max_dist):
    """Bidirectional T5 bucket of rel = key - query; the log part in float32 like upstream."""
    half = num_buckets // 2
    out = np.where(rel > 0, half, 0)
    r = np.abs(rel)
    exact = half // 2
    with np.errstate(divide="ignore"):
        big = (np.log(r.astype(np.float32) / np.float32(exact))
               / np.float32(math.log(max_dist / exact)) * np.float32(half - exact))
    big = exact + np.where(np.isfinite(big), big, 0).astype(np.int64)
    big = np.minimum(big, half - 1)
    return out + np.where(r < exact, r, big)


def block(W, p, x, mask_len, cfg):
    g = lambda n: W[f"{p}.{n}"].astype(np.float64)
    L = x.shape[0]
    H = cfg["num_heads"]
    d = cfg["dim_attn"] // H
    h = rms(x, g("norm1.weight"), cfg["eps"])
    q = (h @ g("attn.q.weight").T).reshape(L, H, d)
    k = (h @ g("attn.k.weight").T).reshape(L, H, d)
    v = (h @ g("attn.v.weight").T).reshape(L, H, d)
    pos = np.arange(L)
    rel = pos[None, :] - pos[:, None]
    table = g("pos_embedding.embedding.weight")  # [buckets, heads]
    bias = table[bucket(rel, cfg["num_buckets"], cfg["max_dist"])].transpose(2, 0, 1)  # [H,L,L]
    logits = np.einsum("ihc,jhc->hij", q, k) + bias
    logits[:, :, mask_len:] = -1e300
    logits -= logits.max(-1, keepdims=True)
    a = np.exp(logits)
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hij,jhc->ihc", a, v).reshape(L, H * d)
    x = x + o @ g("attn.o.weight").T
    h = rms(x, g("norm2.weight"), cfg["eps"])
    f = (h @ g("ffn.fc1.weight").T) * gelu_tanh(h @ g("ffn.gate.0.weight").T)
    return x + f @ g("ffn.fc2.weight").T


def encoder(W, ids, mask_len, cfg):
    x = W["token_embedding.weight"].astype(np.float64)[ids]
    for i in range(cfg["num_layers"]):
        x = block(W, f"blocks.{i}", x, mask_len, cfg)
    return rms(x, W["norm.weight"].astype(np.float64), cfg["eps"])


def main(case_dir):
    cfg = json.load(open(f"{case_dir}/config.json"))
    W = load_file(f"{case_dir}/weights.safetensors")
    I = load_file(f"{case_dir}/inputs.safetensors")
    out = {}
    if cfg["case"] == "block":
        out["block"] = block(W, cfg["prefix"], I["x"].astype(np.float64), cfg["mask_len"], cfg)
    elif cfg["case"] == "encoder":
        ids = I["ids"].astype(np.int64)
        m = cfg["mask_len"]
        hidden = encoder(W, ids, m, cfg)
        ctx = np.zeros((cfg["text_len"], cfg["dim"]))
        ctx[:m] = hidden[:m]
        out["hidden"] = hidden
        out["context"] = ctx
    else:
        raise SystemExit(f"unknown case {cfg['case']}")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              f"{case_dir}/outputs.safetensors")


if __name__ == "__main__":
    main(sys.argv[1])
