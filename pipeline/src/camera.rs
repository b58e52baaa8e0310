//! Controls → camera poses → LingBot's per-pixel ray conditioning.
//!
//! Conventions (OpenCV, as LingBot's poses): camera x right, y down, z forward; poses are
//! camera-to-world. World y is down, so yaw turns about world y and "up" is −y.

use std::sync::{Arc, Mutex};

use kernels::Tensor;
use rayon::prelude::*;

use crate::config::{VAE_STRIDE, VAE_TIME_STRIDE};
use crate::{Error, Result};

/// Model clock: video frames per second.
pub const MODEL_FPS: f64 = 16.0;

/// A rigid camera-to-world transform.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pose {
    /// Row-major rotation.
    pub r: [[f64; 3]; 3],
    pub t: [f64; 3],
}

impl Pose {
    pub const IDENTITY: Pose = Pose {
        r: [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
        t: [0.0; 3],
    };

    /// `self⁻¹ · other`: `other` seen from `self`'s frame.
    pub fn relative_to(&self, other: &Pose) -> Pose {
        let rt = transpose(&self.r);
        let d = [
            other.t[0] - self.t[0],
            other.t[1] - self.t[1],
            other.t[2] - self.t[2],
        ];
        Pose {
            r: matmul(&rt, &other.r),
            t: apply(&rt, d),
        }
    }

    /// World direction of the camera's forward axis.
    pub fn forward(&self) -> [f64; 3] {
        [self.r[0][2], self.r[1][2], self.r[2][2]]
    }
}

fn transpose(a: &[[f64; 3]; 3]) -> [[f64; 3]; 3] {
    let mut t = [[0.0; 3]; 3];
    for (i, row) in a.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            t[j][i] = *v;
        }
    }
    t
}

fn matmul(a: &[[f64; 3]; 3], b: &[[f64; 3]; 3]) -> [[f64; 3]; 3] {
    let mut c = [[0.0; 3]; 3];
    for i in 0..3 {
        for j in 0..3 {
            c[i][j] = (0..3).map(|k| a[i][k] * b[k][j]).sum();
        }
    }
    c
}

fn apply(a: &[[f64; 3]; 3], v: [f64; 3]) -> [f64; 3] {
    [0, 1, 2].map(|i| (0..3).map(|k| a[i][k] * v[k]).sum())
}

fn rot_y(a: f64) -> [[f64; 3]; 3] {
    let (s, c) = a.sin_cos();
    [[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]]
}

fn rot_x(a: f64) -> [[f64; 3]; 3] {
    let (s, c) = a.sin_cos();
    [[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]]
}

/// Keys held and mouse motion during one chunk. Keys follow the browser client: W/S forward and
/// back, A/D yaw, Q/E strafe, I/K pitch; the mouse looks around.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Controls {
    pub w: bool,
    pub a: bool,
    pub s: bool,
    pub d: bool,
    pub q: bool,
    pub e: bool,
    pub i: bool,
    pub k: bool,
    /// Mouse motion in pixels over the chunk (right and down positive).
    pub mouse_dx: f64,
    pub mouse_dy: f64,
}

impl Controls {
    /// WASD one-hot of the action variant, in W, A, S, D order.
    pub fn wasd(&self) -> [f32; 4] {
        [self.w, self.a, self.s, self.d].map(|b| if b { 1.0 } else { 0.0 })
    }
}

/// Speeds and optics of the controllable camera.
#[derive(Clone, Debug, PartialEq)]
pub struct CameraConfig {
    /// World units per second for W/S and Q/E.
    pub move_speed: f64,
    /// Degrees per second for A/D and I/K.
    pub turn_rate_deg: f64,
    /// Degrees per mouse pixel.
    pub mouse_deg_per_px: f64,
    /// Pitch limit in degrees (looking straight up or down makes yaw meaningless).
    pub max_pitch_deg: f64,
    /// Intrinsics `[fx, fy, cx, cy]` at 832×480, LingBot's reference size; rescaled to the
    /// session's pixel size as upstream does.
    pub intrinsics_832x480: [f64; 4],
}

impl Default for CameraConfig {
    fn default() -> Self {
        CameraConfig {
            move_speed: 1.0,
            turn_rate_deg: 45.0,
            mouse_deg_per_px: 0.1,
            max_pitch_deg: 80.0,
            intrinsics_832x480: [480.0, 480.0, 416.0, 240.0],
        }
    }
}

