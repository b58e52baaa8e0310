#!/usr/bin/env python3
"""Independent NumPy reference of the Wan2.1 VAE (float64, whole sequences, no caches).

Written from the architecture facts (research/lingbot_wan_arch.md section 2.1 and the layer list
in pipeline/src/vae), not from the Rust code: every causal operation is computed over the whole
video at once with explicit zero padding, so it checks the Rust feature caches as well as the math.
Tensors are [C, T, H, W].

Usage: python3 wan_vae_ref.py CASE_DIR   (reads config.json, weights.safetensors,
                                           inputs.safetensors; writes outputs.safetensors)
       python3 wan_vae_ref.py --selftest
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


# ---------------------------------------------------------------- ops
def conv3d(x, w, b, stride=(1, 1, 1), pad=((0, 0), (0, 0), (0, 0))):
    """Plain Conv3d: zero-pad, then sum over kernel taps (one tensor contraction per tap)."""
    xp = np.pad(x, ((0, 0),) + tuple(pad))
    O, C, kt, kh, kw = w.shape
    To = (xp.shape[1] - kt) // stride[0] + 1
    Ho = (xp.shape[2] - kh) // stride[1] + 1
    Wo = (xp.shape[3] - kw) // stride[2] + 1
    out = np.zeros((O, To, Ho, Wo))
    for a in range(kt):
        for c in range(kh):
            for e in range(kw):
                patch = xp[:, a:a + stride[0] * (To - 1) + 1:stride[0],
                           c:c + stride[1] * (Ho - 1) + 1:stride[1],
                           e:e + stride[2] * (Wo - 1) + 1:stride[2]]
                out += np.einsum("oc,cthw->othw", w[:, :, a, c, e], patch)
    return out + b.reshape(-1, 1, 1, 1)


def causal_conv(W, name, x):
    # Time: all context from the past (kt - 1 zero frames before the video); space: symmetric.
    w = W[name + ".weight"]
    kt, kh, kw = w.shape[2:]
    pad = ((kt - 1, 0), ((kh - 1) // 2, (kh - 1) // 2), ((kw - 1) // 2, (kw - 1) // 2))
    return conv3d(x, w, W[name + ".bias"], pad=pad)


def frame_conv(W, name, x, stride=1, pad=(1, 1)):
    # A Conv2d applied to every frame: weight [O, C, kh, kw].
    w = W[name + ".weight"][:, :, None]
    return conv3d(x, w, W[name + ".bias"], (1, stride, stride), ((0, 0), pad, pad))


def rms(W, name, x):
    # Unit L2 norm over channels (floored at 1e-12), times sqrt(C) and the gain.
    g = W[name + ".gamma"].reshape(-1, 1, 1, 1)
    n = np.sqrt((x ** 2).sum(0, keepdims=True))
    return x / np.maximum(n, 1e-12) * np.sqrt(x.shape[0]) * g


def silu(x):
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------- blocks
def res_block(W, p, x):
    h = causal_conv(W, p + ".shortcut", x) if p + ".shortcut.weight" in W else x
    r = causal_conv(W, p + ".residual.2", silu(rms(W, p + ".residual.0", x)))
    r = causal_conv(W, p + ".residual.6", silu(rms(W, p + ".residual.3", r)))
    return r + h


def attn_block(W, p, x):
    C, T, H, Wd = x.shape
    xn = rms(W, p + ".norm", x)
    wqkv, bqkv = W[p + ".to_qkv.weight"][:, :, 0, 0], W[p + ".to_qkv.bias"]
    wp, bp = W[p + ".proj.weight"][:, :, 0, 0], W[p + ".proj.bias"]
    out = np.empty_like(x)
    for t in range(T):
        tok = xn[:, t].reshape(C, -1).T  # [HW, C]
        qkv = tok @ wqkv.T + bqkv
        q, k, v = qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:]
        s = q @ k.T / np.sqrt(C)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v) @ wp.T + bp
        out[:, t] = o.T.reshape(C, H, Wd)
    return out + x


def up2(x):
    return x.repeat(2, axis=2).repeat(2, axis=3)


def upsample(W, p, x, temporal):
    if temporal:
        # Frame 0 alone; frames 1.. through a causal (3,1,1) conv to 2C channels, whose halves are
        # the two output frames of each input frame.
        C = x.shape[0]
        frames = [x[:, :1]]
        if x.shape[1] > 1:
            y = causal_conv(W, p + ".time_conv", x[:, 1:])
            for i in range(y.shape[1]):
                frames += [y[:C, i:i + 1], y[C:, i:i + 1]]
        x = np.concatenate(frames, axis=1)
    return frame_conv(W, p + ".resample.1", up2(x))


def downsample(W, p, x, temporal):
    x = frame_conv(W, p + ".resample.1", x, stride=2, pad=(0, 1))
    if temporal:
        # Frame 0 alone, then (3,1,1) windows with stride 2 starting at frame 0.
        w, b = W[p + ".time_conv.weight"], W[p + ".time_conv.bias"]
        rest = conv3d(x, w, b, stride=(2, 1, 1)) if x.shape[1] >= 3 else x[:, :0]
        x = np.concatenate([x[:, :1], rest], axis=1)
    return x


def head(W, p, x):
    return causal_conv(W, p + ".2", silu(rms(W, p + ".0", x)))


def middle(W, p, x):
    x = res_block(W, p + ".0", x)
    x = attn_block(W, p + ".1", x)
    return res_block(W, p + ".2", x)


# ---------------------------------------------------------------- the two halves
def decoder_layers(cfg):
    """[(index, kind, temporal)] of decoder.upsamples: per stage num_res_blocks + 1 residual
    blocks, then an upsampler except after the last stage; temporal flags reversed."""
    out, n = [], len(cfg["dim_mult"])
    temporal = cfg["temporal_downsample"][::-1]
    for i in range(n):
        for _ in range(cfg["num_res_blocks"] + 1):
            out.append((len(out), "res", None))
        if i < n - 1:
            out.append((len(out), "up", temporal[i]))
    return out


def decode(W, cfg, z, stop_after=None):
    mean = np.array(cfg["latent_mean"]).reshape(-1, 1, 1, 1)
    std = np.array(cfg["latent_std"]).reshape(-1, 1, 1, 1)
    x = causal_conv(W, "conv2", z * std + mean)
    x = causal_conv(W, "decoder.conv1", x)
    x = middle(W, "decoder.middle", x)
    for i, kind, temporal in decoder_layers(cfg):
        p = f"decoder.upsamples.{i}"
        x = res_block(W, p, x) if kind == "res" else upsample(W, p, x, temporal)
        if stop_after is not None and i == stop_after:
            return x
    return np.clip(head(W, "decoder.head", x), -1.0, 1.0)


def encode(W, cfg, video):
    n = len(cfg["dim_mult"])
    x = causal_conv(W, "encoder.conv1", video)
    idx = 0
    for i in range(n):
        for _ in range(cfg["num_res_blocks"]):
            x = res_block(W, f"encoder.downsamples.{idx}", x)
            idx += 1
        if i < n - 1:
            x = downsample(W, f"encoder.downsamples.{idx}", x, cfg["temporal_downsample"][i])
            idx += 1
    x = middle(W, "encoder.middle", x)
    x = causal_conv(W, "conv1", head(W, "encoder.head", x))
    mu = x[:cfg["z_dim"]]
    mean = np.array(cfg["latent_mean"]).reshape(-1, 1, 1, 1)
    std = np.array(cfg["latent_std"]).reshape(-1, 1, 1, 1)
    return (mu - mean) / std


# ---------------------------------------------------------------- cases
def run_case(d):
    cfg = json.load(open(f"{d}/config.json"))
    W = {k: v.astype(np.float64) for k, v in load_file(f"{d}/weights.safetensors").items()}
    I = {k: v.astype(np.float64) for k, v in load_file(f"{d}/inputs.safetensors").items()}
    out = {}
    case = cfg["case"]
    if case == "blocks":
        out["res_widen"] = res_block(W, "widen", I["x"])
        out["res_same"] = res_block(W, "same", out["res_widen"])
    elif case == "decoder":
        out["stage1"] = decode(W, cfg, I["latents"], stop_after=cfg["stage1_last"])
        out["frames"] = decode(W, cfg, I["latents"])
    elif case == "encoder":
        out["latents"] = encode(W, cfg, I["video"])
    else:
        raise SystemExit(f"unknown case {case!r}")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              f"{d}/outputs.safetensors")


def selftest():
    rng = np.random.default_rng(0)
    # conv3d against a direct sum at one output position, with stride and asymmetric padding.
    x, w, b = rng.standard_normal((3, 5, 6, 7)), rng.standard_normal((4, 3, 3, 3, 3)), rng.standard_normal(4)
    pad = ((2, 0), (0, 1), (1, 1))
    y = conv3d(x, w, b, (2, 2, 1), pad)
    xp = np.pad(x, ((0, 0),) + pad)
    o, t, i, j = 2, 1, 2, 3
    want = b[o] + (w[o] * xp[:, 2 * t:2 * t + 3, 2 * i:2 * i + 3, j:j + 3]).sum()
    assert np.isclose(y[o, t, i, j], want)
    # Causality: changing a late frame leaves earlier outputs of a causal conv unchanged.
    W = {"c.weight": w, "c.bias": b}
    x2 = x.copy()
    x2[:, 4] += 1.0
    assert np.allclose(causal_conv(W, "c", x)[:, :4], causal_conv(W, "c", x2)[:, :4])
    # Frame counts: the official decoder layout maps 1 + k latents to 1 + 4k frames.
    cfg = {"dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "temporal_downsample": [False, True, True]}
    layers = decoder_layers(cfg)
    assert [i for i, k, _ in layers if k == "up"] == [3, 7, 11] and len(layers) == 15
    assert [t for _, k, t in layers if k == "up"] == [True, True, False]
    print("selftest ok")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    selftest() if sys.argv[1] == "--selftest" else run_case(sys.argv[1])
