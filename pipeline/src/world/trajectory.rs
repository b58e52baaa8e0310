//! Camera trajectories through the scene, always integrated by the engine's own
//! [`CameraRig`]: random play for training (seeded; the held-out split draws from a disjoint
//! stream) and scripted tours for evaluation.

use crate::camera::{CameraRig, ChunkPoses, Controls, Pose};
use crate::engine::EngineConfig;
use crate::rng::NormalRng;
use crate::{Error, Result};

use super::scene::Scene;

/// How close (metres) the camera may come to a solid.
pub const BODY_RADIUS: f64 = 0.3;

/// Which stream a random trajectory comes from. Clip `i` of a split with seed `s` draws from
/// `NormalRng::for_name(s, "world/<split>/<i>")`, so the splits never share a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    HeldOut,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::HeldOut => "heldout",
        }
    }
}

impl std::str::FromStr for Split {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "train" => Ok(Split::Train),
            "heldout" => Ok(Split::HeldOut),
            other => Err(Error::Config(format!(
                "unknown split '{other}' (expected train or heldout)"
            ))),
        }
    }
}

/// A camera path chunk by chunk, as the engine would integrate it.
#[derive(Clone, Debug)]
pub struct Trajectory {
    /// The rig's origin in the scene.
    pub spawn: Pose,
    /// Controls held during each chunk.
    pub controls: Vec<Controls>,
    /// Rig pose of every video frame (`1 + 4(chunk_frames·chunks − 1)` of them).
    pub poses: Vec<Pose>,
    /// Rig pose of every latent frame, per chunk (what the engine's `Chunk::poses` holds).
    pub latent: Vec<Vec<Pose>>,
}

impl Trajectory {
    /// Follows `controls` (one per chunk) from the rig's start, exactly as the engine does.
    pub fn follow(cfg: &EngineConfig, spawn: Pose, controls: &[Controls]) -> Self {
        let mut rig = CameraRig::new(cfg.camera.clone());
        let mut t = Trajectory {
            spawn,
            controls: Vec::new(),
            poses: Vec::new(),
            latent: Vec::new(),
        };
        for c in controls {
            let p = rig.chunk_poses(c, t.first_latent(), cfg.chunk_frames);
            t.push(*c, p);
        }
        t
    }

    fn first_latent(&self) -> u64 {
        self.latent.iter().map(Vec::len).sum::<usize>() as u64
    }

    fn push(&mut self, c: Controls, p: ChunkPoses) {
        self.controls.push(c);
        self.poses.extend(p.video);
        self.latent.push(p.latent);
    }

    /// Scene pose of video frame `i`.
    pub fn world_pose(&self, i: usize) -> Pose {
        self.spawn.compose(&self.poses[i])
    }
}

