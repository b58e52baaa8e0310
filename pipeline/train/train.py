#!/usr/bin/env python3
"""Trains the embedded default (`world`): the tiny autoencoder, then the tiny LingBot DiT on its
latents of rendered clips, for exactly what the engine runs (4-step chunk loop, sink + rolling
KV window, t=0 refresh, I2V first latent, per-chunk camera rays, a fixed all-padding text).

One command (GPU machine; see pipeline/assets/world/TRAINING.md):

    python pipeline/train/train.py --worker target/devbin/worker --out $OUT

Stages: `data` (renders train + held-out clips with `worker world dataset`), `ae`, `dit` (one
process per GPU; several DiT sizes can train side by side, `--dit-configs`), `eval` (held-out
play through the engine loop in PyTorch, PSNR against the renderer), `export` (safetensors under
the checkpoint names the Rust loader reads). Seeded; logs under $OUT.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from camera import ray_tokens  # noqa: E402
from dit import DitConfig, WanDiT, teacher_forcing_mask  # noqa: E402
from engine import CHUNK_FRAMES, SINK_FRAMES, WINDOW_FRAMES, Schedule, i2v_y, stream  # noqa: E402
from taehv import TinyAE  # noqa: E402
from tensorio import load_npy, load_safetensors, save_safetensors  # noqa: E402
from world_config import AE, DIT  # noqa: E402

H = W = 128
DEVTYPE = "cuda" if torch.cuda.is_available() else "cpu"


def amp():
    return torch.autocast(DEVTYPE, dtype=torch.bfloat16, enabled=DEVTYPE == "cuda")


def devn(i):
    # More DiTs than cards share them (the tiny model leaves a card mostly idle).
    return torch.device(f"cuda:{i % torch.cuda.device_count()}") if DEVTYPE == "cuda" else torch.device("cpu")


def log(out, name, msg):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(os.path.join(out, f"{name}.log"), "a") as f:
        f.write(line + "\n")


# ---------------------------------------------------------------------------------- data
def render(args):
    for split, clips, seed in (("train", args.clips, args.seed), ("heldout", args.heldout_clips, args.seed + 1)):
        d = os.path.join(args.data, split)
        if os.path.exists(os.path.join(d, "meta.json")):
            continue
        cmd = [args.worker, "world", "dataset", "--out", d, "--clips", str(clips), "--chunks", str(args.chunks),
               "--seed", str(seed), "--split", split, "--no-camera-tensor"]
        t = time.time()
        subprocess.run(cmd, check=True)
        log(args.out, "data", f"{split}: {clips} clips × {args.chunks} chunks in {time.time() - t:.1f} s: {' '.join(cmd)}")


_CACHE = {}


def load_split(args, split):
    d = os.path.join(args.data, split)
    key = (d, "frames")
    if key not in _CACHE:
        _CACHE[key] = (load_npy(os.path.join(d, "frames.npy")), load_npy(os.path.join(d, "rel_poses.npy")))
    return _CACHE[key]


def frames_to_gpu(frames, dev):
    return frames.to(dev)  # uint8 [N, T, H, W, 3]


def to_float(u8):
    """uint8 [..., T, H, W, 3] → [..., 3, T, H, W] in [−1, 1]."""
    x = u8.float() / 127.5 - 1.0
    return x.movedim(-1, -4)


def psnr(a, b):
    """Frames in [−1, 1]; per-frame PSNR on the 8-bit scale, averaged."""
    a = ((a.clamp(-1, 1) + 1) * 127.5).round()
    b = ((b.clamp(-1, 1) + 1) * 127.5).round()
    mse = ((a - b) ** 2).mean(dim=(1, 3, 4))  # [B, 3, T, H, W] → [B, T]
    return 10 * torch.log10(255.0 ** 2 / mse.clamp_min(1e-10))


# ---------------------------------------------------------------------------------- AE
def train_ae(args):
    dev = devn(0)
    torch.manual_seed(args.seed)
    frames, _ = load_split(args, "train")
    vids = frames_to_gpu(frames, dev)
    n, T = vids.shape[:2]
    ae = TinyAE(**AE).to(dev)
    opt = torch.optim.AdamW(ae.parameters(), lr=args.ae_lr, weight_decay=0.0)
    k = 4  # latents after the first per training window: 1 + 4k frames
    t0 = time.time()
    step = 0
    while True:
        el = time.time() - t0
        if el > args.ae_seconds:
            break
        lr = args.ae_lr * 0.5 * (1 + math.cos(math.pi * min(el / args.ae_seconds, 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (args.ae_batch,), device=dev)
        start = torch.randint(0, (T - 1 - 4 * k) // 4 + 1, (args.ae_batch,), device=dev) * 4
        start = torch.where(torch.rand(args.ae_batch, device=dev) < 0.25, torch.zeros_like(start), start)
        tt = start[:, None] + torch.arange(1 + 4 * k, device=dev)[None]
        x = to_float(vids[idx[:, None], tt])  # [B, 3, 1+4k, H, W]
        with amp():
            z = ae.encode(x)
            zn = z + torch.randn_like(z) * torch.rand(z.shape[0], 1, 1, 1, 1, device=dev) * args.ae_latent_noise
            y = ae.decode(zn)
        y = y.float()
        rec = F.mse_loss(y, x) + 0.2 * (y - x).abs().mean()
        zf = z.float()
        mu = zf.mean((0, 2, 3, 4))
        sd = zf.std((0, 2, 3, 4))
        reg = (mu ** 2).mean() + ((sd - 1) ** 2).mean()
        loss = rec + 0.02 * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ae.parameters(), 1.0)
        opt.step()
        if step % 200 == 0:
            with torch.no_grad():
                p = psnr(y.detach(), x).mean().item()
            log(args.out, "ae", f"step {step} t {el:.0f}s loss {loss.item():.4f} psnr {p:.2f} latent mean {mu.abs().mean():.3f} std {sd.mean():.3f} lr {lr:.2e}")
        step += 1
    torch.save(ae.state_dict(), os.path.join(args.out, "ae.pt"))
    log(args.out, "ae", f"done: {step} steps")
    return ae


@torch.no_grad()
def encode_all(args, ae, split, dev):
    frames, rel = load_split(args, split)
    out = []
    for i in range(0, len(frames), 16):
        x = to_float(frames_to_gpu(frames[i:i + 16], dev))
        with amp():
            out.append(ae.encode(x).float())
    return torch.cat(out), rel


def ae_metrics(args, ae, dev):
    frames, _ = load_split(args, "heldout")
    x = to_float(frames_to_gpu(frames, dev))
    with torch.no_grad(), amp():
        y = ae.decode(ae.encode(x)).float()
    p = psnr(y, x)  # [N, T]
    return {"ae_psnr_first_s": p[:, :16].mean().item(), "ae_psnr_last_s": p[:, -16:].mean().item(),
            "ae_psnr_all": p.mean().item()}


# ---------------------------------------------------------------------------------- DiT
def rel_split(rel):
    """[B, F, 3, 4] f64 → (r [B, F, 3, 3], t [B, F, 3])."""
    return rel[..., :3], rel[..., 3]


def dit_init(model):
    for blk in model.blocks:
        for lin in (blk.cam_scale_layer, blk.cam_shift_layer):
            torch.nn.init.zeros_(lin.weight)
            torch.nn.init.zeros_(lin.bias)
    torch.nn.init.zeros_(model.head.head.weight)
    torch.nn.init.zeros_(model.head.head.bias)


def null_text(model, b, dev):
    """The fixed context: all padding (zeros [text_len, text_dim]), what the engine holds before
    any prompt arrives."""
    return model.text_kv(torch.zeros(b, model.cfg.text_len, model.cfg.text_dim, device=dev))


@torch.no_grad()
def rollout(model, z_first, cams, n_chunks, dev, gen):
    """The engine's loop on a batch (own context), noise from `gen`; returns [B, 16, F, h, w]."""
    b = z_first.shape[0]
    shape = (b, 16, CHUNK_FRAMES, z_first.shape[-2], z_first.shape[-1])
    with amp():
        outs = stream(model, null_text(model, b, dev), z_first, cams,
                      lambda c, s: torch.randn(shape, device=dev, generator=gen))
    return torch.cat([o.float() for o in outs], 2)


