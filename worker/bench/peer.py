"""PyTorch peer of `worker bench kernels`: the same shapes on the same card, in the same call.

Prints one line per measurement in the worker's format; `--blocks` runs only the DiT block rows
(`worker bench blocks`'s peer). Usage: peer.py [OUT.json] [--blocks]. Needs torch with CUDA."""
import json
import sys
import time

import torch
import torch.nn.functional as F


def bench(fn, repeat=5, calls=1, label=None):
    """Best over `repeat` rounds of the mean CUDA-event time of `calls` calls queued back to back
    (worker's `time`, or its `time_queued` for the short ops), after one warm-up call. With a
    `label`, also prints the rounds' spread as `worker bench kernels` does."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / calls)
    times.sort()
    if label:
        print(f"{label} spread: {repeat} rounds: best {times[0]:.3f}, median {times[len(times) // 2]:.3f}, "
              f"worst {times[-1]:.3f} ms")
    return times[0]


def sustained(fn, seconds=2.0):
    """Mean time of `fn` called back to back for `seconds` (host clock, a synchronisation every 8
    calls), and the number of calls: `worker bench kernels`' sustained rows, the speed a stream
    sees once the card's power management has settled."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    # The window on the wall clock, to line up with a power trace taken beside the bench.
    end = time.time()
    print(f"sustained window: unix {end - secs:.3f} to {end:.3f}, {n} calls, {secs * 1e3 / n:.4f} ms a call")
    return secs * 1e3 / n, n


# Rounds of the attention and block rows, long ops on a card whose speed drifts by 5–10 % over
# tens of milliseconds: a best of 5 (~40 ms of a 14B block) can land wholly in a slow stretch.
# `worker bench kernels` takes the same number (its PEER_REPEAT), so both sides draw their best
# from as many runs.
HEAVY = 20