fn unit(rng: &mut NormalRng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn uniform(rng: &mut NormalRng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * unit(rng)
}

fn sign(rng: &mut NormalRng) -> f64 {
    if unit(rng) < 0.5 {
        -1.0
    } else {
        1.0
    }
}

/// Pitch (radians, up positive) of a rig pose.
fn pitch(p: &Pose) -> f64 {
    (-p.forward()[1]).clamp(-1.0, 1.0).asin()
}

/// One behaviour of play and how many chunks it is held.
fn draw(rng: &mut NormalRng, pitch: f64) -> (Controls, usize) {
    let mut c = Controls::default();
    let u = unit(rng);
    let left = unit(rng) < 0.5;
    let mut hold = 1 + (unit(rng) * 4.0) as usize;
    match u {
        u if u < 0.28 => c.w = true,
        u if u < 0.42 => {
            c.w = true;
            (c.a, c.d) = (left, !left);
        }
        u if u < 0.54 => (c.a, c.d) = (left, !left),
        u if u < 0.59 => c.s = true,
        u if u < 0.67 => (c.q, c.e) = (left, !left),
        u if u < 0.79 => {
            c.mouse_dx = sign(rng) * uniform(rng, 30.0, 250.0);
            c.mouse_dy = uniform(rng, -60.0, 60.0);
        }
        u if u < 0.87 => {
            c.w = true;
            c.mouse_dx = sign(rng) * uniform(rng, 30.0, 200.0);
        }
        u if u < 0.92 => {
            (c.i, c.k) = (left, !left);
            hold = 1;
        }
        u if u < 0.96 => {
            c.w = true;
            (c.q, c.e) = (left, !left);
        }
        _ => {}
    }
    // Play drifts back to level: a tilted camera is often straightened.
    if pitch.abs() > 20f64.to_radians() && !(c.i || c.k) && unit(rng) < 0.6 {
        if pitch > 0.0 {
            c.k = true;
        } else {
            c.i = true;
        }
        hold = 1;
    }
    (c, hold)
}

/// Whether every video frame of `p` keeps clear of the scene's solids.
fn clear(scene: &Scene, spawn: &Pose, p: &ChunkPoses) -> bool {
    p.video.iter().all(|v| {
        let w = spawn.compose(v);
        scene.is_free(w.t[0], w.t[2], BODY_RADIUS)
    })
}

/// Random play of `chunks` chunks: behaviours held for 1–4 chunks, never through a solid (a
/// move that would hit one is redrawn; turning in place is the last resort).
pub fn random(
    scene: &Scene,
    cfg: &EngineConfig,
    split: Split,
    seed: u64,
    clip: u64,
    chunks: usize,
) -> Trajectory {
    let mut rng = NormalRng::for_name(seed, &format!("world/{}/{clip}", split.name()));
    let cells = scene.open_cells(BODY_RADIUS + 0.2);
    let spawn = loop {
        let (x, z) = cells[(unit(&mut rng) * cells.len() as f64) as usize % cells.len()];
        let (x, z) = (
            x + uniform(&mut rng, -0.3, 0.3),
            z + uniform(&mut rng, -0.3, 0.3),
        );
        if !scene.is_free(x, z, BODY_RADIUS) {
            continue;
        }
        // Face some open floor: a view into a wall a hand away teaches little.
        let mut yaw = 0.0;
        for _ in 0..8 {
            yaw = uniform(&mut rng, -180.0, 180.0).to_radians();
            if scene.clearance(x, z, yaw, 3.0) >= 1.5 {
                break;
            }
        }
        break Pose::level([x, 0.0, z], yaw);
    };
    let mut rig = CameraRig::new(cfg.camera.clone());
    let mut t = Trajectory {
        spawn,
        controls: Vec::new(),
        poses: Vec::new(),
        latent: Vec::new(),
    };
    let mut held: Option<(Controls, usize)> = None;
    for _ in 0..chunks {
        let first = t.first_latent();
        let tilt = pitch(&rig.pose());
        let mut chosen = None;
        for attempt in 0..12 {
            let (c, hold) = match held.take() {
                Some(h) if attempt == 0 => h,
                _ => draw(&mut rng, tilt),
            };
            let mut trial = rig.clone();
            let p = trial.chunk_poses(&c, first, cfg.chunk_frames);
            if clear(scene, &spawn, &p) {
                chosen = Some((c, hold, trial, p));
                break;
            }
        }
        let (c, hold, next, p) = chosen.unwrap_or_else(|| {
            let c = Controls {
                a: unit(&mut rng) < 0.5,
                ..Default::default()
            };
            let c = Controls { d: !c.a, ..c };
            let mut trial = rig.clone();
            let p = trial.chunk_poses(&c, first, cfg.chunk_frames);
            (c, 1, trial, p)
        });
        if hold > 1 {
            held = Some((c, hold - 1));
        }
        rig = next;
        t.push(c, p);
    }
    t
}

/// The scripted held-out tours of `worker verify world`: each holds one command per stretch,
/// from the default spawn, clear of solids. Names and controls per chunk.
pub fn scripted(chunks: usize) -> Vec<(&'static str, Vec<Controls>)> {
    let key = |f: fn(&mut Controls)| {
        let mut c = Controls::default();
        f(&mut c);
        c
    };
    let w = key(|c| c.w = true);
    let a = key(|c| c.a = true);
    let d = key(|c| c.d = true);
    let wd = key(|c| {
        c.w = true;
        c.d = true;
    });
    let look = key(|c| c.mouse_dx = -120.0);
    let s = key(|c| c.s = true);
    let idle = Controls::default();
    let cycle = |pattern: &[Controls]| -> Vec<Controls> {
        (0..chunks).map(|i| pattern[i % pattern.len()]).collect()
    };
    vec![
        ("forward-then-turn", cycle(&[w, w, w, d, d, w, a, a, idle])),
        ("arc-right", cycle(&[wd, wd, w, s, a, look])),
        ("look-around", cycle(&[a, a, look, d, d, d, idle])),
    ]
}
