#!/usr/bin/env python3
"""Independent NumPy reference of the tiny (TAEHV-kind) video decoder and encoder (float64, whole
sequences).

Written from the architecture facts (research/lingbot_wan_arch.md section 2.3 and the layer list
of TAEHV's decoder and encoder), not from the Rust code: every time step of a layer is computed at once, each
memory block reading the previous time step of its input through an explicit one-frame shift with
a zero frame in front, so it checks the Rust streaming state as well as the math.
Tensors are [C, T, H, W].

Usage: python3 taehv_ref.py CASE_DIR   (reads config.json, weights.safetensors,
                                         inputs.safetensors; writes outputs.safetensors)
       python3 taehv_ref.py --selftest
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def conv2d(x, w, b=None):
    """Per-frame Conv2d, stride 1, zero 'same' padding: one tensor contraction per tap."""
    O, C, kh, kw = w.shape
    ph, pw = (kh - 1) // 2, (kw - 1) // 2
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    H, Wd = x.shape[2], x.shape[3]
    out = np.zeros((O, x.shape[1], H, Wd))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("oc,cthw->othw", w[:, :, i, j], xp[:, :, i:i + H, j:j + Wd])
    if b is not None:
        out += b.reshape(-1, 1, 1, 1)
    return out


def relu(x):
    return np.maximum(x, 0.0)


def conv(W, name, x):
    return conv2d(x, W[name + ".weight"], W.get(name + ".bias"))


def mem_block(W, p, x):
    # past[t] = x[t - 1], zero before the first step.
    past = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    h = relu(conv(W, p + ".conv.0", np.concatenate([x, past], axis=0)))
    h = relu(conv(W, p + ".conv.2", h))
    h = conv(W, p + ".conv.4", h)
    skip = conv(W, p + ".skip", x) if p + ".skip.weight" in W else x
    return relu(h + skip)


def t_grow(W, p, x, stride):
    # 1x1 conv to stride*C channels; channel block j of step t becomes frame stride*t + j.
    C, T = x.shape[0], x.shape[1]
    y = conv(W, p + ".conv", x)
    return np.stack([y[j * C:(j + 1) * C] for j in range(stride)], axis=2).reshape(
        C, T * stride, x.shape[2], x.shape[3])


def t_pool(W, p, x, stride):
    # Frames stride*t + j stacked as channel block j, then a 1x1 conv back to C channels.
    if stride > 1:
        x = np.concatenate([x[:, j::stride] for j in range(stride)], axis=0)
    return conv(W, p + ".conv", x)


def encoder_layers(cfg):
    """[(index, kind, arg)] of the encoder sequence (TAEHV.encoder)."""
    out = [(0, "conv", 1), (1, "relu", None)]
    for s in range(3):
        out.append((len(out), "pool", 2 if cfg["time_downscale"][s] else 1))
        out.append((len(out), "conv", 2))
        for _ in range(cfg["mem_blocks"]):
            out.append((len(out), "mem", None))
    out.append((len(out), "conv", 1))
    return out


def encode(W, cfg, video):
    """Frames in [-1, 1] -> latents: to [0, 1], the first frame repeated 3 times in front."""
    x = (video + 1.0) / 2.0
    x = np.concatenate([x[:, :1]] * 3 + [x], axis=1)
    for i, kind, arg in encoder_layers(cfg):
        p = f"encoder.{i}"
        if kind == "conv":
            # Stride 2 with padding 1 is the stride-1 'same' output at even positions.
            x = conv(W, p, x)[:, :, ::arg, ::arg]
        elif kind == "relu":
            x = relu(x)
        elif kind == "pool":
            x = t_pool(W, p, x, arg)
        elif kind == "mem":
            x = mem_block(W, p, x)
    return x


def layer_list(cfg):
    """[(index, kind, arg)] of the decoder sequence."""
    out = [(0, "clamp", None), (1, "conv", None), (2, "relu", None)]
    for s in range(3):
        for _ in range(cfg["mem_blocks"]):
            out.append((len(out), "mem", None))
        out.append((len(out), "up", None))
        out.append((len(out), "grow", 2 if cfg["time_upscale"][s] else 1))
        out.append((len(out), "conv", None))
    out.append((len(out), "relu", None))
    out.append((len(out), "conv", None))
    return out


def decode(W, cfg, z):
    x = z
    for i, kind, arg in layer_list(cfg):
        p = f"decoder.{i}"
        if kind == "clamp":
            x = np.tanh(x / 3.0) * 3.0
        elif kind == "conv":
            x = conv(W, p, x)
        elif kind == "relu":
            x = relu(x)
        elif kind == "mem":
            x = mem_block(W, p, x)
        elif kind == "up":
            x = x.repeat(2, axis=2).repeat(2, axis=3)
        elif kind == "grow":
            x = t_grow(W, p, x, arg)
    raw = x
    # Upstream: clamp to [0, 1] and drop the first t_upscale - 1 frames; then 2x - 1.
    t_up = 2 ** sum(cfg["time_upscale"])
    frames = np.clip(raw, 0.0, 1.0)[:, t_up - 1:] * 2.0 - 1.0
    return raw, frames


def run_case(d):
    cfg = json.load(open(f"{d}/config.json"))
    W = {k: v.astype(np.float64) for k, v in load_file(f"{d}/weights.safetensors").items()}
    I = {k: v.astype(np.float64) for k, v in load_file(f"{d}/inputs.safetensors").items()}
    out = {}
    case = cfg["case"]
    if case == "memblocks":
        out["mem_same"] = mem_block(W, "same", I["x"])
        out["mem_widen"] = mem_block(W, "widen", out["mem_same"])
    elif case == "decoder":
        out["raw"], out["frames"] = decode(W, cfg, I["latents"])
    elif case == "encoder":
        out["latents"] = encode(W, cfg, I["video"])
    else:
        raise SystemExit(f"unknown case {case!r}")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              f"{d}/outputs.safetensors")


def selftest():
    rng = np.random.default_rng(0)
    # conv2d against a direct sum at one output position (border, so the padding counts).
    x, w, b = rng.standard_normal((3, 2, 5, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    y = conv2d(x, w, b)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    o, t, i, j = 1, 1, 0, 5
    assert np.isclose(y[o, t, i, j], b[o] + (w[o] * xp[:, t, i:i + 3, j:j + 3]).sum())
    # Causality: changing the last step leaves earlier steps of a memory block unchanged.
    W = {"m.conv.0.weight": rng.standard_normal((3, 6, 3, 3)), "m.conv.0.bias": rng.standard_normal(3),
         "m.conv.2.weight": rng.standard_normal((3, 3, 3, 3)), "m.conv.2.bias": rng.standard_normal(3),
         "m.conv.4.weight": rng.standard_normal((3, 3, 3, 3)), "m.conv.4.bias": rng.standard_normal(3)}
    x = rng.standard_normal((3, 4, 5, 5))
    x2 = x.copy()
    x2[:, 3] += 1.0
    assert np.allclose(mem_block(W, "m", x)[:, :3], mem_block(W, "m", x2)[:, :3])
    # ... and the step after a change does change (the memory is used).
    x3 = x.copy()
    x3[:, 1] += 1.0
    assert not np.allclose(mem_block(W, "m", x)[:, 2], mem_block(W, "m", x3)[:, 2])
    # Official layout: 23 layers, growth at 7, 13, 19, the output conv at 22; k latents give
    # 4k - 3 = 1 + 4(k - 1) frames.
    cfg = {"mem_blocks": 3, "time_upscale": [False, True, True]}
    layers = layer_list(cfg)
    assert len(layers) == 23 and [i for i, k, _ in layers if k == "grow"] == [7, 13, 19]
    assert [a for _, k, a in layers if k == "grow"] == [1, 2, 2] and layers[22][1] == "conv"
    # TAEHV's encoder: 18 layers, time pools at 2, 7, 12 (strides 2, 2, 1), output conv at 17.
    enc = encoder_layers({"mem_blocks": 3, "time_downscale": [True, True, False]})
    assert len(enc) == 18 and [(i, a) for i, k, a in enc if k == "pool"] == [(2, 2), (7, 2), (12, 1)]
    assert enc[17][1] == "conv" and [i for i, k, a in enc if k == "conv" and a == 2] == [3, 8, 13]
    # The stride-2 conv equals a direct strided sum at a border position.
    x, w = rng.standard_normal((2, 1, 7, 6)), rng.standard_normal((3, 2, 3, 3))
    y = conv2d(x, w)[:, :, ::2, ::2]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    assert y.shape == (3, 1, 4, 3)
    assert np.isclose(y[2, 0, 3, 2], (w[2] * xp[:, 0, 6:9, 4:7]).sum())
    print("selftest ok")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    selftest() if sys.argv[1] == "--selftest" else run_case(sys.argv[1])