/// Integrates controls into a camera pose at the model clock.
#[derive(Clone, Debug)]
pub struct CameraRig {
    cfg: CameraConfig,
    position: [f64; 3],
    yaw: f64,
    pitch: f64,
}

impl CameraRig {
    pub fn new(cfg: CameraConfig) -> Self {
        CameraRig {
            cfg,
            position: [0.0; 3],
            yaw: 0.0,
            pitch: 0.0,
        }
    }

    pub fn config(&self) -> &CameraConfig {
        &self.cfg
    }

    pub fn pose(&self) -> Pose {
        Pose {
            r: matmul(&rot_y(self.yaw), &rot_x(self.pitch)),
            t: self.position,
        }
    }

    /// Advances by `frames` video frames holding `c`; the mouse motion is spread evenly over
    /// `spread_frames` frames (the chunk), so a chunk's look-around is smooth.
    pub fn advance(&mut self, c: &Controls, frames: usize, spread_frames: usize) {
        let dt = 1.0 / MODEL_FPS;
        let axis = |pos: bool, neg: bool| (pos as i32 - neg as i32) as f64;
        let turn = self.cfg.turn_rate_deg.to_radians();
        let per_frame_mouse = 1.0 / spread_frames.max(1) as f64;
        let max_pitch = self.cfg.max_pitch_deg.to_radians();
        for _ in 0..frames {
            self.yaw += axis(c.d, c.a) * turn * dt
                + c.mouse_dx * per_frame_mouse * self.cfg.mouse_deg_per_px.to_radians();
            self.pitch += axis(c.i, c.k) * turn * dt
                - c.mouse_dy * per_frame_mouse * self.cfg.mouse_deg_per_px.to_radians();
            self.pitch = self.pitch.clamp(-max_pitch, max_pitch);
            // Walking stays level: forward and strafe follow yaw only.
            let (s, co) = self.yaw.sin_cos();
            let forward = [s, 0.0, co];
            let right = [co, 0.0, -s];
            let (f, r) = (axis(c.w, c.s), axis(c.e, c.q));
            for k in 0..3 {
                self.position[k] += self.cfg.move_speed * dt * (f * forward[k] + r * right[k]);
            }
        }
    }

    /// One pose per latent frame for `n` frames starting at absolute latent frame
    /// `first_frame`: frame 0 of a session is the starting pose; every later latent frame is four
    /// video frames on (the pose of its last video frame, as upstream samples frames 0, 4, 8, …).
    pub fn latent_poses(&mut self, c: &Controls, first_frame: u64, n: usize) -> Vec<Pose> {
        self.chunk_poses(c, first_frame, n).latent
    }

    /// [`latent_poses`](Self::latent_poses) with the pose of every video frame of the chunk as
    /// well: the chunk's first video frame is latent frame 0 itself at the session start
    /// (`1 + 4(n − 1)` frames), otherwise the frame after the previous chunk's last (`4n`
    /// frames); latent `i` of the chunk is the video frame that ends its group of four.
    pub fn chunk_poses(&mut self, c: &Controls, first_frame: u64, n: usize) -> ChunkPoses {
        let spread = n * VAE_TIME_STRIDE;
        let mut out = ChunkPoses::default();
        for i in 0..n as u64 {
            if first_frame + i > 0 {
                // Frame by frame is the same arithmetic as `advance(c, 4, spread)`: bit-equal.
                for _ in 0..VAE_TIME_STRIDE {
                    self.advance(c, 1, spread);
                    out.video.push(self.pose());
                }
            } else {
                out.video.push(self.pose());
            }
            out.latent.push(self.pose());
        }
        out
    }

    /// Translation of one latent frame at full speed: the unit LingBot's normalised relative
    /// translations are measured in.
    pub fn step_length(&self) -> f64 {
        self.cfg.step_length()
    }
}

impl CameraConfig {
    /// See [`CameraRig::step_length`].
    pub fn step_length(&self) -> f64 {
        self.move_speed * VAE_TIME_STRIDE as f64 / MODEL_FPS
    }

