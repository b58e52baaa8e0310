"""The LingBot/Wan I2V DiT of `pipeline/src/model/` in PyTorch, with the same checkpoint names.

The math follows the Rust code line by line (MODELS.md §2): per-token time modulation in f32,
LayerNorm without affine before self-attention and the FFN, RMSNorm over the full dim on q/k,
3-D RoPE (time axis at the absolute latent-frame index), LingBot's camera scale/shift after
self-attention, cross-attention to the (padded) text context, head modulated by `e`.

Two ways to run it:
- `forward(...)` over a whole token sequence with an explicit frame-level attention mask and a
  timestep per frame: the training form (clean context and noisy chunks side by side).
- `StreamCache` + `forward(..., cache=...)`: the engine's streaming form (sink + rolling window,
  keys stored after RoPE, the chunk's slots rewritten by every step and by the t=0 refresh).
`check_parity.py` proves both equal to the NumPy reference `pipeline/tests/ref/lingbot_ref.py`,
and the training form equal to the streaming form.
"""
import math
from dataclasses import dataclass, field, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

LATENT = 16
MASK = 4


@dataclass
class DitConfig:
    dim: int = 128
    ffn_dim: int = 256
    num_heads: int = 4
    num_layers: int = 2
    in_dim: int = 36
    out_dim: int = 16
    text_dim: int = 64
    text_len: int = 32
    freq_dim: int = 256
    eps: float = 1e-6
    control_dim: int = 6

    @property
    def head_dim(self):
        return self.dim // self.num_heads

    def to_dict(self):
        return asdict(self)


def sinusoid(t, freq_dim):
    """`cat(cos(t·f), sin(t·f))`, f_i = 10000^(-i/half), computed in f64 as the Rust does."""
    half = freq_dim // 2
    t = t.to(torch.float64)
    f = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    a = t[..., None] * f
    return torch.cat([torch.cos(a), torch.sin(a)], -1).to(torch.float32)