def turn_per_latent(rel):
    """Mean rotation angle (radians) between consecutive latent frames of each clip: [B]."""
    r = rel[..., :3].to(torch.float64)
    tr = r[..., 0, 0] + r[..., 1, 1] + r[..., 2, 2]
    return torch.arccos(((tr - 1) / 2).clamp(-1, 1)).mean(1)


# Per-DiT training settings that `--dit-configs` may override with `_name` keys.
TRAIN_KEYS = ("dit_lr", "dit_batch", "rollout_after", "rollout_prob", "rollout_reuse", "yaw_weight",
              "warmup_steps", "motion_weight", "cam_lr_mult")


def is_camera_param(name):
    """The camera path: ray patch embedding, its MLP, and each block's injector/scale/shift."""
    return "cam" in name or "c2ws" in name


def motion_loss(x0, z, chunk_frames):
    """MSE of the frame-to-frame change inside each chunk (estimate against the clip's latents):
    an estimate that lags the commanded motion (under-turning) pays for the lag itself, not only
    for the frames it gets wrong."""
    d_est = x0[:, :, 1:] - x0[:, :, :-1]
    d_true = z[:, :, 1:] - z[:, :, :-1]
    keep = [j for j in range(x0.shape[2] - 1) if (j + 1) % chunk_frames != 0]  # not across chunks
    return F.mse_loss(d_est[:, :, keep], d_true[:, :, keep])