    /// `[fx, fy, cx, cy]` in pixels at `height × width`: the 832×480 intrinsics scaled per axis,
    /// as [`ray_map`] and the world renderer use them.
    pub fn intrinsics_px(intrinsics_832x480: [f64; 4], height: usize, width: usize) -> [f64; 4] {
        let [fx, fy, cx, cy] = intrinsics_832x480;
        let (sx, sy) = (width as f64 / 832.0, height as f64 / 480.0);
        [fx * sx, fy * sy, cx * sx, cy * sy]
    }
}

/// Unit direction, in camera coordinates, of the ray through the centre of pixel `(u, v)`.
pub fn pixel_ray(intrinsics_px: [f64; 4], u: usize, v: usize) -> [f64; 3] {
    let [fx, fy, cx, cy] = intrinsics_px;
    let d = [(u as f64 + 0.5 - cx) / fx, (v as f64 + 0.5 - cy) / fy, 1.0];
    let n = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2]).sqrt();
    d.map(|x| x / n)
}

/// The poses of one chunk: per video frame and per latent frame.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChunkPoses {
    pub video: Vec<Pose>,
    pub latent: Vec<Pose>,
}

impl Pose {
    /// World direction of camera-frame direction `d`.
    pub fn rotate(&self, d: [f64; 3]) -> [f64; 3] {
        apply(&self.r, d)
    }

    /// `self · other`: `other` (given in `self`'s frame) in the world.
    pub fn compose(&self, other: &Pose) -> Pose {
        let d = apply(&self.r, other.t);
        Pose {
            r: matmul(&self.r, &other.r),
            t: [0, 1, 2].map(|k| self.t[k] + d[k]),
        }
    }

    /// A level pose: at `t`, turned `yaw` radians about world y (as the rig's yaw).
    pub fn level(t: [f64; 3], yaw: f64) -> Pose {
        Pose { r: rot_y(yaw), t }
    }
}

/// Frame-to-frame relative poses of consecutive latent frames (`prev` is the pose before the
/// first; `None` at the start of a session, which makes the first relative pose the identity),
/// with translations divided by `unit` (upstream divides by the largest step of the whole clip,
/// which a stream cannot know; a full-speed step is the causal equivalent).
pub fn relative_poses(prev: Option<&Pose>, poses: &[Pose], unit: f64) -> Vec<Pose> {
    let mut out = Vec::with_capacity(poses.len());
    let mut last = prev.copied();
    for p in poses {
        let mut rel = match last {
            Some(l) => l.relative_to(p),
            None => Pose::IDENTITY,
        };
        if unit > 0.0 {
            rel.t = rel.t.map(|v| v / unit);
        }
        out.push(rel);
        last = Some(*p);
    }
    out
}

/// Per-pixel conditioning `[frames, height, width, channels]` (row-major, f32) at pixel size.
/// Camera variant (6 channels): `[ray origin (3), ray direction (3)]`; action variant (7):
/// `[ray direction (3), W, A, S, D]`. Rays pass through pixel centres; directions are unit length.
pub fn ray_map(
    poses: &[Pose],
    wasd: &[[f32; 4]],
    height: usize,
    width: usize,
    intrinsics_832x480: [f64; 4],
    channels: usize,
) -> Result<Vec<f32>> {
    if channels != 6 && channels != 7 {
        return Err(Error::Config(format!(
            "control_dim {channels} (expected 6 or 7)"
        )));
    }
    if channels == 7 && wasd.len() != poses.len() {
        return Err(Error::Input(
            "the action variant needs one WASD vector per frame".into(),
        ));
    }
    let k = CameraConfig::intrinsics_px(intrinsics_832x480, height, width);
    let mut out = vec![0f32; poses.len() * height * width * channels];
    // One task per pixel row: every chunk needs a full-size map, and on one core it takes tens
    // of milliseconds in which the cards wait.
    out.par_chunks_mut((width * channels).max(1))
        .enumerate()
        .for_each(|(row, line)| {
            let (f, v) = (row / height, row % height);
            let p = &poses[f];
            for (u, px) in line.chunks_exact_mut(channels).enumerate() {
                let dw = apply(&p.r, pixel_ray(k, u, v));
                if channels == 6 {
                    for (o, x) in px.iter_mut().zip(p.t.iter().chain(dw.iter())) {
                        *o = *x as f32;
                    }
                } else {
                    for (o, x) in px.iter_mut().zip(&dw) {
                        *o = *x as f32;
                    }
                    px[3..].copy_from_slice(&wasd[f]);
                }
            }
        });
    Ok(out)
}