def rope_freqs(head_dim, device):
    """Per complex pair, (axis, frequency): first c_t pairs time, then c_h rows, c_w columns."""
    d = head_dim
    dt, dhw = d - 4 * (d // 6), 2 * (d // 6)

    def fr(da):
        return 1.0 / torch.pow(10000.0, torch.arange(0, da, 2, dtype=torch.float64, device=device) / da)

    return fr(dt), fr(dhw)


def rope_angles(head_dim, frame_pos, hp, wp, device):
    """Angles [L, head_dim/2] for tokens ordered (frame, row, col); frame_pos: [F] absolute."""
    ft, fhw = rope_freqs(head_dim, device)
    fpos = frame_pos.to(device=device, dtype=torch.float64)
    nf = fpos.shape[0]
    f = fpos[:, None, None].expand(nf, hp, wp).reshape(-1, 1)
    h = torch.arange(hp, dtype=torch.float64, device=device)[None, :, None].expand(nf, hp, wp).reshape(-1, 1)
    w = torch.arange(wp, dtype=torch.float64, device=device)[None, None, :].expand(nf, hp, wp).reshape(-1, 1)
    return torch.cat([f * ft, h * fhw, w * fhw], 1)


def rope_apply(x, cos, sin):
    """x [B, L, H, D]; pairs (x[2j], x[2j+1]) rotated by the angle; cos/sin [L, D/2] (f32)."""
    re, im = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([re * c - im * s, re * s + im * c], -1)
    return out.flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def layer_norm(x, eps):
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


class Attention(nn.Module):
    """q, k, v, o with bias; RMSNorm on q and k over the full dim (self- and cross-attention)."""

    def __init__(self, dim, heads, eps):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)
        self.heads = heads

    def split(self, t):
        b, l, d = t.shape
        return t.view(b, l, self.heads, d // self.heads)


class StreamCache:
    """One KV cache per layer as the engine keeps it: frames in order, the first `sink` frames
    kept for good, the oldest others evicted when more than `window` frames are held; rewriting
    a held frame overwrites it in place. Keys are stored after RoPE."""

    def __init__(self, num_layers, window, sink, tokens_per_frame):
        self.layers = [dict(frames=[], k=None, v=None) for _ in range(num_layers)]
        self.window, self.sink, self.tpf = window, sink, tokens_per_frame

    def write(self, layer, frames, k, v):
        """k, v: [B, len(frames)·tpf, H, D]; returns all held K/V."""
        st = self.layers[layer]
        tpf = self.tpf
        held = st["frames"]
        if st["k"] is None:
            st["k"], st["v"] = k[:, :0], v[:, :0]
        ks = list(st["k"].split(tpf, 1)) if held else []
        vs = list(st["v"].split(tpf, 1)) if held else []
        for i, f in enumerate(frames):
            kf, vf = k[:, i * tpf:(i + 1) * tpf], v[:, i * tpf:(i + 1) * tpf]
            if f in held:
                j = held.index(f)
                ks[j], vs[j] = kf, vf
            else:
                held.append(f)
                ks.append(kf)
                vs.append(vf)
        while len(held) > self.window:
            del held[self.sink], ks[self.sink], vs[self.sink]
        st["k"], st["v"] = torch.cat(ks, 1), torch.cat(vs, 1)
        return st["k"], st["v"]

    def frames(self, layer=0):
        return list(self.layers[layer]["frames"])


class Block(nn.Module):
    def __init__(self, cfg: DitConfig):
        super().__init__()
        d = cfg.dim
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)
        self.self_attn = Attention(d, cfg.num_heads, cfg.eps)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = Attention(d, cfg.num_heads, cfg.eps)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d))
        self.cam_injector_layer1 = nn.Linear(d, d)
        self.cam_injector_layer2 = nn.Linear(d, d)
        self.cam_scale_layer = nn.Linear(d, d)
        self.cam_shift_layer = nn.Linear(d, d)
        self.eps = cfg.eps

    def cam_scale_shift(self, cond):
        h = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(cond))) + cond
        return self.cam_scale_layer(h), self.cam_shift_layer(h)

    def forward(self, x, e0, rope_cs, text_kv, cam, attn_mask=None, cache=None, layer=0, frames=None):
        """x [B, L, dim]; e0 [B, L, 6, dim] (f32, modulation added here); rope_cs (cos, sin)."""
        m = self.modulation.float() + e0
        sh_a, sc_a, g_a, sh_f, sc_f, g_f = m.unbind(2)
        sa = self.self_attn
        h = (layer_norm(x, self.eps) * (1 + sc_a) + sh_a).to(x.dtype)
        q = sa.split(sa.norm_q(sa.q(h)))
        k = sa.split(sa.norm_k(sa.k(h)))
        v = sa.split(sa.v(h))
        cos, sin = rope_cs
        q, k = rope_apply(q, cos, sin), rope_apply(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, frames, k, v)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
        o = sa.o(o.transpose(1, 2).flatten(2))
        x = (x.float() + g_a * o.float()).to(x.dtype)
        if cam is not None:
            scale, shift = cam
            x = (1 + scale) * x + shift
        ca = self.cross_attn
        h = self.norm3(x)
        q = ca.split(ca.norm_q(ca.q(h)))
        tk, tv = text_kv
        o = F.scaled_dot_product_attention(q.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2))
        x = x + ca.o(o.transpose(1, 2).flatten(2))
        h = (layer_norm(x, self.eps) * (1 + sc_f) + sh_f).to(x.dtype)
        return (x.float() + g_f * self.ffn(h).float()).to(x.dtype)


class Head(nn.Module):
    def __init__(self, cfg: DitConfig):
        super().__init__()
        self.head = nn.Linear(cfg.dim, 4 * cfg.out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim ** 0.5)


