"""PyTorch peer of `worker bench codecs`: the tiny decoder and encoder of the `taew2_1` layout
(`pipeline/train/taehv.py`, the same nets our training uses) on the same chunk shapes, same card,
same call. Eager PyTorch with cuDNN autotuning; random weights (timing only).

The text rows: one umT5-xxl prompt encode (HuggingFace transformers' `UMT5EncoderModel` at
Wan's umt5-xxl shape, random bf16 weights drawn on the GPU) of 128 and 512 random token ids with
an all-ones attention mask, batch 1, the same call as `worker bench codecs --codecs text`. Without
transformers installed the text rows are skipped with a message.

Usage: python3 codecs_peer.py [out.json] [--only all|coders|text]
Prints one line per measurement in the worker's format and writes JSON to the path if given."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "pipeline", "train"))
from taehv import TinyAE  # noqa: E402

H, W, LATENTS = 480, 832, 3


def bench(fn, repeat=5):
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeat):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            best = min(best, s.elapsed_time(e))
    return best


class CausalConv3d(torch.nn.Conv3d):
    """Wan's causal conv: time padded with `2·pad` frames before (zeros here: the streaming
    cache holds the previous chunk's frames, the same work)."""

    def __init__(self, cin, cout, k, pad):
        super().__init__(cin, cout, k)
        pt, ph, pw = pad
        self.pads = (pw, pw, ph, ph, 2 * pt, 0)

    def forward(self, x):
        return super().forward(F.pad(x, self.pads))


class ChannelNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = torch.nn.Parameter(torch.ones(dim, 1, 1, 1))
        self.scale = dim ** 0.5

    def forward(self, x):
        return F.normalize(x, dim=1) * self.scale * self.gamma


class Residual(torch.nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1, self.c1 = ChannelNorm(cin), CausalConv3d(cin, cout, 3, (1, 1, 1))
        self.n2, self.c2 = ChannelNorm(cout), CausalConv3d(cout, cout, 3, (1, 1, 1))
        self.skip = CausalConv3d(cin, cout, 1, (0, 0, 0)) if cin != cout else None

    def forward(self, x):
        h = self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))
        return h + (self.skip(x) if self.skip is not None else x)


class Attention(torch.nn.Module):
    """Single-head attention over each frame's pixels (Wan's AttentionBlock)."""

    def __init__(self, dim):
        super().__init__()
        self.norm, self.qkv, self.proj = ChannelNorm(dim), torch.nn.Conv2d(dim, 3 * dim, 1), torch.nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, t, h, w = x.shape
        y = self.norm(x).transpose(1, 2).reshape(b * t, c, h, w)
        q, k, v = self.qkv(y).reshape(b * t, 3, c, h * w).permute(1, 0, 3, 2).unsqueeze(2).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        return x + self.proj(a).reshape(b, t, c, h, w).transpose(1, 2)


