#!/usr/bin/env python3
"""Independent NumPy reference of the LingBot/Wan I2V DiT and its streaming chunk loop.

Written from /work/shared/MODELS.md (sections 2-5) and research/lingbot_wan_arch.md, not from
upstream code. It is deliberately slow and plain: float64 everywhere, one token sequence, loops
over layers, so that a reader can check every line against the spec.

Usage: python3 lingbot_ref.py CASE_DIR   (reads config.json, weights.safetensors, inputs.safetensors;
                                          writes CASE_DIR/outputs.safetensors, float32)
       python3 lingbot_ref.py --selftest
"""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


# ---------------------------------------------------------------- small ops
def lin(W, name, x):
    # PyTorch Linear layout: weight [out, in].
    return x @ W[name + ".weight"].T + W[name + ".bias"]


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, eps, w=None, b=None):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y if w is None else y * w + b


def rms_norm(x, w, eps):
    # Over the FULL dim, before the head split (Wan "qk_norm across heads").
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def attention(q, k, v):
    # q [Lq, nh, hd], k/v [Lk, nh, hd]; no mask anywhere in this model.
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", s, v)


def sinusoid(t, freq_dim):
    half = freq_dim // 2
    f = np.power(10000.0, -np.arange(half, dtype=np.float64) / half)
    return np.concatenate([np.cos(t * f), np.sin(t * f)])