class WanDiT(nn.Module):
    def __init__(self, cfg: DitConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, (1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.patch_embedding_wancamctrl = nn.Linear(cfg.control_dim * 256, d)
        self.c2ws_hidden_states_layer1 = nn.Linear(d, d)
        self.c2ws_hidden_states_layer2 = nn.Linear(d, d)

    # ---------------------------------------------------------------- context pieces
    def text_kv(self, context):
        """context [B, n ≤ text_len, text_dim] → per block (k, v) [B, text_len, H, D]."""
        b, n, td = context.shape
        if n < self.cfg.text_len:
            context = torch.cat([context, context.new_zeros(b, self.cfg.text_len - n, td)], 1)
        text = self.text_embedding(context)
        out = []
        for blk in self.blocks:
            ca = blk.cross_attn
            out.append((ca.split(ca.norm_k(ca.k(text))), ca.split(ca.v(text))))
        return out

    def camera_mods(self, tokens):
        """Folded ray tokens [B, L, control_dim·256] → per block (scale, shift) [B, L, dim]."""
        emb = self.patch_embedding_wancamctrl(tokens)
        cond = emb + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(emb)))
        return [blk.cam_scale_shift(cond) for blk in self.blocks]

    def time_mods(self, t):
        """t [...] → (e [..., dim], e0 [..., 6, dim]) in f32."""
        with torch.autocast(device_type=t.device.type, enabled=False):
            s = sinusoid(t, self.cfg.freq_dim)
            e = self.time_embedding(s)
            e0 = self.time_projection(e).unflatten(-1, (6, self.cfg.dim))
        return e.float(), e0.float()

    # ---------------------------------------------------------------- forward
    def forward(self, x, t_frames, frame_pos, text_kv, cam_mods, attn_mask=None, cache=None, kv_only=False):
        """x [B, in_dim, F, H, W]; t_frames [B, F] timestep of each latent frame; frame_pos [F]
        absolute latent index (RoPE time, cache slot); attn_mask [L, L] bool (True = attend) or
        None; cache a StreamCache (keys of earlier chunks) or None. Returns velocity
        [B, out_dim, F, H, W] (None with kv_only)."""
        cfg = self.cfg
        b, _, nf, hh, ww = x.shape
        hp, wp = hh // 2, ww // 2
        tpf = hp * wp
        tok = self.patch_embedding(x).flatten(2).transpose(1, 2)  # [B, L, dim], (f, h, w) order
        e, e0 = self.time_mods(t_frames)  # [B, F, dim], [B, F, 6, dim]
        e0 = e0.repeat_interleave(tpf, 1)
        ang = rope_angles(cfg.head_dim, frame_pos, hp, wp, x.device)
        rope_cs = (torch.cos(ang).float(), torch.sin(ang).float())
        frames = [int(f) for f in frame_pos] if cache is not None else None
        h = tok.float()
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            if kv_only and i == last:
                # Only the last block's cache write is needed: run its K/V path alone.
                m = blk.modulation.float() + e0
                sh_a, sc_a = m[:, :, 0], m[:, :, 1]
                hn = (layer_norm(h, blk.eps) * (1 + sc_a) + sh_a).to(h.dtype)
                sa = blk.self_attn
                k = rope_apply(sa.split(sa.norm_k(sa.k(hn))), *rope_cs)
                cache.write(i, frames, k, sa.split(sa.v(hn)))
                return None
            h = blk(h, e0, rope_cs, text_kv[i], cam_mods[i] if cam_mods is not None else None,
                     attn_mask=attn_mask, cache=cache, layer=i, frames=frames)
        mh = self.head.modulation.float() + e[:, :, None, :]  # [B, F, 2, dim]
        sh = mh[:, :, 0].repeat_interleave(tpf, 1)
        sc = mh[:, :, 1].repeat_interleave(tpf, 1)
        y = (layer_norm(h, cfg.eps) * (1 + sc) + sh).to(h.dtype)
        y = self.head.head(y)  # [B, L, 4·out] ordered (q, r, c)
        y = y.view(b, nf, hp, wp, 2, 2, cfg.out_dim).permute(0, 6, 1, 2, 4, 3, 5)
        return y.reshape(b, cfg.out_dim, nf, hh, ww)


# ---------------------------------------------------------------- masks
def chunk_mask(n_chunks, chunk_frames, tokens_per_frame, window_frames, sink_frames, device):
    """Which chunk's keys the engine's chunk `i` sees: itself, and earlier chunk `j` while the
    cache still holds it (sink frames forever, then the most recent that fit the window).
    Returns [n_chunks, n_chunks] bool (row = query chunk)."""
    vis = torch.zeros(n_chunks, n_chunks, dtype=torch.bool)
    for i in range(n_chunks):
        held = []
        for j in range(i + 1):
            held.extend((j, f) for f in range(chunk_frames))
            while len(held) > window_frames:
                del held[sink_frames]
        for j, _ in held:
            vis[i, j] = True
    return vis.to(device)


def teacher_forcing_mask(n_chunks, chunk_frames, tpf, window_frames, sink_frames, device):
    """Token mask of the training sequence [clean chunks ; noisy chunks] (2·n·C frames).

    Clean chunk i is the engine's t=0 refresh of chunk i: it sees clean chunks visible to i and
    itself. Noisy chunk i is a denoising step of chunk i: it sees the clean chunks visible to i
    except itself (the cache slots of chunk i hold the current step's K/V) and its own tokens."""
    vis = chunk_mask(n_chunks, chunk_frames, tpf, window_frames, sink_frames, "cpu")
    eye = torch.eye(n_chunks, dtype=torch.bool)
    top = torch.cat([vis, torch.zeros_like(vis)], 1)
    bot = torch.cat([vis & ~eye, eye], 1)
    m = torch.cat([top, bot], 0)  # [2n, 2n] chunks
    rep = chunk_frames * tpf
    return m.repeat_interleave(rep, 0).repeat_interleave(rep, 1).to(device)