class Upsample(torch.nn.Module):
    """Nearest ×2 in space and a 3×3 conv to half the channels; `temporal` first doubles the
    frames with a causal time conv (2·dim channels → two frames each)."""

    def __init__(self, dim, temporal):
        super().__init__()
        self.time = CausalConv3d(dim, 2 * dim, (3, 1, 1), (1, 0, 0)) if temporal else None
        self.conv = torch.nn.Conv2d(dim, dim // 2, 3, padding=1)

    def forward(self, x):
        b, c, t, h, w = x.shape
        if self.time is not None:
            x = self.time(x).reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
            t *= 2
        y = F.interpolate(x.transpose(1, 2).reshape(b * t, c, h, w), scale_factor=2.0, mode="nearest")
        y = self.conv(y)
        return y.reshape(b, t, c // 2, 2 * h, 2 * w).transpose(1, 2)


def wan21_decoder(dim=96, mult=(1, 2, 4, 4), z=16, res_blocks=2, temporal=(True, True, False)):
    """Wan2.1's VAE decoder (conv2 1×1 on the latents, conv1, middle, upsamples, head), by the
    layout `pipeline/src/vae/coder.rs` loads."""
    dims = [dim * u for u in (mult[-1],) + tuple(reversed(mult))]
    layers = [CausalConv3d(z, z, 1, (0, 0, 0)), CausalConv3d(z, dims[0], 3, (1, 1, 1)),
              Residual(dims[0], dims[0]), Attention(dims[0]), Residual(dims[0], dims[0])]
    for i in range(len(mult)):
        cin = dims[0] if i == 0 else dims[i] // 2
        for _ in range(res_blocks + 1):
            layers.append(Residual(cin, dims[i + 1]))
            cin = dims[i + 1]
        if i + 1 < len(mult):
            layers.append(Upsample(dims[i + 1], temporal[i]))
    layers += [ChannelNorm(dims[-1]), torch.nn.SiLU(), CausalConv3d(dims[-1], 3, 3, (1, 1, 1))]
    return torch.nn.Sequential(*layers)


def coder_rows(rows):
    torch.backends.cudnn.benchmark = True
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
        ae = TinyAE(dec_widths=(256, 128, 64, 64), enc_widths=(64, 64, 64, 64), mem_blocks=3).cuda().to(dtype).eval()
        lat = torch.randn(1, 16, LATENTS, H // 8, W // 8, device="cuda", dtype=dtype)
        vid = torch.rand(1, 3, 4 * LATENTS, H, W, device="cuda", dtype=dtype)
        for what, fn in [("torch tiny decoder (taew2_1) decode", lambda: ae.decoder(lat)),
                         ("torch tiny encoder (taew2_1) encode", lambda: ae.encoder(vid))]:
            ms = bench(fn)
            print(f"{what} {name}: {ms:.2f} ms")
            rows.append({"what": what, "dtype": name, "ms": ms})
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
        dec = wan21_decoder().cuda().to(dtype).eval()
        lat = torch.randn(1, 16, LATENTS, H // 8, W // 8, device="cuda", dtype=dtype)
        what = "torch Wan2.1 VAE decode"
        ms = bench(lambda: dec(lat), repeat=3)
        print(f"{what} {name}: {ms:.2f} ms")
        rows.append({"what": what, "dtype": name, "ms": ms})


# Wan's umt5-xxl (encoder half), as `pipeline/src/text` `T5Config::umt5_xxl` has it.
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                is_encoder_decoder=False, use_cache=False)
TEXT_TOKENS = (128, 512)


def text_rows(rows, repeat=5):
    try:
        from transformers import UMT5Config, UMT5EncoderModel
    except ImportError as e:
        print(f"umT5-xxl prompt encode skipped: transformers is not importable ({e})")
        return
    cfg = UMT5Config(**UMT5_XXL)
    torch.cuda.synchronize()
    t = time.perf_counter()
    # Built on the GPU in bf16 directly: no 23 GB f32 copy, no CPU init of 5.7B parameters.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = UMT5EncoderModel(cfg)
    except Exception as e:  # a transformers version that insists on f32 init: 23 GB fits the card
        print(f"umT5 built in bf16 failed ({e}); building in f32 on the GPU, then casting")
        torch.set_default_dtype(prev)
        with torch.device("cuda"):
            model = UMT5EncoderModel(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    torch.cuda.synchronize()
    ready = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    print(f"torch umT5-xxl ({params / 1e9:.2f}B parameters, transformers UMT5EncoderModel) "
          f"ready (random bf16 weights on the GPU) in {ready:.1f} s")
    g = torch.Generator().manual_seed(11)
    for n in TEXT_TOKENS:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g).cuda()
        mask = torch.ones(1, n, dtype=torch.long, device="cuda")
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert tuple(out.shape) == (1, n, cfg.d_model), out.shape
        # Built in 0.1 s on an H200: say whether the weights were really initialised (finite,
        # spread outputs), so the time is not of a model computing on garbage.
        finite, spread = bool(torch.isfinite(out).all()), float(out.float().std())
        print(f"umT5-xxl peer output ({n} tokens): finite {finite}, std {spread:.3g}")
        what = f"torch umT5-xxl prompt encode ({n} tokens)"
        ms = bench(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state, repeat=repeat)
        print(f"{what} bf16: {ms:.2f} ms")
        rows.append({"what": what, "dtype": "bf16", "ms": ms, "ready_s": ready})
    del model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", help="also write the rows as JSON here")
    ap.add_argument("--only", choices=("all", "coders", "text"), default="all",
                    help="coders: the tiny decoder/encoder and the Wan2.1 VAE decoder; text: the umT5-xxl "
                         "prompt encode; all (default): both")
    ap.add_argument("--repeat", type=int, default=5, help="text rows: timed encodes (the best is reported)")
    args = ap.parse_args()
    rows = []
    if args.only in ("all", "coders"):
        coder_rows(rows)
    if args.only in ("all", "text"):
        text_rows(rows, repeat=max(1, args.repeat))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