/// [`pixel_ray`] of every pixel at `height × width`, row-major: the same for every frame and
/// chunk of a session, so it is computed once and kept (for the last size asked).
fn pixel_rays(intrinsics_px: [f64; 4], height: usize, width: usize) -> Arc<Vec<[f64; 3]>> {
    type Rays = ([u64; 4], usize, usize, Arc<Vec<[f64; 3]>>);
    static LAST: Mutex<Option<Rays>> = Mutex::new(None);
    let key = intrinsics_px.map(f64::to_bits);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((k, h, w, rays)) = last.as_ref() {
        if (*k, *h, *w) == (key, height, width) {
            return rays.clone();
        }
    }
    let mut rays = vec![[0.0; 3]; height * width];
    rays.par_chunks_mut(width.max(1))
        .enumerate()
        .for_each(|(v, line)| {
            for (u, r) in line.iter_mut().enumerate() {
                *r = pixel_ray(intrinsics_px, u, v);
            }
        });
    let rays = Arc::new(rays);
    *last = Some((key, height, width, rays.clone()));
    rays
}

/// Rows `[first, first + real)` of [`fold_rays`]`(`[`ray_map`]`(..))`, computed straight from the
/// poses with no full-size map, followed by zero rows up to `rows` rows: a sequence-parallel
/// rank builds only its own token shard. Every value is the same f32 as in the full map (each
/// is computed from its pixel alone).
#[allow(clippy::too_many_arguments)]
pub fn ray_token_rows(
    poses: &[Pose],
    wasd: &[[f32; 4]],
    height: usize,
    width: usize,
    intrinsics_832x480: [f64; 4],
    channels: usize,
    first: usize,
    real: usize,
    rows: usize,
) -> Result<Tensor> {
    let b = VAE_STRIDE;
    if channels != 6 && channels != 7 {
        return Err(Error::Config(format!(
            "control_dim {channels} (expected 6 or 7)"
        )));
    }
    if channels == 7 && wasd.len() != poses.len() {
        return Err(Error::Input(
            "the action variant needs one WASD vector per frame".into(),
        ));
    }
    let (gh, gw) = (height / (2 * b), width / (2 * b));
    let tokens = poses.len() * gh * gw;
    if !height.is_multiple_of(2 * b)
        || !width.is_multiple_of(2 * b)
        || real > rows
        || first + real > tokens
    {
        return Err(Error::Input(format!(
            "ray tokens {first}..{} of {tokens} ({real} of {rows} rows) at {height}×{width} \
             (sizes must be multiples of 16)",
            first + real
        )));
    }
    let rays = pixel_rays(
        CameraConfig::intrinsics_px(intrinsics_832x480, height, width),
        height,
        width,
    );
    let feat = channels * b * b * 4;
    let mut out = vec![0f32; rows * feat];
    // One task per token; padding rows stay zero.
    out[..real * feat]
        .par_chunks_mut(feat.max(1))
        .enumerate()
        .for_each(|(n, tok)| {
            let t = first + n;
            let (f, y, x) = (t / (gh * gw), (t / gw) % gh, t % gw);
            let p = &poses[f];
            for pp in 0..2 {
                for i in 0..b {
                    for q in 0..2 {
                        for j in 0..b {
                            let (v, u) = ((2 * y + pp) * b + i, (2 * x + q) * b + j);
                            let dw = apply(&p.r, rays[v * width + u]);
                            let at = i * 32 + j * 4 + pp * 2 + q;
                            if channels == 6 {
                                for (c, val) in p.t.iter().chain(dw.iter()).enumerate() {
                                    tok[c * 256 + at] = *val as f32;
                                }
                            } else {
                                for (c, val) in dw.iter().enumerate() {
                                    tok[c * 256 + at] = *val as f32;
                                }
                                for (c, val) in wasd[f].iter().enumerate() {
                                    tok[(3 + c) * 256 + at] = *val;
                                }
                            }
                        }
                    }
                }
            }
        });
    Ok(Tensor::from_vec(out, &[rows, feat])?)
}

