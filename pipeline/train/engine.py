"""The engine's flow schedule and chunk loop (`pipeline/src/sampler.rs`, `pipeline/src/engine.rs`).

Schedule: base σ linearly from 0.999 to 0 over 1000 entries, shifted σ' = s·σ/(1+(s−1)·σ),
timesteps = ⌊σ'·1000⌋ (they repeat). A step at t turns the velocity into x0 with the σ of the
first entry whose timestep is t; the re-noise to the next t uses the second such entry.
Per chunk: x = noise; for t in steps: x0 = x − σ₁(t)·v; x = (1−σ₂(t'))·x0 + σ₂(t')·noise';
then a t = 0 pass rewrites the chunk's K/V from x0.
"""
import torch

from dit import MASK, LATENT, StreamCache

STEP_INDICES = (0, 250, 500, 750)
SHIFT = 10.0
CHUNK_FRAMES = 3
WINDOW_FRAMES = 18
SINK_FRAMES = 6


class Schedule:
    def __init__(self, shift=SHIFT, n=1000, indices=STEP_INDICES):
        base = [0.0 if i + 1 == n else 0.999 + i * (-0.999 / (n - 1)) for i in range(n)]
        self.sigmas = [shift * b / (1 + (shift - 1) * b) for b in base]
        self.timesteps = [int(s * 1000) for s in self.sigmas]
        self.steps = [self.timesteps[i] for i in indices]

    def matches(self, t):
        return [i for i, x in enumerate(self.timesteps) if x == t]

    def sigma_first(self, t):
        return self.sigmas[self.matches(t)[0]]

    def sigma_second(self, t):
        m = self.matches(t)
        return self.sigmas[m[1] if len(m) > 1 else m[0]]


def i2v_y(first_latent, chunk_start, nf):
    """[B, 20, nf, h, w]: mask and first-frame latent on absolute latent frame 0 only."""
    b, _, h, w = first_latent.shape
    y = first_latent.new_zeros(b, MASK + LATENT, nf, h, w)
    if chunk_start == 0:
        y[:, :MASK, 0] = 1.0
        y[:, MASK:, 0] = first_latent
    return y


@torch.no_grad()
def stream(model, text_kv, first_latent, cam_tokens_per_chunk, noises, sched=None,
           chunk_frames=CHUNK_FRAMES, window=WINDOW_FRAMES, sink=SINK_FRAMES):
    """The engine's loop. first_latent [B, 16, h, w]; cam_tokens_per_chunk: list of [B, L_c, feat];
    noises: callable (chunk, step) → [B, 16, C, h, w]. Returns the list of chunk x0s."""
    sched = sched or Schedule()
    b, _, h, w = first_latent.shape
    tpf = (h // 2) * (w // 2)
    cache = StreamCache(len(model.blocks), window, sink, tpf)
    outs = []
    for c, cam_tok in enumerate(cam_tokens_per_chunk):
        t0 = c * chunk_frames
        pos = torch.arange(t0, t0 + chunk_frames)
        y = i2v_y(first_latent, t0, chunk_frames)
        cam = model.camera_mods(cam_tok)

        def run(x, t, kv_only=False):
            tf = torch.full((b, chunk_frames), float(t), dtype=torch.float64, device=x.device)
            return model(torch.cat([x, y], 1), tf, pos, text_kv, cam, cache=cache, kv_only=kv_only)

        x = noises(c, 0)
        steps = sched.steps
        for s, t in enumerate(steps):
            v = run(x, t)
            x0 = x - sched.sigma_first(t) * v
            if s + 1 < len(steps):
                sn = sched.sigma_second(steps[s + 1])
                x = (1 - sn) * x0 + sn * noises(c, s + 1)
        outs.append(x0)
        run(x0, 0.0, kv_only=True)
    return outs
