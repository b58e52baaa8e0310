#!/usr/bin/env python3
"""Proves the PyTorch modules of this folder equal the project's independent NumPy references
(which are proven equal to the Rust in `cargo test`), on the same random weights, in f32:

1. DiT forward (`dit.WanDiT`) vs `pipeline/tests/ref/lingbot_ref.py::dit`, at a small config and at
   the shipped `world` config;
2. the engine's streaming loop (`engine.stream`: KV cache with sink + rolling window, t=0 refresh,
   schedule, re-noise) vs `lingbot_ref.py::stream`, with eviction exercised;
3. the training form (one forward over [clean chunks ; noisy chunks] with `teacher_forcing_mask`)
   vs the streaming form fed the same clean latents: what is trained is what the engine runs;
4. the tiny decoder and encoder (`taehv.TinyAE`) vs `pipeline/tests/ref/taehv_ref.py::decode` and
   `::encode` (the Rust `world` configs' layouts, proven equal to the Rust in `cargo test`);
5. the camera fold vs `lingbot_ref.py::fold_camera`;
6. with `--dataset DIR` (a `worker world dataset` export with camera.npy): the camera tokens built
   here from `rel_poses.npy` (what training feeds the DiT) vs the engine's own tokens in camera.npy.

Usage: python pipeline/train/check_parity.py [--dataset DIR]   (CPU; exits 1 on failure)
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "ref"))

import lingbot_ref as ref  # noqa: E402
import taehv_ref  # noqa: E402
from camera import fold  # noqa: E402
from dit import DitConfig, WanDiT, StreamCache, teacher_forcing_mask  # noqa: E402
from engine import Schedule, i2v_y, stream  # noqa: E402
from taehv import TinyAE  # noqa: E402
from world_config import DIT, AE  # noqa: E402

TOL = 1e-5
failed = []


def report(name, got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
    ok = err < TOL and got.shape == want.shape
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max rel error {err:.2e} (shape {got.shape})")
    if not ok:
        failed.append(name)


def torch_model(cfg_dict, W):
    cfg = DitConfig(**{k: cfg_dict[k] for k in ("dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim",
                                                "text_dim", "text_len", "freq_dim", "eps", "control_dim")})
    m = WanDiT(cfg)
    sd = {k: torch.tensor(v, dtype=torch.float32) for k, v in W.items()}
    m.load_state_dict(sd, strict=True)  # the reference's names are the checkpoint's: no renaming
    return m.eval()


def t32(a):
    return torch.tensor(np.asarray(a), dtype=torch.float32)


def dit_forward(cfg, seed, name, hw=(4, 6), nf=3):
    rng = np.random.default_rng(seed)
    W = ref.random_model(rng, cfg)
    m = torch_model(cfg, W)
    h, w = hw
    ctx = rng.standard_normal((5, cfg["text_dim"]))
    x = rng.standard_normal((16, nf, h, w))
    P = rng.standard_normal((nf, 8 * h, 8 * w, cfg["control_dim"]))
    first = rng.standard_normal((16, h, w))
    xin = np.concatenate([x, ref.i2v_y(first, 0, nf)])
    want = ref.dit(W, cfg, xin, 967.0, ref.embed_text(W, cfg, ctx), ref.camera_cond(W, P))
    with torch.no_grad():
        got = m(t32(xin)[None], torch.full((1, nf), 967.0, dtype=torch.float64), torch.arange(nf),
                m.text_kv(t32(ctx)[None]), m.camera_mods(fold(t32(P)[None])))
    report(f"DiT forward ({name})", got[0].numpy(), want)
    return W, m


def dit_stream(cfg, seed):
    rng = np.random.default_rng(seed)
    W = ref.random_model(rng, cfg)
    m = torch_model(cfg, W)
    h, w, C, n = 4, 4, 3, 5
    cfg = dict(cfg, stream=dict(chunk_frames=C, num_chunks=n, window_frames=9, sink_frames=3,
                                step_indices=[0, 250, 500, 750], shift=10.0, num_train_steps=1000))
    inp = {"context": rng.standard_normal((7, cfg["text_dim"])), "first_latent": rng.standard_normal((16, h, w))}
    for c in range(n):
        inp[f"plucker.{c}"] = rng.standard_normal((C, 8 * h, 8 * w, 6))
        for s in range(4):
            inp[f"noise.{c}.{s}"] = rng.standard_normal((16, C, h, w))
    want = ref.stream(W, cfg, inp)
    cams = [fold(t32(inp[f"plucker.{c}"])[None]) for c in range(n)]
    got = stream(m, m.text_kv(t32(inp["context"])[None]), t32(inp["first_latent"])[None], cams,
                 lambda c, s: t32(inp[f"noise.{c}.{s}"])[None], window=9, sink=3)
    report(f"engine stream, {n} chunks, window 9 + sink 3", torch.stack(got).numpy()[:, 0],
           np.stack([want[f"x0.{c}"] for c in range(n)]))
    return m


@torch.no_grad()
def training_form(m, seed):
    """Clean latents as context, one noisy chunk per chunk: mask form == cache form."""
    g = torch.Generator().manual_seed(seed)
    h, w, C, n, window, sink = 4, 4, 3, 5, 9, 3
    tpf = (h // 2) * (w // 2)
    clean = torch.randn(1, 16, n * C, h, w, generator=g)
    noisy = torch.randn(1, 16, n * C, h, w, generator=g)
    first = clean[:, :, 0]
    t_noisy = torch.tensor([999.0, 967.0, 908.0, 768.0, 967.0], dtype=torch.float64)
    cam = torch.randn(1, n * C * tpf, 6 * 256, generator=g)
    text = m.text_kv(torch.randn(1, 4, m.cfg.text_dim, generator=g))
    y = torch.cat([i2v_y(first, c * C, C) for c in range(n)], 2)
    x = torch.cat([torch.cat([clean, y], 1), torch.cat([noisy, y], 1)], 2)
    tf = torch.cat([torch.zeros(n * C, dtype=torch.float64), t_noisy.repeat_interleave(C)])[None]
    pos = torch.cat([torch.arange(n * C), torch.arange(n * C)])
    cm = m.camera_mods(torch.cat([cam, cam], 1))
    mask = teacher_forcing_mask(n, C, tpf, window, sink, "cpu")
    got = m(x, tf, pos, text, cm, attn_mask=mask)[:, :, n * C:]
    cache = StreamCache(len(m.blocks), window, sink, tpf)
    want = []
    for c in range(n):
        sl = slice(c * C, (c + 1) * C)
        pc = torch.arange(c * C, (c + 1) * C)
        cmc = m.camera_mods(cam[:, c * C * tpf:(c + 1) * C * tpf])
        yc = y[:, :, sl]
        tc = torch.full((1, C), float(t_noisy[c]), dtype=torch.float64)
        want.append(m(torch.cat([noisy[:, :, sl], yc], 1), tc, pc, text, cmc, cache=cache))
        m(torch.cat([clean[:, :, sl], yc], 1), torch.zeros(1, C, dtype=torch.float64), pc, text, cmc,
          cache=cache, kv_only=True)
    report("training form (teacher-forcing mask) == streaming form", got.numpy(), torch.cat(want, 2).numpy())


def tiny_decoder(seed):
    rng = np.random.default_rng(seed)
    ae = TinyAE(**AE)
    W = {}
    for k, v in ae.state_dict().items():
        fan = np.prod(v.shape[1:]) if v.dim() > 1 else 1
        W[k] = rng.standard_normal(tuple(v.shape)) / np.sqrt(fan) * (1.0 if v.dim() > 1 else 0.1)
    ae.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in W.items()})
    z = rng.standard_normal((16, 3, 16, 16))
    cfg = {"mem_blocks": AE["mem_blocks"], "time_upscale": list(AE["time_upscale"])}
    dec = {k: v for k, v in W.items() if k.startswith("decoder.")}
    raw, frames = taehv_ref.decode(dec, cfg, z)
    with torch.no_grad():
        got_raw = ae.decode_raw(t32(z)[None])[0].numpy()
        got = ae.decode(t32(z)[None]).clamp(-1, 1)[0].numpy()
    report("tiny decoder raw", got_raw, raw)
    report("tiny decoder frames", got, frames)
    video = rng.uniform(-1, 1, (3, 9, 32, 32))
    enc = {k: v for k, v in W.items() if k.startswith("encoder.")}
    want = taehv_ref.encode(enc, {"mem_blocks": AE["mem_blocks"], "time_downscale": list(AE["time_downscale"])}, video)
    with torch.no_grad():
        got = ae.encode(t32(video)[None])[0].numpy()
    report("tiny encoder (first frame repeated in front)", got, want)


def camera_fold(seed):
    rng = np.random.default_rng(seed)
    P = rng.standard_normal((3, 32, 48, 6))
    report("camera fold", fold(t32(P)[None])[0].numpy(), ref.fold_camera(P))


def dataset_camera(d):
    from camera import ray_tokens
    rel = torch.from_numpy(np.load(os.path.join(d, "rel_poses.npy")))
    cam = np.load(os.path.join(d, "camera.npy"), mmap_mode="r")  # [N, K, 192, 1536]
    n, k = cam.shape[:2]
    got = ray_tokens(rel[..., :3], rel[..., 3], 128, 128).view(n, k, -1, cam.shape[-1])
    report(f"camera tokens from rel_poses vs the engine's camera.npy ({n} clips × {k} chunks)",
           got.numpy(), np.asarray(cam))


def main():
    torch.manual_seed(0)
    if "--dataset" in sys.argv:
        dataset_camera(sys.argv[sys.argv.index("--dataset") + 1])
    small = dict(dim=32, ffn_dim=64, num_heads=2, num_layers=2, in_dim=36, out_dim=16, text_dim=24,
                 text_len=8, freq_dim=16, eps=1e-6, control_dim=6)
    dit_forward(small, 1, "dim 32")
    world = dict(DIT, in_dim=36, out_dim=16, eps=1e-6)
    dit_forward(world, 2, f"world: dim {world['dim']}, {world['num_layers']} layers", hw=(16, 16), nf=3)
    m = dit_stream(small, 3)
    training_form(m, 4)
    camera_fold(5)
    tiny_decoder(6)
    if failed:
        print("FAILED:", ", ".join(failed))
        sys.exit(1)
    print("all parity checks passed")


if __name__ == "__main__":
    main()