/// Folds a per-pixel map `[frames, 8·H, 8·W, C]` into DiT tokens `[frames·(H/2)·(W/2), C·256]`:
/// each 8×8 pixel block becomes channels `c·64 + i·8 + j` (done by upstream's pipeline), then each
/// 2×2 patch of latent pixels `ch·4 + p·2 + q` (done by upstream's model), so feature
/// `c·256 + i·32 + j·4 + p·2 + q` of token `(f, y, x)` is pixel `((2y+p)·8+i, (2x+q)·8+j)`.
pub fn fold_rays(
    map: &[f32],
    frames: usize,
    height: usize,
    width: usize,
    channels: usize,
) -> Result<Tensor> {
    let b = VAE_STRIDE;
    if !height.is_multiple_of(2 * b)
        || !width.is_multiple_of(2 * b)
        || map.len() != frames * height * width * channels
    {
        return Err(Error::Input(format!(
            "ray map of {} values for {frames}×{height}×{width}×{channels} (sizes must be multiples of 16)",
            map.len()
        )));
    }
    let (gh, gw) = (height / (2 * b), width / (2 * b));
    let feat = channels * b * b * 4;
    let mut out = vec![0f32; frames * gh * gw * feat];
    // One task per row of tokens (see `ray_map`).
    out.par_chunks_mut((gw * feat).max(1))
        .enumerate()
        .for_each(|(fy, line)| {
            let (f, y) = (fy / gh, fy % gh);
            for x in 0..gw {
                let tok = &mut line[x * feat..][..feat];
                for p in 0..2 {
                    for i in 0..b {
                        for q in 0..2 {
                            for j in 0..b {
                                let (row, col) = ((2 * y + p) * b + i, (2 * x + q) * b + j);
                                let px = &map[((f * height + row) * width + col) * channels..]
                                    [..channels];
                                for (c, &v) in px.iter().enumerate() {
                                    tok[c * 256 + i * 32 + j * 4 + p * 2 + q] = v;
                                }
                            }
                        }
                    }
                }
            }
        });
    Ok(Tensor::from_vec(out, &[frames * gh * gw, feat])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: [f64; 3], b: [f64; 3]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn keys_move_the_camera_the_way_they_say() {
        let second = MODEL_FPS as usize;
        let mut rig = CameraRig::new(CameraConfig::default());
        rig.advance(
            &Controls {
                w: true,
                ..Default::default()
            },
            second,
            second,
        );
        assert!(
            close(rig.pose().t, [0.0, 0.0, 1.0]),
            "W: one unit forward along +z: {:?}",
            rig.pose().t
        );
        rig.advance(
            &Controls {
                d: true,
                ..Default::default()
            },
            second * 2,
            second * 2,
        );
        // D for two seconds at 45°/s: facing +x.
        assert!(
            close(rig.pose().forward(), [1.0, 0.0, 0.0]),
            "{:?}",
            rig.pose().forward()
        );
        rig.advance(
            &Controls {
                e: true,
                ..Default::default()
            },
            second,
            second,
        );
        // Strafing right while facing +x moves towards −z.
        assert!(close(rig.pose().t, [0.0, 0.0, 0.0]), "{:?}", rig.pose().t);
        let mut up = CameraRig::new(CameraConfig::default());
        up.advance(
            &Controls {
                i: true,
                ..Default::default()
            },
            second,
            second,
        );
        assert!(
            up.pose().forward()[1] < -0.7,
            "I looks up (−y): {:?}",
            up.pose().forward()
        );
        let mut mouse = CameraRig::new(CameraConfig::default());
        mouse.advance(
            &Controls {
                mouse_dx: 900.0,
                ..Default::default()
            },
            12,
            12,
        );
        assert!(
            close(mouse.pose().forward(), [1.0, 0.0, 0.0]),
            "900 px at 0.1°/px is a right turn"
        );
    }

    #[test]
    fn relative_poses_compose_back_to_the_absolute_ones() {
        let mut rig = CameraRig::new(CameraConfig::default());
        let c = Controls {
            w: true,
            d: true,
            i: true,
            ..Default::default()
        };
        let poses: Vec<Pose> = (0..5)
            .map(|_| {
                rig.advance(&c, 4, 4);
                rig.pose()
            })
            .collect();
        let rel = relative_poses(None, &poses, 1.0);
        assert_eq!(rel[0], Pose::IDENTITY);
        let mut acc = poses[0];
        for (p, r) in poses.iter().zip(&rel).skip(1) {
            acc = Pose {
                r: matmul(&acc.r, &r.r),
                t: {
                    let d = apply(&acc.r, r.t);
                    [0, 1, 2].map(|k| acc.t[k] + d[k])
                },
            };
            assert!(close(acc.t, p.t));
        }
        // Straight ahead at full speed (turning would make the chord shorter than the path).
        let mut straight = CameraRig::new(CameraConfig::default());
        let w = Controls {
            w: true,
            i: true,
            ..Default::default()
        };
        let poses: Vec<Pose> = (0..3)
            .map(|_| {
                straight.advance(&w, 4, 4);
                straight.pose()
            })
            .collect();
        let unit = relative_poses(None, &poses, straight.step_length());
        let n = unit[1].t.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (n - 1.0).abs() < 1e-9,
            "a full-speed step has unit length: {n}"
        );
    }

    #[test]
    fn rays_are_unit_and_the_centre_ray_is_the_forward_axis() {
        let p = Pose {
            r: rot_y(0.3),
            t: [1.0, 2.0, 3.0],
        };
        let map = ray_map(&[p], &[], 32, 32, [480.0, 480.0, 416.0, 240.0], 6).expect("map");
        for px in map.chunks(6) {
            assert_eq!(&px[..3], &[1.0, 2.0, 3.0]);
            let n: f32 = px[3..].iter().map(|x| x * x).sum();
            assert!((n - 1.0).abs() < 1e-5);
        }
        // With cx = width/2 the centre lies between pixels 15 and 16; their mean points forward.
        let at = |v: usize, u: usize| &map[(v * 32 + u) * 6 + 3..][..3];
        let f = p.forward();
        for (k, fk) in f.iter().enumerate() {
            let m = (at(15, 15)[k] + at(16, 16)[k] + at(15, 16)[k] + at(16, 15)[k]) as f64 / 4.0;
            assert!((m - fk).abs() < 0.05, "{k}: {m} vs {fk}");
        }
    }

    #[test]
    fn token_rows_are_the_rows_of_the_folded_map() {
        let poses = [
            Pose {
                r: rot_y(0.3),
                t: [1.0, 2.0, 3.0],
            },
            Pose {
                r: matmul(&rot_x(-0.2), &rot_y(0.1)),
                t: [-0.5, 0.25, 2.0],
            },
        ];
        let wasd = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]];
        let (h, w, k) = (32, 48, [480.0, 480.0, 416.0, 240.0]);
        for c in [6, 7] {
            let map = ray_map(&poses, &wasd, h, w, k, c).expect("map");
            let whole = fold_rays(&map, 2, h, w, c).expect("fold").to_vec_f32();
            let (tokens, feat) = (2 * (h / 16) * (w / 16), c * 256);
            // Uneven shards (the last one padded), one whole, and an empty tail.
            for (first, real, rows) in [(0, tokens, tokens), (0, 5, 5), (5, 5, 5), (10, 2, 5)] {
                let t = ray_token_rows(&poses, &wasd, h, w, k, c, first, real, rows)
                    .expect("rows")
                    .to_vec_f32();
                assert_eq!(t.len(), rows * feat);
                let want = &whole[first * feat..(first + real) * feat];
                assert!(
                    t[..real * feat]
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{c} channels, tokens {first}..{}",
                    first + real
                );
                assert!(t[real * feat..].iter().all(|&v| v == 0.0), "padding");
            }
            assert!(ray_token_rows(&poses, &wasd, h, w, k, c, 10, 3, 3).is_err());
        }
    }

    #[test]
    fn fold_places_each_pixel_once_where_the_formula_says() {
        let (frames, h, w, c) = (2, 32, 48, 6);
        let map: Vec<f32> = (0..frames * h * w * c).map(|i| i as f32).collect();
        let t = fold_rays(&map, frames, h, w, c).expect("fold").to_vec_f32();
        let mut sorted = t.clone();
        sorted.sort_by(f32::total_cmp);
        assert_eq!(sorted, map, "a permutation");
        // Token (1, 1, 2), channel 4, block pixel (3, 5), patch cell (1, 0).
        let (gh, gw) = (h / 16, w / 16);
        let tok = (gh + 1) * gw + 2;
        let (row, col) = ((2 + 1) * 8 + 3, 4 * 8 + 5);
        assert_eq!(
            t[tok * c * 256 + 4 * 256 + 3 * 32 + 5 * 4 + 2],
            map[((h + row) * w + col) * c + 4]
        );
    }
}
