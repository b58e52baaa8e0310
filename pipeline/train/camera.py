"""LingBot camera conditioning as `pipeline/src/camera.rs` builds it, from absolute latent poses.

Poses are camera-to-world (OpenCV: x right, y down, z forward), one per latent frame. The engine
makes them frame-to-frame relative (the session's first frame: identity), divides translations by
one full-speed latent step (`move_speed · 4 / 16`), builds per pixel `[origin (3), direction (3)]`
with the 832×480 intrinsics scaled per axis, and folds 8×8 pixels and the 2×2 patch into
`control_dim · 256` features per token: feature `c·256 + i·32 + j·4 + p·2 + q` of token (f, y, x)
is pixel `((2y+p)·8+i, (2x+q)·8+j)`.
"""
import torch

INTRINSICS_832X480 = (480.0, 480.0, 416.0, 240.0)
MOVE_SPEED = 1.0
STEP_LENGTH = MOVE_SPEED * 4 / 16.0


def relative_poses(r, t, unit=STEP_LENGTH):
    """r [..., F, 3, 3], t [..., F, 3] absolute (float64) → relative (r, t/unit); frame 0 identity."""
    rel_r = torch.empty_like(r)
    rel_t = torch.empty_like(t)
    rel_r[..., 0, :, :] = torch.eye(3, dtype=r.dtype, device=r.device)
    rel_t[..., 0, :] = 0.0
    prev_rt = r[..., :-1, :, :].transpose(-1, -2)
    rel_r[..., 1:, :, :] = prev_rt @ r[..., 1:, :, :]
    d = t[..., 1:, :] - t[..., :-1, :]
    rel_t[..., 1:, :] = (prev_rt @ d[..., None])[..., 0]
    return rel_r, rel_t / unit


def pixel_rays(height, width, device, intr=INTRINSICS_832X480):
    fx, fy, cx, cy = intr
    sx, sy = width / 832.0, height / 480.0
    fx, fy, cx, cy = fx * sx, fy * sy, cx * sx, cy * sy
    v, u = torch.meshgrid(torch.arange(height, dtype=torch.float64, device=device),
                          torch.arange(width, dtype=torch.float64, device=device), indexing="ij")
    d = torch.stack([(u + 0.5 - cx) / fx, (v + 0.5 - cy) / fy, torch.ones_like(u)], -1)
    return d / d.norm(dim=-1, keepdim=True)  # [H, W, 3]


def ray_tokens(rel_r, rel_t, height, width):
    """Relative poses [B, F, 3, 3], [B, F, 3] (f64) → folded tokens [B, F·(H/16)·(W/16), 1536] f32."""
    b, nf = rel_t.shape[:2]
    d = pixel_rays(height, width, rel_t.device)
    dw = torch.einsum("bfij,hwj->bfhwi", rel_r, d).float()
    org = rel_t.float()[:, :, None, None, :].expand(b, nf, height, width, 3)
    return fold(torch.cat([org, dw], -1))


def fold(m):
    """Per-pixel map [B, F, H, W, C] → tokens [B, F·(H/16)·(W/16), C·256] (camera.rs `fold_rays`)."""
    b, nf, height, width, c = m.shape
    gh, gw = height // 16, width // 16
    m = m.reshape(b, nf, gh, 2, 8, gw, 2, 8, c)  # f, y, p, i, x, q, j, c
    m = m.permute(0, 1, 2, 5, 8, 4, 7, 3, 6)  # f, y, x, c, i, j, p, q
    return m.reshape(b, nf * gh * gw, c * 256)
