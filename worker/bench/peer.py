"""PyTorch peer of `worker bench kernels`: the same shapes on the same card, in the same call.

Prints one line per measurement in the worker's format. Needs torch with CUDA."""
import json
import sys

import torch
import torch.nn.functional as F


def bench(fn, repeat=5):
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


rows = []
dev = "cuda"
for m, k, n in [(4680, 5120, 5120), (4680, 5120, 13824), (4680, 13824, 5120)]:
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    ms = bench(lambda: x @ w.t())
    rows.append((f"torch gemm bf16 {m}x{k}x{n}", ms, 2 * m * k * n / ms / 1e9))
for heads in [40, 12]:
    q = torch.randn(1, heads, 4680, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, heads, 28080, 128, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: F.scaled_dot_product_attention(q, kv, kv))
    rows.append((f"torch sdpa bf16 4680q x 28080k x {heads}h x 128", ms, 4 * 4680 * 28080 * heads * 128 / ms / 1e9))
for what, ms, tf in rows:
    print(f"{what}: {ms:.3f} ms, {tf:.1f} TFLOP/s")
if len(sys.argv) > 1:
    json.dump([{"what": w, "ms": m, "tflops": t} for w, m, t in rows], open(sys.argv[1], "w"), indent=1)
