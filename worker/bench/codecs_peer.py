"""PyTorch peer of `worker bench codecs`: the tiny decoder and encoder of the `taew2_1` layout
(`pipeline/train/taehv.py`, the same nets our training uses) on the same chunk shapes, same card,
same call. Eager PyTorch with cuDNN autotuning; random weights (timing only).

Prints one line per measurement in the worker's format and writes JSON to argv[1] if given."""
import json
import os
import sys

import torch

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


torch.backends.cudnn.benchmark = True
rows = []
for dtype, name in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
    ae = TinyAE(dec_widths=(256, 128, 64, 64), enc_widths=(64, 64, 64, 64), mem_blocks=3).cuda().to(dtype).eval()
    lat = torch.randn(1, 16, LATENTS, H // 8, W // 8, device="cuda", dtype=dtype)
    vid = torch.rand(1, 3, 4 * LATENTS, H, W, device="cuda", dtype=dtype)
    for what, fn in [("torch tiny decoder (taew2_1) decode", lambda: ae.decoder(lat)),
                     ("torch tiny encoder (taew2_1) encode", lambda: ae.encoder(vid))]:
        ms = bench(fn)
        print(f"{what} {name}: {ms:.2f} ms")
        rows.append({"what": what, "dtype": name, "ms": ms})
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