def split_over(over):
    """`--dit-configs` JSON → (model config overrides, training overrides)."""
    model = {k: v for k, v in over.items() if not k.startswith("_")}
    train = {k[1:]: v for k, v in over.items() if k.startswith("_")}
    bad = set(train) - set(TRAIN_KEYS)
    if bad:
        raise SystemExit(f"unknown training keys {sorted(bad)} (known: {TRAIN_KEYS})")
    return model, train


def train_dit(args, name, over, gpu):
    dev = devn(gpu)
    torch.manual_seed(args.seed + gpu)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 100 + gpu)
    cfg_over, hp = split_over(over)
    hp = {k: hp.get(k, getattr(args, k)) for k in TRAIN_KEYS}
    lat = torch.load(os.path.join(args.out, "latents_train.pt"))
    z_all, rel_all = lat["z"].to(dev), lat["rel"]
    r_all, t_all = (a.to(dev) for a in rel_split(rel_all))
    n, _, nf, h, w = z_all.shape
    nc = nf // CHUNK_FRAMES
    # Clips that turn more are drawn more often (weight 1 + yaw_weight · turn / A-D turn per latent).
    turn = turn_per_latent(rel_all).float()
    ad_turn = math.radians(45.0) * 4 / 16
    weights = (1 + hp["yaw_weight"] * turn / ad_turn).to(dev)

    def draw(k):
        return torch.multinomial(weights, k, replacement=True)

    cfg = DitConfig(**dict(DIT, **cfg_over))
    model = WanDiT(cfg).to(dev)
    dit_init(model)
    if args.init_dit:
        sd, meta = load_safetensors(args.init_dit)
        model.load_state_dict(sd)  # strict: a checkpoint of another shape fails here
    nparams = sum(p.numel() for p in model.parameters())
    cam_p = [p for n_, p in model.named_parameters() if is_camera_param(n_)]
    rest_p = [p for n_, p in model.named_parameters() if not is_camera_param(n_)]
    opt = torch.optim.AdamW([{"params": rest_p, "mult": 1.0}, {"params": cam_p, "mult": float(hp["cam_lr_mult"])}],
                            lr=hp["dit_lr"], weight_decay=0.01, betas=(0.9, 0.99))
    sched = Schedule()
    tpf = (h // 2) * (w // 2)
    mask = teacher_forcing_mask(nc, CHUNK_FRAMES, tpf, WINDOW_FRAMES, SINK_FRAMES, dev)
    pos = torch.cat([torch.arange(nf), torch.arange(nf)])
    steps = sched.steps
    s1 = torch.tensor([sched.sigma_first(t) for t in steps], device=dev)
    s2 = torch.tensor([1.0] + [sched.sigma_second(t) for t in steps[1:]], device=dev)
    tag = f"dit_{name}"
    log(args.out, tag, f"config {cfg.to_dict()} params {nparams} clips {n} latent frames {nf} gpu {gpu} "
                       f"training {hp} init {args.init_dit} mean turn/latent {turn.mean():.3f} rad")
    t0 = time.time()
    step = 0
    B = int(hp["dit_batch"])
    R = max(1, int(hp["rollout_reuse"]))
    own_buf = []  # (clip indices, own-rollout context) slices of one rollout of B·R clips
    n_own = 0
    while True:
        el = time.time() - t0
        if el > args.dit_seconds:
            break
        frac = el / args.dit_seconds
        warm = min(1.0, step / max(1, hp["warmup_steps"]))
        lr = hp["dit_lr"] * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * g["mult"]
        # Context: ground truth, or (after warm-up) the model's own rollout as the engine makes it.
        # One rollout of B·R clips (about the cost of one of B: the tiny model is launch-bound)
        # serves the next R own-context steps.
        own = frac >= hp["rollout_after"] and torch.rand(()).item() < hp["rollout_prob"]
        if own:
            if not own_buf:
                big = draw(B * R)
                cam_big = ray_tokens(r_all[big], t_all[big], H, W)
                model.eval()
                ctx_big = rollout(model, z_all[big][:, :, 0], list(cam_big.split(CHUNK_FRAMES * tpf, 1)), nc,
                                  dev, gen)
                model.train()
                own_buf = [(big[i * B:(i + 1) * B], ctx_big[i * B:(i + 1) * B]) for i in range(R)]
                del cam_big
            idx, ctx = own_buf.pop()
            n_own += 1
        else:
            idx = draw(B)
        z = z_all[idx]
        if not own:
            ctx = z
        cam_tok = ray_tokens(r_all[idx], t_all[idx], H, W)
        first = z[:, :, 0]
        y = torch.cat([i2v_y(first, c * CHUNK_FRAMES, CHUNK_FRAMES) for c in range(nc)], 2)
        s = int(torch.randint(0, 4, ()).item())
        cam2 = torch.cat([cam_tok, cam_tok], 1)
        noise = torch.randn(z.shape, device=dev, generator=gen)
        t_clean = torch.zeros(B, nf, dtype=torch.float64, device=dev)

        def fwd(x_noisy, si):
            tf = torch.cat([t_clean, torch.full((B, nf), float(steps[si]), dtype=torch.float64, device=dev)], 1)
            xin = torch.cat([torch.cat([ctx, y], 1), torch.cat([x_noisy, y], 1)], 2)
            with amp():
                text = null_text(model, B, dev)
                v = model(xin, tf, pos, text, model.camera_mods(cam2), attn_mask=mask)[:, :, nf:]
            return x_noisy - s1[si] * v.float()

        x = noise
        with torch.no_grad():
            for si in range(s):  # the engine's earlier steps, from the model's own estimates
                x0 = fwd(x, si)
                x = (1 - s2[si + 1]) * x0 + s2[si + 1] * torch.randn(z.shape, device=dev, generator=gen)
        x0 = fwd(x, s)
        loss = mse = F.mse_loss(x0, z)
        if hp["motion_weight"]:
            loss = loss + hp["motion_weight"] * motion_loss(x0, z, CHUNK_FRAMES)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log(args.out, tag, f"step {step} t {el:.0f}s step_idx {s} own_ctx {int(own)} loss {loss.item():.4f} mse {mse.item():.4f} gn {gn:.2f} lr {lr:.2e}")
        step += 1
    torch.save({"cfg": cfg.to_dict(), "state": model.state_dict(), "steps": step}, os.path.join(args.out, f"{tag}.pt"))
    log(args.out, tag, f"done: {step} steps ({n_own} with own-rollout context) in {time.time() - t0:.0f} s")
    return model


@torch.no_grad()
def eval_dit(args, model, ae, dev, tag):
    """Held-out play through the engine loop (own context), decoded by the tiny decoder, against
    the renderer's frames: PSNR of the first second and of the 10th second."""
    lat = torch.load(os.path.join(args.out, "latents_heldout.pt"))
    z_all, rel = lat["z"].to(dev), lat["rel"]
    r_all, t_all = (a.to(dev) for a in rel_split(rel))
    frames, _ = load_split(args, "heldout")
    gen = torch.Generator(device=dev).manual_seed(args.seed + 7)
    model.eval()
    res = []
    for i in range(0, z_all.shape[0], 16):
        z = z_all[i:i + 16]
        cam = ray_tokens(r_all[i:i + 16], t_all[i:i + 16], H, W)
        tpf = (z.shape[-2] // 2) * (z.shape[-1] // 2)
        gz = rollout(model, z[:, :, 0], list(cam.split(CHUNK_FRAMES * tpf, 1)), z.shape[2] // CHUNK_FRAMES, dev, gen)
        with amp():
            y = ae.decode(gz).float()
        x = to_float(frames_to_gpu(frames[i:i + 16], dev))
        res.append(psnr(y, x))
    p = torch.cat(res)
    lz = None
    out = {"psnr_first_s": p[:, :16].mean().item(), "psnr_10th_s": p[:, 144:160].mean().item(),
           "psnr_last_s": p[:, -16:].mean().item(), "psnr_all": p.mean().item(),
           "psnr_per_second": [p[:, s * 16:(s + 1) * 16].mean().item() for s in range(p.shape[1] // 16)]}
    log(args.out, tag, f"held-out eval: {json.dumps(out)}")
    return out


# ---------------------------------------------------------------------------------- decoder
def load_dit_file(path, dev):
    sd, meta = load_safetensors(path)
    cfg = DitConfig(**json.loads(meta["config"])) if meta and "config" in meta else DitConfig(**DIT)
    model = WanDiT(cfg).to(dev)
    model.load_state_dict(sd)
    return model


def train_dec(args, gpu):
    """Fine-tunes the decoder (the encoder stays as it is: the DiT's first latent comes from it)
    on what it decodes at run time: the DiT's own rollouts through the engine loop, against the
    renderer's frames of those clips; a share of steps keeps the original objective (encoder
    latents + noise) so the first second, whose latents are near clean, stays as good."""
    dev = devn(gpu)
    torch.manual_seed(args.seed + 50)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 150)
    tag = "dec"
    ae = TinyAE(**AE).to(dev)
    ae.load_state_dict(torch.load(os.path.join(args.out, "ae.pt"), map_location="cpu"))
    dit = load_dit_file(args.init_dit, dev).eval()
    lat = torch.load(os.path.join(args.out, "latents_train.pt"))
    z_all, rel_all = lat["z"].to(dev), lat["rel"]
    r_all, t_all = (a.to(dev) for a in rel_split(rel_all))
    frames, _ = load_split(args, "train")
    n, _, nf, h, w = z_all.shape
    nc = nf // CHUNK_FRAMES
    tpf = (h // 2) * (w // 2)
    for p_ in ae.encoder.parameters():
        p_.requires_grad_(False)
    opt = torch.optim.AdamW(ae.decoder.parameters(), lr=args.dec_lr, weight_decay=0.0)
    B = args.dec_batch
    R = 8  # one rollout of B·R clips feeds R steps
    buf = []
    log(args.out, tag, f"decoder fine-tune on rollouts of {args.init_dit}: clips {n} batch {B} lr {args.dec_lr}")
    t0 = time.time()
    step = n_roll = 0
    while True:
        el = time.time() - t0
        if el > args.dit_seconds:
            break
        frac = el / args.dit_seconds
        lr = args.dec_lr * min(1.0, step / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        clean = torch.rand(()).item() < args.dec_clean_prob
        if clean:
            idx = torch.randint(0, n, (B,), device=dev)
            zin = z_all[idx]
            zin = zin + torch.randn_like(zin) * torch.rand(B, 1, 1, 1, 1, device=dev) * args.ae_latent_noise
        else:
            if not buf:
                big = torch.randint(0, n, (B * R,), device=dev)
                cam = ray_tokens(r_all[big], t_all[big], H, W)
                gz = rollout(dit, z_all[big][:, :, 0], list(cam.split(CHUNK_FRAMES * tpf, 1)), nc, dev, gen)
                buf = [(big[i * B:(i + 1) * B], gz[i * B:(i + 1) * B]) for i in range(R)]
                del cam
            idx, zin = buf.pop()
            n_roll += 1
        x = to_float(frames_to_gpu(frames[idx.cpu()], dev))
        with amp():
            y = ae.decode(zin)
        y = y.float()
        loss = F.mse_loss(y, x) + 0.2 * (y - x).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ae.decoder.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            with torch.no_grad():
                p = psnr(y.detach(), x)
            log(args.out, tag, f"step {step} t {el:.0f}s rollout {int(not clean)} loss {loss.item():.4f} "
                               f"psnr {p.mean().item():.2f} last s {p[:, -16:].mean().item():.2f} lr {lr:.2e}")
        step += 1
    torch.save(ae.state_dict(), os.path.join(args.out, "ae_dec.pt"))
    log(args.out, tag, f"done: {step} steps ({n_roll} on rollouts) in {time.time() - t0:.0f} s")
    ae.eval()
    res = eval_dit(args, dit, ae, dev, tag)
    base = TinyAE(**AE).to(dev)
    base.load_state_dict(torch.load(os.path.join(args.out, "ae.pt"), map_location="cpu"))
    res["init_decoder"] = eval_dit(args, dit, base.eval(), dev, "dec_baseline")
    with open(os.path.join(args.out, "eval_dec.json"), "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------------------------- export
def export(args, model, ae, name):
    os.makedirs(args.export_dir, exist_ok=True)
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_safetensors(sd, os.path.join(args.export_dir, "dit.safetensors"), {"config": json.dumps(model.cfg.to_dict())})
    ae_sd = {k: v.detach().float().cpu().contiguous() for k, v in ae.state_dict().items()}
    save_safetensors(ae_sd, os.path.join(args.export_dir, "ae.safetensors"), {"config": json.dumps(AE)})


# ---------------------------------------------------------------------------------- main
def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default="target/devbin/worker")
    p.add_argument("--out", required=True)
    p.add_argument("--data", default=None, help="dataset folder (default OUT/data)")
    p.add_argument("--stages", default="data,ae,latents,dit,eval,export")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=1024)
    p.add_argument("--heldout-clips", type=int, default=32)
    p.add_argument("--chunks", type=int, default=14)
    p.add_argument("--ae-seconds", type=float, default=150)
    p.add_argument("--ae-batch", type=int, default=16)
    p.add_argument("--ae-lr", type=float, default=2e-3)
    p.add_argument("--ae-latent-noise", type=float, default=0.15)
    p.add_argument("--dit-seconds", type=float, default=240)
    p.add_argument("--dit-batch", type=int, default=16)
    p.add_argument("--dit-lr", type=float, default=1e-3)
    p.add_argument("--rollout-after", type=float, default=0.4, help="fraction of DiT time before own-context rollouts")
    p.add_argument("--rollout-prob", type=float, default=0.3)
    p.add_argument("--rollout-reuse", type=int, default=1,
                   help="one rollout of batch×this clips feeds this many own-context steps")
    p.add_argument("--yaw-weight", type=float, default=0.0,
                   help="draw clips with probability ∝ 1 + this × (their mean turn per latent / A-D's)")
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--motion-weight", type=float, default=0.0,
                   help="weight of the frame-to-frame change loss inside chunks (against under-turning)")
    p.add_argument("--cam-lr-mult", type=float, default=1.0, help="learning-rate factor of the camera path")
    p.add_argument("--dec-finetune", action="store_true",
                   help="beside the DiTs, fine-tune the decoder on rollouts of --init-dit (export_dec/ae.safetensors)")
    p.add_argument("--dec-lr", type=float, default=3e-4)
    p.add_argument("--dec-batch", type=int, default=4, help="whole clips per decoder step")
    p.add_argument("--dec-clean-prob", type=float, default=0.25,
                   help="share of decoder steps on the encoder's latents (+ noise) instead of DiT rollouts")
    p.add_argument("--init-dit", default=None, help="start every DiT from this dit.safetensors (same config)")
    p.add_argument("--init-ae", default=None,
                   help="use this ae.safetensors (encoder.* and decoder.*) instead of training the autoencoder")
    p.add_argument("--dit-configs", default="base:{}", help="name:json;name:json — one DiT per GPU")
    p.add_argument("--dit-only", default=None, help="internal: train this name:json on --gpu")
    p.add_argument("--dec-only", action="store_true", help="internal: fine-tune the decoder on --gpu")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--export-dir", default=None)
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="wall budget of the whole run: AE and DiT times are set from what is left after the data "
                        "(1/3 and 2/3 of it, less --reserve-seconds)")
    p.add_argument("--reserve-seconds", type=float, default=70)
    a = p.parse_args()
    a.data = a.data or os.path.join(a.out, "data")
    a.export_dir = a.export_dir or os.path.join(a.out, "export")
    return a


def parse_configs(s):
    out = []
    for part in s.split(";"):
        name, js = part.split(":", 1)
        out.append((name, json.loads(js)))
    return out


def main():
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    dev = devn(0)
    if args.dec_only:
        train_dec(args, args.gpu)
        return
    if args.dit_only:
        name, over = parse_configs(args.dit_only)[0]
        model = train_dit(args, name, over, args.gpu)
        ae = TinyAE(**AE).to(devn(args.gpu))
        ae.load_state_dict(torch.load(os.path.join(args.out, "ae.pt"), map_location="cpu"))
        res = eval_dit(args, model, ae, devn(args.gpu), f"dit_{name}")
        with open(os.path.join(args.out, f"eval_{name}.json"), "w") as f:
            json.dump(res, f)
        return
    stages = args.stages.split(",")
    t_all = time.time()
    if "data" in stages:
        render(args)
    if args.budget_seconds:
        left = args.budget_seconds - (time.time() - t_all) - args.reserve_seconds
        args.ae_seconds, args.dit_seconds = (0, left) if args.init_ae else (left / 3, left * 2 / 3)
        log(args.out, "data", f"budget: AE {args.ae_seconds:.0f} s, DiT {args.dit_seconds:.0f} s")
    ae = None
    if args.init_ae:
        ae = TinyAE(**AE).to(dev)
        ae.load_state_dict(load_safetensors(args.init_ae)[0])
        torch.save(ae.state_dict(), os.path.join(args.out, "ae.pt"))
        log(args.out, "ae", f"autoencoder from {args.init_ae} (not trained)")
    elif "ae" in stages:
        ae = train_ae(args)
    if ae is None:
        ae = TinyAE(**AE).to(dev)
        ae.load_state_dict(torch.load(os.path.join(args.out, "ae.pt"), map_location="cpu"))
    ae.eval()
    if "latents" in stages:
        for split in ("train", "heldout"):
            z, rel = encode_all(args, ae, split, dev)
            torch.save({"z": z.cpu(), "rel": rel}, os.path.join(args.out, f"latents_{split}.pt"))
            log(args.out, "ae", f"{split} latents {tuple(z.shape)} mean {z.mean():.3f} std {z.std():.3f}")
        m = ae_metrics(args, ae, dev)
        log(args.out, "ae", f"held-out reconstruction: {json.dumps(m)}")
        with open(os.path.join(args.out, "eval_ae.json"), "w") as f:
            json.dump(m, f)
    if "dit" in stages:
        procs = []
        for gpu, (name, over) in enumerate(parse_configs(args.dit_configs)):
            cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--data", args.data,
                   "--dit-only", f"{name}:{json.dumps(over)}", "--gpu", str(gpu)]
            for k in ("seed", "dit_seconds") + TRAIN_KEYS:
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            if args.init_dit:
                cmd += ["--init-dit", args.init_dit]
            procs.append((name, subprocess.Popen(cmd)))
        if args.dec_finetune:
            if not args.init_dit:
                raise SystemExit("--dec-finetune needs --init-dit (the DiT whose rollouts it decodes)")
            cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--data", args.data, "--dec-only",
                   "--gpu", str(len(procs)), "--init-dit", args.init_dit]
            for k in ("seed", "dit_seconds", "dec_lr", "dec_batch", "dec_clean_prob", "ae_latent_noise"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            procs.append(("dec", subprocess.Popen(cmd)))
        failed = [name for name, p in procs if p.wait() != 0]
        if len(failed) == len(procs):
            raise SystemExit(f"every DiT failed: {failed}")
        for name in failed:  # the others still export
            log(args.out, "dit", f"DiT {name} failed")
    if "export" in stages:
        results = {}
        for name, _ in parse_configs(args.dit_configs):
            path = os.path.join(args.out, f"eval_{name}.json")
            if os.path.exists(path):
                results[name] = json.load(open(path))
        ae_m = json.load(open(os.path.join(args.out, "eval_ae.json")))
        print("\n| model | params | PSNR 1st s | PSNR 10th s | PSNR all |")
        print("|---|---|---|---|---|")
        print(f"| AE recon | - | {ae_m['ae_psnr_first_s']:.2f} | {ae_m['ae_psnr_last_s']:.2f} | {ae_m['ae_psnr_all']:.2f} |")
        trained = [name for name, _ in parse_configs(args.dit_configs)
                   if os.path.exists(os.path.join(args.out, f"dit_{name}.pt"))]
        for name, r in results.items():
            ck = torch.load(os.path.join(args.out, f"dit_{name}.pt"))
            npar = sum(v.numel() for v in ck["state"].values())
            print(f"| DiT {name} {ck['cfg']['dim']}×{ck['cfg']['num_layers']} | {npar} | {r['psnr_first_s']:.2f} | {r['psnr_10th_s']:.2f} | {r['psnr_all']:.2f} |")
        for name in trained:
            ck = torch.load(os.path.join(args.out, f"dit_{name}.pt"))
            model = WanDiT(DitConfig(**ck["cfg"]))
            model.load_state_dict(ck["state"])
            args.export_dir = os.path.join(args.out, f"export_{name}")
            export(args, model, ae, name)
        if os.path.exists(os.path.join(args.out, "ae_dec.pt")):
            ae_d = TinyAE(**AE)
            ae_d.load_state_dict(torch.load(os.path.join(args.out, "ae_dec.pt"), map_location="cpu"))
            os.makedirs(os.path.join(args.out, "export_dec"), exist_ok=True)
            sd = {k: v.detach().float().cpu().contiguous() for k, v in ae_d.state_dict().items()}
            save_safetensors(sd, os.path.join(args.out, "export_dec", "ae.safetensors"), {"config": json.dumps(AE)})
            if os.path.exists(os.path.join(args.out, "eval_dec.json")):
                r = json.load(open(os.path.join(args.out, "eval_dec.json")))
                print(f"| init DiT + fine-tuned decoder | - | {r['psnr_first_s']:.2f} | {r['psnr_10th_s']:.2f} | {r['psnr_all']:.2f} |")
        print(f"total {time.time() - t_all:.0f} s")


if __name__ == "__main__":
    main()