rows = []
dev = "cuda"
# `--blocks`: only the block rows (beside `worker bench blocks`).
BLOCKS_ONLY = "--blocks" in sys.argv[1:]
OUT = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
if not BLOCKS_ONLY:
    for m, k, n in [(4680, 5120, 5120), (4680, 5120, 13824), (4680, 13824, 5120)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        ms = bench(lambda: x @ w.t())
        rows.append((f"torch gemm bf16 {m}x{k}x{n}", ms, 2 * m * k * n / ms / 1e9))
        xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        ms = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        rows.append((f"torch _scaled_mm fp8 Tensorwise {m}x{k}x{n}", ms, 2 * m * k * n / ms / 1e9))
        sa, sb = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
        try:
            ms = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            rows.append((f"torch _scaled_mm fp8 Rowwise {m}x{k}x{n}", ms, 2 * m * k * n / ms / 1e9))
            # Beside `bench gemm-algos`' fast-accumulation rows (torchao's forward default).
            ms = bench(
                lambda: torch._scaled_mm(
                    xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True
                )
            )
            rows.append((f"torch _scaled_mm fp8 Rowwise fast-accum {m}x{k}x{n}", ms, 2 * m * k * n / ms / 1e9))
        except RuntimeError as e:
            print(f"rowwise _scaled_mm unavailable: {e}")
    x = torch.randn(4680, 5120, device=dev)
    sh, sc = torch.randn(5120, device=dev) * 0.1, torch.randn(5120, device=dev) * 0.1
    ms = bench(lambda: (F.layer_norm(x, (5120,), eps=1e-6) * (1 + sc) + sh).to(torch.bfloat16), calls=20)
    rows.append(("torch norm+modulate f32 -> bf16 4680x5120", ms, 0.0))


    def fp8_rows(x):
        y = F.layer_norm(x, (5120,), eps=1e-6) * (1 + sc) + sh
        s = (y.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        return (y / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


    ms = bench(lambda: fp8_rows(x), calls=20)
    rows.append(("torch norm+modulate f32 -> fp8 rowwise 4680x5120", ms, 0.0))
    for heads in [40, 12]:
        q = torch.randn(1, heads, 4680, 128, device=dev, dtype=torch.bfloat16)
        # Keys and values apart, as ours (`bench kernels` draws q, k and v each): one tensor as both
        # could let SDPA find its values in L2, read there a moment before as keys.
        k = torch.randn(1, heads, 28080, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, heads, 28080, 128, device=dev, dtype=torch.bfloat16)
        ms = bench(lambda: F.scaled_dot_product_attention(q, k, v), repeat=HEAVY, label=f"torch sdpa {heads} heads")
        rows.append((f"torch sdpa bf16 4680q x 28080k x {heads}h x 128", ms, 4 * 4680 * 28080 * heads * 128 / ms / 1e9))
        ms, calls = sustained(lambda: F.scaled_dot_product_attention(q, k, v))
        rows.append((f"torch sdpa bf16 4680q x 28080k x {heads}h x 128, sustained ({calls} back to back)", ms,
                     4 * 4680 * 28080 * heads * 128 / ms / 1e9))


def rope_tables(grid, hd, t0):
    """cos and sin, [n, 1, hd / 2] f32, of Wan's 3-D RoPE for the tokens of `grid` from frame
    `t0`: the rotated pairs split over t, h and w as hd - 4·(hd // 6), 2·(hd // 6), 2·(hd // 6)
    dims, each axis with its own frequencies (base 10000)."""
    def angles(dims, pos):
        inv = 1.0 / 10000 ** (torch.arange(0, dims, 2, device=dev, dtype=torch.float64) / dims)
        return pos.flatten()[:, None].double() * inv[None]
    t, h, w = grid
    tt, yy, xx = torch.meshgrid(torch.arange(t0, t0 + t, device=dev), torch.arange(h, device=dev),
                                torch.arange(w, device=dev), indexing="ij")
    ang = torch.cat([angles(hd - 4 * (hd // 6), tt), angles(2 * (hd // 6), yy), angles(2 * (hd // 6), xx)], 1)
    return ang.cos().float()[:, None], ang.sin().float()[:, None]


def rope(x, cos, sin):
    """x [n, heads, d] rotated pair by pair (adjacent elements, Wan's complex view), bf16 out."""
    n, h, d = x.shape
    p = x.float().view(n, h, d // 2, 2)
    a, b = p[..., 0], p[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).view(n, h, d).bfloat16()


class Block(torch.nn.Module):
    """An eager LingBot block as the reference implementations run it: bf16 linears, f32
    modulation, SDPA over the cached window (K/V of earlier frames given), text cross-attention
    (text K/V cached), camera scale/shift (cached per chunk, as ours), GELU FFN.

    Two ways to the window. Without `rot`: no RoPE, and the window is the cached K/V joined
    to the chunk's by `torch.cat` (a copy of the whole window each call). With `rot` (the
    tables of `rope_tables`): q and k get Wan's 3-D RoPE, and the chunk's K/V are written into
    the last rows of `kc`/`vc`, the whole window preallocated, as the streaming reference code
    writes its cache: the work our block does."""

    def __init__(self, dim, ffn, heads):
        super().__init__()
        L = lambda i, o: torch.nn.Linear(i, o, dtype=torch.bfloat16, device=dev)
        self.heads = heads
        self.q, self.k, self.v, self.o = L(dim, dim), L(dim, dim), L(dim, dim), L(dim, dim)
        self.cq, self.co = L(dim, dim), L(dim, dim)
        self.f0, self.f2 = L(dim, ffn), L(ffn, dim)
        self.nq = torch.nn.RMSNorm(dim, eps=1e-6, dtype=torch.bfloat16, device=dev)
        self.nk = torch.nn.RMSNorm(dim, eps=1e-6, dtype=torch.bfloat16, device=dev)
        self.n3 = torch.nn.LayerNorm(dim, eps=1e-6, dtype=torch.bfloat16, device=dev)

    def forward(self, x, e, kc, vc, tk, tv, cam_scale, cam_shift, rot=None):
        n, d = x.shape
        h = self.heads
        y = (F.layer_norm(x.float(), (d,)) * (1 + e[1]) + e[0]).bfloat16()
        if rot is None:
            q = self.nq(self.q(y)).view(1, n, h, -1).transpose(1, 2)
            k = self.nk(self.k(y)).view(1, n, h, -1).transpose(1, 2)
            v = self.v(y).view(1, n, h, -1).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2))
        else:
            q = rope(self.nq(self.q(y)).view(n, h, -1), *rot).transpose(0, 1)[None]
            kc[0, :, -n:] = rope(self.nk(self.k(y)).view(n, h, -1), *rot).transpose(0, 1)
            vc[0, :, -n:] = self.v(y).view(n, h, -1).transpose(0, 1)
            a = F.scaled_dot_product_attention(q, kc, vc)
        x = x + self.o(a.transpose(1, 2).reshape(n, d)).float() * e[2]
        x = (1 + cam_scale) * x + cam_shift
        cq = self.cq(self.n3(x.bfloat16())).view(1, n, h, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(cq, tk, tv)
        x = x + self.co(a.transpose(1, 2).reshape(n, d)).float()
        y = (F.layer_norm(x.float(), (d,)) * (1 + e[4]) + e[3]).bfloat16()
        return x + self.f2(F.gelu(self.f0(y), approximate="tanh")).float() * e[5]


def fp8_per_row(t):
    """fp8 e4m3 codes and f32 scales per row of a 2-D tensor (FastVideo's rowwise rule)."""
    s = (t.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
    return (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


class Fp8Linear(torch.nn.Module):
    """A Linear as fp8 rowwise `torch._scaled_mm`: the weight per output channel once, the
    activation per token on every call (the quantization as PyTorch ops, which torch.compile
    may fuse into the op before), bias in the GEMM, bf16 out."""

    def __init__(self, lin):
        super().__init__()
        self.wq, ws = fp8_per_row(lin.weight.detach())
        self.ws = ws.t().contiguous()
        self.bias = lin.bias.detach()

        # Some builds refuse a bias with rowwise scales: then it is added after the GEMM.
        try:
            probe = torch.zeros(16, self.wq.shape[1], device=dev, dtype=torch.float8_e4m3fn)
            ones = torch.ones(16, 1, device=dev)
            torch._scaled_mm(probe, self.wq.t(), scale_a=ones, scale_b=self.ws, bias=self.bias, out_dtype=torch.bfloat16)
            self.fused_bias = True
        except RuntimeError:
            self.fused_bias = False

    def forward(self, x):
        xq, xs = fp8_per_row(x.reshape(-1, x.shape[-1]))
        b = self.bias if self.fused_bias else None
        y = torch._scaled_mm(xq, self.wq.t(), scale_a=xs, scale_b=self.ws, bias=b, out_dtype=torch.bfloat16)
        if not self.fused_bias:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def to_fp8(blk):
    for name in ["q", "k", "v", "o", "cq", "co", "f0", "f2"]:
        setattr(blk, name, Fp8Linear(getattr(blk, name)))
    return blk


with torch.no_grad():
    for name, dim, ffn, heads in [("lingbot-1.3b", 1536, 8960, 12), ("lingbot-14b", 5120, 13824, 40)]:
        blk = Block(dim, ffn, heads)
        n, hd = 4680, 128
        x = torch.randn(n, dim, device=dev)
        e = torch.randn(6, dim, device=dev) * 0.1
        kc = torch.randn(1, heads, 28080 - n, hd, device=dev, dtype=torch.bfloat16)
        tk = torch.randn(1, heads, 512, hd, device=dev, dtype=torch.bfloat16)
        cs = torch.randn(n, dim, device=dev) * 0.1
        # The whole window for the RoPE variant, which writes the chunk's rows itself.
        kw = torch.randn(1, heads, 28080, hd, device=dev, dtype=torch.bfloat16)
        vw = torch.randn(1, heads, 28080, hd, device=dev, dtype=torch.bfloat16)
        rot = rope_tables((3, 30, 52), hd, 15)
        fl = 2 * n * dim * dim * 6 + 4 * n * dim * ffn + 4 * n * 28080 * dim + 4 * n * 512 * dim

        def block_rows(what, fn):
            """Two rows of one block variant: best of HEAVY rounds, and 2 s back to back."""
            ms = bench(fn, repeat=HEAVY, label=what)
            rows.append((f"{what}, 4680 tokens, 18-frame window", ms, fl / ms / 1e9))
            ms, calls = sustained(fn)
            rows.append((f"{what}, sustained ({calls} back to back), 4680 tokens, 18-frame window", ms, fl / ms / 1e9))

        block_rows(f"torch eager {name} block", lambda: blk(x, e, kc, kc, tk, tk, cs, cs))
        # The same block through torch.compile (Inductor fuses the element-wise ops around the
        # GEMMs and SDPA); the first calls compile, bench() warms up before timing.
        try:
            cblk = torch.compile(blk)
            block_rows(f"torch compile {name} block", lambda: cblk(x, e, kc, kc, tk, tk, cs, cs))
            block_rows(f"torch compile {name} block, RoPE, cache written in place",
                       lambda: cblk(x, e, kw, vw, tk, tk, cs, cs, rot))
        except Exception as err:  # a missing compiler toolchain must not cost the other rows
            print(f"torch.compile {name} block failed: {err}", file=sys.stderr)
        # The same block with fp8 rowwise linears, eager and compiled (the fp8 peers).
        try:
            fblk = to_fp8(blk)
            block_rows(f"torch eager fp8 rowwise {name} block", lambda: fblk(x, e, kc, kc, tk, tk, cs, cs))
            cfblk = torch.compile(fblk)
            block_rows(f"torch compile fp8 rowwise {name} block", lambda: cfblk(x, e, kc, kc, tk, tk, cs, cs))
            block_rows(f"torch compile fp8 rowwise {name} block, RoPE, cache written in place",
                       lambda: cfblk(x, e, kw, vw, tk, tk, cs, cs, rot))
        except Exception as err:
            print(f"fp8 rowwise {name} block failed: {err}", file=sys.stderr)

for what, ms, tf in rows:
    print(f"{what}: {ms:.3f} ms, {tf:.1f} TFLOP/s")
if OUT:
    json.dump([{"what": w, "ms": m, "tflops": t} for w, m, t in rows], open(OUT, "w"), indent=1)