# ---------------------------------------------------------------- layout (folds / RoPE)
def patchify(x):
    # [C, F, H, W] -> [L, C*4]; tokens ordered (f, h, w), feature index c*4 + q*2 + r.
    C, F, H, W = x.shape
    t = x.reshape(C, F, H // 2, 2, W // 2, 2).transpose(1, 2, 4, 0, 3, 5)
    return t.reshape(F * (H // 2) * (W // 2), C * 4)


def unpatchify(tok, C, F, H, W):
    # head output [L, 64] is ordered (p, q, r, c) with c fastest, p = 1 time patch.
    t = tok.reshape(F, H // 2, W // 2, 1, 2, 2, C).transpose(6, 0, 3, 1, 4, 2, 5)
    return t.reshape(C, F, H, W)


def fold_camera(P):
    # The one place the Plücker channel order lives (may need correcting later).
    # P [F, 8H, 8W, C] -> 8x8 pixel fold: feat[c*64 + i*8 + j] = P[f, 8y+i, 8x+j, c]
    # -> 2x2 patch fold: token (f, y2, x2) feat[ch*4 + q*2 + r] = folded[f, 2y2+q, 2x2+r, ch].
    F, H8, W8, C = P.shape
    H, Wd = H8 // 8, W8 // 8
    a = P.reshape(F, H, 8, Wd, 8, C).transpose(0, 1, 3, 5, 2, 4).reshape(F, H, Wd, C * 64)
    b = a.reshape(F, H // 2, 2, Wd // 2, 2, C * 64).transpose(0, 1, 3, 5, 2, 4)
    return b.reshape(F * (H // 2) * (Wd // 2), C * 64 * 4)


def rope_angles(head_dim, grid, t0):
    # Per token, the angle of each of the head_dim/2 complex pairs: first c_t pairs use the
    # frame index (+ absolute offset t0), the next c_h the row, the last c_w the column.
    d, c = head_dim, head_dim // 2
    ch = cw = c // 3
    ct = c - ch - cw
    dt, dhw = d - 4 * (d // 6), 2 * (d // 6)
    assert dt // 2 == ct and dhw // 2 == ch

    def freqs(da):
        return 1.0 / np.power(10000.0, np.arange(0, da, 2, dtype=np.float64) / da)

    F, Hp, Wp = grid
    f, h, w = np.meshgrid(np.arange(F) + t0, np.arange(Hp), np.arange(Wp), indexing="ij")
    f, h, w = (a.reshape(-1, 1).astype(np.float64) for a in (f, h, w))
    return np.concatenate([f * freqs(dt), h * freqs(dhw), w * freqs(dhw)], axis=1)  # [L, c]


def rope(x, ang):
    # x [L, nh, hd]; pair j = x[2j] + i*x[2j+1], multiplied by exp(i*angle).
    re, im = x[..., 0::2], x[..., 1::2]
    cs, sn = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = re * cs - im * sn
    out[..., 1::2] = re * sn + im * cs
    return out


# ---------------------------------------------------------------- K/V cache
class KVCache:
    """Per layer a list of (abs_frame, K, V), keys already roped. Oldest first."""

    def __init__(self, num_layers, window, sink):
        self.layers = [[] for _ in range(num_layers)]
        self.window = window if window is not None and window > 0 else None  # None: global
        self.sink = sink or 0

    def write_and_get(self, layer, frames, K, V):
        lst = self.layers[layer]
        for fi, k, v in zip(frames, K, V):
            for n, (g, _, _) in enumerate(lst):
                if g == fi:  # same chunk, later step / refresh: overwrite in place
                    lst[n] = (fi, k, v)
                    break
            else:
                lst.append((fi, k, v))
        while self.window is not None and len(lst) > self.window:
            del lst[self.sink]  # oldest non-sink frame; the first `sink` frames stay forever
        return (np.concatenate([e[1] for e in lst]), np.concatenate([e[2] for e in lst]))

    def frames(self, layer=0):
        return [e[0] for e in self.layers[layer]]


# ---------------------------------------------------------------- the DiT
def embed_text(W, cfg, context):
    # Pad BEFORE the MLP: padding rows become bias-driven tokens that are attended (no mask).
    n = context.shape[0]
    ctx = np.zeros((cfg["text_len"], cfg["text_dim"]))
    ctx[:n] = context
    return lin(W, "text_embedding.2", gelu_tanh(lin(W, "text_embedding.0", ctx)))


def camera_cond(W, P):
    emb = lin(W, "patch_embedding_wancamctrl", fold_camera(P))
    return emb + lin(W, "c2ws_hidden_states_layer2", silu(lin(W, "c2ws_hidden_states_layer1", emb)))


def dit(W, cfg, x_in, t, text, cond=None, t0=0, cache=None):
    """x_in [in_dim, F, H, W] -> velocity [out_dim, F, H, W].

    text: embedded context [text_len, dim]; cond: camera cond [L, dim] or None.
    t0: absolute latent index of frame 0 (RoPE time offset, cache slot).
    cache None: plain bidirectional attention over these tokens only."""
    dim, nh, eps = cfg["dim"], cfg["num_heads"], cfg["eps"]
    hd = dim // nh
    _, F, H, Wd = x_in.shape
    grid = (F, H // 2, Wd // 2)
    L, per_frame = F * grid[1] * grid[2], grid[1] * grid[2]

    pw = W["patch_embedding.weight"]
    x = patchify(x_in) @ pw.reshape(dim, -1).T + W["patch_embedding.bias"]
    e = lin(W, "time_embedding.2", silu(lin(W, "time_embedding.0", sinusoid(float(t), cfg["freq_dim"]))))
    e0 = lin(W, "time_projection.1", silu(e)).reshape(6, dim)
    ang = rope_angles(hd, grid, t0)

    for i in range(cfg["num_layers"]):
        p = f"blocks.{i}."
        sh_a, sc_a, g_a, sh_f, sc_f, g_f = W[p + "modulation"][0] + e0

        h = layer_norm(x, eps) * (1 + sc_a) + sh_a
        q = rms_norm(lin(W, p + "self_attn.q", h), W[p + "self_attn.norm_q.weight"], eps)
        k = rms_norm(lin(W, p + "self_attn.k", h), W[p + "self_attn.norm_k.weight"], eps)
        v = lin(W, p + "self_attn.v", h)
        q, k, v = (a.reshape(L, nh, hd) for a in (q, k, v))
        q, k = rope(q, ang), rope(k, ang)
        if cache is not None:
            kf, vf = k.reshape(F, per_frame, nh, hd), v.reshape(F, per_frame, nh, hd)
            k, v = cache.write_and_get(i, [t0 + f for f in range(F)], kf, vf)
        x = x + g_a * lin(W, p + "self_attn.o", attention(q, k, v).reshape(L, dim))

        if cond is not None:
            hc = lin(W, p + "cam_injector_layer2", silu(lin(W, p + "cam_injector_layer1", cond))) + cond
            x = (1 + lin(W, p + "cam_scale_layer", hc)) * x + lin(W, p + "cam_shift_layer", hc)

        h = layer_norm(x, eps, W[p + "norm3.weight"], W[p + "norm3.bias"])
        q = rms_norm(lin(W, p + "cross_attn.q", h), W[p + "cross_attn.norm_q.weight"], eps)
        k = rms_norm(lin(W, p + "cross_attn.k", text), W[p + "cross_attn.norm_k.weight"], eps)
        v = lin(W, p + "cross_attn.v", text)
        o = attention(q.reshape(L, nh, hd), k.reshape(-1, nh, hd), v.reshape(-1, nh, hd))
        x = x + lin(W, p + "cross_attn.o", o.reshape(L, dim))

        h = layer_norm(x, eps) * (1 + sc_f) + sh_f
        x = x + g_f * lin(W, p + "ffn.2", gelu_tanh(lin(W, p + "ffn.0", h)))

    sh, sc = W["head.modulation"][0] + e  # e, not e0
    out = lin(W, "head.head", layer_norm(x, eps) * (1 + sc) + sh)
    return unpatchify(out, cfg["out_dim"], F, H, Wd)


# ---------------------------------------------------------------- scheduler + streaming
def schedule(shift, n=1000):
    base = np.linspace(0.999, 0.0, n)
    sig = shift * base / (1 + (shift - 1) * base)
    return sig, np.floor(sig * 1000).astype(np.int64)  # truncation: timesteps repeat


def sigma_first(sig, ts, t):
    return sig[np.nonzero(ts == t)[0][0]]


def sigma_second(sig, ts, t):
    idx = np.nonzero(ts == t)[0]  # diffusers index_for_timestep: 2nd match if repeated
    return sig[idx[1] if len(idx) > 1 else idx[0]]


def i2v_y(first_latent, chunk_start, Fc):
    # mask (4 ch) and first-frame latent (16 ch) are nonzero only on ABSOLUTE latent frame 0.
    H, Wd = first_latent.shape[1:]
    y = np.zeros((20, Fc, H, Wd))
    if chunk_start == 0:
        y[:4, 0] = 1.0
        y[4:, 0] = first_latent
    return y


def stream(W, cfg, inp):
    st = cfg["stream"]
    Fc = st["chunk_frames"]
    sig, ts = schedule(st["shift"], st.get("num_train_steps", 1000))
    steps = [int(ts[i]) for i in st["step_indices"]]
    text = embed_text(W, cfg, inp["context"])
    cache = KVCache(cfg["num_layers"], st["window_frames"], st["sink_frames"])
    outs = {}
    for c in range(st["num_chunks"]):
        t0 = c * Fc
        y = i2v_y(inp["first_latent"], t0, Fc)
        cond = camera_cond(W, inp[f"plucker.{c}"]) if cfg.get("control_dim") is not None else None

        def run(x, t):
            return dit(W, cfg, np.concatenate([x, y]), t, text, cond, t0, cache)

        x = inp[f"noise.{c}.0"]
        for s, t in enumerate(steps):
            x0 = x - sigma_first(sig, ts, t) * run(x, float(t))
            if s + 1 < len(steps):
                sn = sigma_second(sig, ts, steps[s + 1])
                x = (1 - sn) * x0 + sn * inp[f"noise.{c}.{s + 1}"]  # re-noise, not an ODE step
        outs[f"x0.{c}"] = x0
        run(x0, 0.0)  # refresh: this chunk's K/V recomputed from the clean x0
    return outs


def run_case(case_dir):
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    W = {k: v.astype(np.float64) for k, v in load_file(os.path.join(case_dir, "weights.safetensors")).items()}
    inp = {k: v.astype(np.float64) for k, v in load_file(os.path.join(case_dir, "inputs.safetensors")).items()}
    if cfg["case"] == "forward":
        cond = camera_cond(W, inp["plucker"]) if cfg.get("control_dim") is not None else None
        out = {"out": dit(W, cfg, inp["x"], float(inp["t"].reshape(-1)[0]), embed_text(W, cfg, inp["context"]), cond)}
    elif cfg["case"] == "stream":
        out = stream(W, cfg, inp)
    else:
        raise SystemExit(f"unknown case {cfg['case']!r}")
    for k, v in out.items():
        assert np.all(np.isfinite(v)), k
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              os.path.join(case_dir, "outputs.safetensors"))


# ---------------------------------------------------------------- self test
def random_model(rng, cfg):
    d, cd = cfg["dim"], cfg["control_dim"]
    shapes = {"patch_embedding.weight": (d, cfg["in_dim"], 1, 2, 2), "patch_embedding.bias": (d,),
              "head.modulation": (1, 2, d)}
    linears = {"text_embedding.0": (d, cfg["text_dim"]), "text_embedding.2": (d, d),
               "time_embedding.0": (d, cfg["freq_dim"]), "time_embedding.2": (d, d),
               "time_projection.1": (6 * d, d), "head.head": (cfg["out_dim"] * 4, d)}
    if cd is not None:
        linears.update({"patch_embedding_wancamctrl": (d, cd * 256), "c2ws_hidden_states_layer1": (d, d),
                        "c2ws_hidden_states_layer2": (d, d)})
    for i in range(cfg["num_layers"]):
        p = f"blocks.{i}."
        shapes[p + "modulation"] = (1, 6, d)
        shapes.update({p + n: (d,) for n in ("norm3.weight", "norm3.bias", "self_attn.norm_q.weight",
                       "self_attn.norm_k.weight", "cross_attn.norm_q.weight", "cross_attn.norm_k.weight")})
        linears.update({p + a + "." + n: (d, d) for a in ("self_attn", "cross_attn") for n in "qkvo"})
        linears.update({p + "ffn.0": (cfg["ffn_dim"], d), p + "ffn.2": (d, cfg["ffn_dim"])})
        if cd is not None:
            linears.update({p + n: (d, d) for n in ("cam_injector_layer1", "cam_injector_layer2",
                                                    "cam_scale_layer", "cam_shift_layer")})
    for n, (o, i) in linears.items():
        shapes[n + ".weight"], shapes[n + ".bias"] = (o, i), (o,)
    # 1/sqrt(fan_in) keeps activations O(1) so equalities below are meaningful.
    return {n: rng.standard_normal(s) / np.sqrt(s[-1] if len(s) == 2 else np.prod(s[1:]) if len(s) > 2 else 1.0)
            for n, s in shapes.items()}


def selftest():
    rng = np.random.default_rng(0)
    # RoPE is a rotation (norm preserving) and relative: a common time shift leaves q.k unchanged.
    ang0, ang7 = rope_angles(32, (3, 2, 2), 0), rope_angles(32, (3, 2, 2), 7)
    q, k = rng.standard_normal((2, 12, 2, 32))
    assert np.allclose(np.linalg.norm(rope(q, ang0), axis=-1), np.linalg.norm(q, axis=-1))
    dots = lambda a: np.einsum("qhd,khd->hqk", rope(q, a), rope(k, a))
    assert np.allclose(dots(ang0), dots(ang7))
    # Scheduler facts quoted in MODELS.md section 5.
    sig, ts = schedule(10.0)
    assert list(ts[[0, 250, 500, 750]]) == [999, 967, 908, 768]
    assert (ts == 999).sum() == 9 and list(np.nonzero(ts == 967)[0]) == list(range(248, 254))
    assert sigma_first(sig, ts, 967) == sig[248] and sigma_second(sig, ts, 967) == sig[249]
    # Folds checked element-wise against the spec's index formulas.
    P = rng.standard_normal((2, 32, 48, 3))
    fc = fold_camera(P)
    for _ in range(50):
        f, y2, x2, c, i, j, qq, r = (rng.integers(n) for n in (2, 2, 3, 3, 8, 8, 2, 2))
        tok = (f * 2 + y2) * 3 + x2
        assert fc[tok, (c * 64 + i * 8 + j) * 4 + qq * 2 + r] == P[f, 8 * (2 * y2 + qq) + i, 8 * (2 * x2 + r) + j, c]
    X = rng.standard_normal((5, 2, 4, 6))
    pt = patchify(X)
    assert pt[(1 * 2 + 1) * 3 + 2, 3 * 4 + 1 * 2 + 0] == X[3, 1, 3, 4]
    assert np.array_equal(unpatchify(pt.reshape(-1, 5, 4).transpose(0, 2, 1).reshape(-1, 20), 5, 2, 4, 6), X)
    # Cache eviction: window 5, sink 1, chunks of 3 frames written twice each.
    kv = KVCache(1, 5, 1)
    for c in range(3):
        for _ in range(2):
            kv.write_and_get(0, [3 * c, 3 * c + 1, 3 * c + 2], *rng.standard_normal((2, 3, 1, 1, 1)))
    assert kv.frames() == [0, 5, 6, 7, 8]
    # Tiny model: cached single chunk == bidirectional forward (any offset, by RoPE relativity),
    # and a one-chunk, one-step stream == x - sigma * forward.
    for cd in (6, None):
        cfg = dict(dim=32, ffn_dim=64, num_heads=2, num_layers=2, in_dim=36, out_dim=16, text_dim=24,
                   text_len=8, freq_dim=16, eps=1e-6, control_dim=cd)
        W = random_model(rng, cfg)
        ctx, x = rng.standard_normal((5, 24)), rng.standard_normal((16, 3, 4, 6))
        P = rng.standard_normal((3, 32, 48, cd)) if cd else None
        text, cond = embed_text(W, cfg, ctx), (camera_cond(W, P) if cd else None)
        first = rng.standard_normal((16, 4, 6))
        xin = np.concatenate([x, i2v_y(first, 0, 3)])
        ref = dit(W, cfg, xin, 999.0, text, cond)
        assert np.all(np.isfinite(ref)) and ref.shape == (16, 3, 4, 6) and np.abs(ref).max() > 1e-3
        for t0 in (0, 5):
            assert np.allclose(dit(W, cfg, xin, 999.0, text, cond, t0, KVCache(2, 100, 0)), ref)
        cfg["stream"] = dict(chunk_frames=3, num_chunks=1, window_frames=100, sink_frames=0,
                             step_indices=[0], shift=10.0, num_train_steps=1000)
        inp = {"context": ctx, "first_latent": first, "noise.0.0": x}
        if cd:
            inp["plucker.0"] = P
        assert np.allclose(stream(W, cfg, inp)["x0.0"], x - sig[0] * ref)
    print("selftest ok")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    selftest() if sys.argv[1] == "--selftest" else run_case(sys.argv[1])
