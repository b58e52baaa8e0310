#!/usr/bin/env python3
"""Held-out play through the engine loop in PyTorch (CPU or GPU), decoded by the tiny decoder,
against the renderer: PSNR and SSIM per second of play.

    worker world dataset --out /tmp/heldout --clips 8 --chunks 14 --seed 1 --split heldout --no-camera-tensor
    python pipeline/train/evaluate.py --data /tmp/heldout [--dit pipeline/assets/world/dit.safetensors]

The Rust measurement is `worker verify world` (scripted tours through the real engine).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from camera import ray_tokens  # noqa: E402
from dit import DitConfig, WanDiT  # noqa: E402
from engine import CHUNK_FRAMES, stream  # noqa: E402
from taehv import TinyAE  # noqa: E402
from tensorio import load_npy  # noqa: E402
from world_config import AE  # noqa: E402

ASSETS = os.path.join(HERE, "..", "assets", "world")


def load_safetensors(path):
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    meta = header.pop("__metadata__", {})
    dt = {"F32": torch.float32, "BF16": torch.bfloat16}
    out = {k: torch.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=dt[v["dtype"]]).reshape(v["shape"]).clone()
           for k, v in header.items()}
    return out, meta


def gaussian_ssim(a, b):
    """SSIM (11×11 Gaussian, σ 1.5) of frames [T, 3, H, W] in [0, 255], averaged per frame."""
    g = torch.exp(-((torch.arange(11) - 5.0) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum())
    w = (g[:, None] * g[None, :])[None, None].repeat(3, 1, 1, 1)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    f = lambda x: F.conv2d(x, w, groups=3)
    mu_a, mu_b = f(a), f(b)
    saa, sbb, sab = f(a * a) - mu_a ** 2, f(b * b) - mu_b ** 2, f(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * sab + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (saa + sbb + c2))
    return s.mean(dim=(1, 2, 3))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--dit", default=os.path.join(ASSETS, "dit.safetensors"))
    p.add_argument("--ae", default=os.path.join(ASSETS, "ae.safetensors"))
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    sd, meta = load_safetensors(a.dit)
    model = WanDiT(DitConfig(**json.loads(meta["config"])))
    model.load_state_dict(sd)
    model.eval()
    ae = TinyAE(**AE)
    ae.load_state_dict(load_safetensors(a.ae)[0])
    ae.eval()
    frames = load_npy(os.path.join(a.data, "frames.npy"))[:a.clips]
    rel = load_npy(os.path.join(a.data, "rel_poses.npy"))[:a.clips]
    per = []
    ae_per = []
    with torch.no_grad():
        for i in range(frames.shape[0]):
            x = frames[i:i + 1].float().movedim(-1, 1) / 127.5 - 1  # [1, 3, T, H, W]
            z = ae.encode(x)
            cam = ray_tokens(rel[i:i + 1, :, :, :3], rel[i:i + 1, :, :, 3], 128, 128)
            tpf = 64
            text = model.text_kv(torch.zeros(1, model.cfg.text_len, model.cfg.text_dim))
            outs = stream(model, text, z[:, :, 0], list(cam.split(CHUNK_FRAMES * tpf, 1)),
                          lambda c, s: torch.randn(1, 16, CHUNK_FRAMES, 16, 16))
            y = ae.decode(torch.cat(outs, 2)).clamp(-1, 1)
            yr = ae.decode(z).clamp(-1, 1)
            q = lambda v: ((v[0].movedim(1, 0) + 1) * 127.5).round()  # [T, 3, H, W]
            gt, gen, rec = q(x), q(y), q(yr)
            mse = ((gt - gen) ** 2).mean(dim=(1, 2, 3))
            per.append(torch.stack([10 * torch.log10(255 ** 2 / mse), gaussian_ssim(gen, gt)], 1))
            mse_r = ((gt - rec) ** 2).mean(dim=(1, 2, 3))
            ae_per.append(10 * torch.log10(255 ** 2 / mse_r))
    m = torch.stack(per)  # [N, T, 2]
    r = torch.stack(ae_per)
    secs = m.shape[1] // 16
    print(f"{m.shape[0]} held-out clips of {m.shape[1]} frames ({m.shape[1] / 16:.1f} s)")
    print("| second | PSNR (dB) | SSIM | AE-only PSNR |")
    print("|---|---|---|---|")
    for s in range(secs):
        sl = slice(s * 16, (s + 1) * 16)
        print(f"| {s + 1} | {m[:, sl, 0].mean():.2f} | {m[:, sl, 1].mean():.3f} | {r[:, sl].mean():.2f} |")
    res = {"psnr_first_s": m[:, :16, 0].mean().item(), "ssim_first_s": m[:, :16, 1].mean().item(),
           "psnr_10th_s": m[:, 144:160, 0].mean().item(), "ssim_10th_s": m[:, 144:160, 1].mean().item(),
           "ae_psnr_first_s": r[:, :16].mean().item(), "ae_psnr_10th_s": r[:, 144:160].mean().item()}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
