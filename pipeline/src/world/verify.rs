//! `worker verify world`: generated play against the renderer. Scripted tours run through the
//! real streaming engine and the tiny decoder; the renderer draws the same poses (the rig the
//! engine integrates); frames are compared by PSNR and SSIM over the first and the last second.
//! The motion check plays single commands and asks whether each generated clip is closer to the
//! renders of its own command than to those of the others.

use std::sync::Arc;

use kernels::Tensor;
use serde::Serialize;

use crate::camera::{Controls, Pose, MODEL_FPS};
use crate::engine::{ChunkInputs, Engine, EngineConfig};
use crate::model::WanModel;
use crate::vae::{TinyDecoder, TinyEncoder};
use crate::{Error, Result};

use super::assets::frame_tensor;
use super::metrics::{mean_horizontal_shift, psnr, ssim};
use super::render::Renderer;
use super::trajectory::Trajectory;

/// One played tour: what the model made and what the renderer shows, frame by frame.
#[derive(Debug)]
pub struct Played {
    pub generated: Vec<Vec<u8>>,
    pub truth: Vec<Vec<u8>>,
}

/// `[3, T, H, W]` frames in `[−1, 1]` to RGB u8 frames.
pub fn frames_u8(t: &Tensor) -> Vec<Vec<u8>> {
    let (n, h, w) = (t.dim(1), t.dim(2), t.dim(3));
    let x = t.to_vec_f32();
    let plane = h * w;
    (0..n)
        .map(|f| {
            let mut out = vec![0u8; plane * 3];
            for p in 0..plane {
                for c in 0..3 {
                    let v = x[(c * n + f) * plane + p];
                    out[p * 3 + c] = ((v + 1.0) * 127.5).round().clamp(0.0, 255.0) as u8;
                }
            }
            out
        })
        .collect()
}

/// The autoencoder a verification runs with.
#[derive(Debug)]
pub struct Codec {
    pub encoder: TinyEncoder,
    pub decoder: TinyDecoder,
}

/// Plays `controls` (one per chunk) from the session start through a new engine on `model`
/// and a fresh stream of the decoder, the session's first frame being the renderer's view from
/// `spawn` through the encoder; renders the poses the engine reports, seen from `spawn`.
pub fn play(
    model: &Arc<WanModel>,
    cfg: &EngineConfig,
    codec: &mut Codec,
    renderer: &Renderer,
    spawn: Pose,
    controls: &[Controls],
) -> Result<Played> {
    let first = frame_tensor(&[renderer.render(&spawn)], cfg.height, cfg.width)?;
    let cfg = EngineConfig {
        first_latent: Some(codec.encoder.encode(&first)?.to_vec_f32()),
        ..cfg.clone()
    };
    let cfg = &cfg;
    let mut engine = Engine::new(model.clone(), cfg.clone())?;
    let decoder = &mut codec.decoder;
    decoder.reset();
    let path = Trajectory::follow(cfg, spawn, controls);
    let mut generated = Vec::new();
    for (k, c) in controls.iter().enumerate() {
        let chunk = engine.next_chunk(&ChunkInputs { controls: *c })?;
        if chunk.poses != path.latent[k] {
            return Err(Error::Input(format!(
                "chunk {k}: the engine's poses are not the trajectory's"
            )));
        }
        let host = chunk.latents.to_device(kernels::Device::Cpu)?;
        generated.extend(frames_u8(&decoder.decode_chunk(&host)?));
    }
    if generated.len() != path.poses.len() {
        return Err(Error::Input(format!(
            "{} frames decoded for {} poses",
            generated.len(),
            path.poses.len()
        )));
    }
    let truth = (0..path.poses.len())
        .map(|i| renderer.render(&path.world_pose(i)))
        .collect();
    Ok(Played { generated, truth })
}

/// Scores of one tour.
#[derive(Clone, Debug, Serialize)]
pub struct TourScore {
    pub name: String,
    pub frames: usize,
    pub seconds: f64,
    pub psnr_first_second: f64,
    pub ssim_first_second: f64,
    pub psnr_last_second: f64,
    pub ssim_last_second: f64,
    pub psnr_all: f64,
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    s / n.max(1) as f64
}

/// Mean PSNR (dB, each frame's capped at 60) over frames `range` of `a` against `b`.
pub fn mean_psnr(a: &[Vec<u8>], b: &[Vec<u8>], range: std::ops::Range<usize>) -> f64 {
    mean(range.map(|i| psnr(&a[i], &b[i]).min(60.0)))
}

pub fn score(name: &str, p: &Played, height: usize, width: usize) -> TourScore {
    let n = p.generated.len();
    let sec = MODEL_FPS as usize;
    let first = 0..sec.min(n);
    let last = n.saturating_sub(sec)..n;
    let ssim_over = |r: std::ops::Range<usize>| {
        mean(r.map(|i| ssim(&p.generated[i], &p.truth[i], height, width)))
    };
    TourScore {
        name: name.into(),
        frames: n,
        seconds: n as f64 / MODEL_FPS,
        psnr_first_second: mean_psnr(&p.generated, &p.truth, first.clone()),
        ssim_first_second: ssim_over(first),
        psnr_last_second: mean_psnr(&p.generated, &p.truth, last.clone()),
        ssim_last_second: ssim_over(last),
        psnr_all: mean_psnr(&p.generated, &p.truth, 0..n),
    }
}

/// The motion check: `psnr[i][j]` is generated clip `i` (command `i` held) against the renders
/// of command `j`, over every frame after the shared first one.
#[derive(Clone, Debug, Serialize)]
pub struct MotionCheck {
    pub commands: Vec<String>,
    pub psnr: Vec<Vec<f64>>,
    /// Commands whose own renders match their generated clip best of all.
    pub correct: usize,
    /// Per moving command: its own renders beat those of the opposite command (W/S, A/D) and
    /// those of standing still.
    pub beats_opposite_and_still: Vec<(String, bool)>,
    /// Per command: horizontal image motion (pixels per frame, [`mean_horizontal_shift`]) of
    /// the renders and of the generated clip. Yaw shows here directly, however blurry the clip.
    pub shift_px_per_frame: Vec<ShiftRow>,
    /// Per yaw command (A, D): the generated clip pans the way the renders do, at least half as
    /// fast.
    pub yaw_seen: Vec<(String, bool)>,
}

/// Horizontal motion of one command's renders and generated clip.
#[derive(Clone, Debug, Serialize)]
pub struct ShiftRow {
    pub command: String,
    pub truth: f64,
    pub generated: f64,
}

/// Largest pan (pixels per frame) the shift search tries: twice A/D's 3.6 px per frame at
/// 128×128.
const MAX_SHIFT_PX: usize = 8;

/// The commands of the motion check: forward, back, yaw left, yaw right, and standing still
/// (last); each moving command's opposite is its neighbour in the pair.
pub fn motion_commands() -> Vec<(&'static str, Controls)> {
    let key = |f: fn(&mut Controls)| {
        let mut c = Controls::default();
        f(&mut c);
        c
    };
    vec![
        ("W", key(|c| c.w = true)),
        ("S", key(|c| c.s = true)),
        ("A", key(|c| c.a = true)),
        ("D", key(|c| c.d = true)),
        ("still", Controls::default()),
    ]
}

/// Where the motion check starts: the middle of room 1, facing +z, with 3 m clear ahead and
/// behind.
pub fn motion_spawn() -> Pose {
    Pose::level([6.5, 0.0, 5.0], 0.0)
}

pub fn motion_check(
    model: &Arc<WanModel>,
    cfg: &EngineConfig,
    codec: &mut Codec,
    renderer: &Renderer,
    chunks: usize,
) -> Result<MotionCheck> {
    let commands = motion_commands();
    let spawn = motion_spawn();
    let played = commands
        .iter()
        .map(|(_, c)| play(model, cfg, codec, renderer, spawn, &vec![*c; chunks]))
        .collect::<Result<Vec<_>>>()?;
    let n = played[0].generated.len();
    let psnr: Vec<Vec<f64>> = played
        .iter()
        .map(|gen| {
            played
                .iter()
                .map(|truth| mean_psnr(&gen.generated, &truth.truth, 1..n))
                .collect()
        })
        .collect();
    let correct = psnr
        .iter()
        .enumerate()
        .filter(|(i, row)| row.iter().enumerate().all(|(j, v)| j == *i || *v < row[*i]))
        .count();
    let still = commands.len() - 1;
    let beats = (0..still)
        .map(|i| {
            let row = &psnr[i];
            let ok = row[i] > row[i ^ 1] && row[i] > row[still];
            (commands[i].0.to_string(), ok)
        })
        .collect();
    let (h, w) = (cfg.height, cfg.width);
    let shifts: Vec<ShiftRow> = commands
        .iter()
        .zip(&played)
        .map(|((name, _), p)| ShiftRow {
            command: name.to_string(),
            truth: mean_horizontal_shift(&p.truth, h, w, MAX_SHIFT_PX),
            generated: mean_horizontal_shift(&p.generated, h, w, MAX_SHIFT_PX),
        })
        .collect();
    let yaw_seen = shifts
        .iter()
        .filter(|r| r.command == "A" || r.command == "D")
        .map(|r| {
            let ok = r.generated * r.truth > 0.0 && r.generated.abs() >= 0.5 * r.truth.abs();
            (r.command.clone(), ok)
        })
        .collect();
    Ok(MotionCheck {
        commands: commands.iter().map(|(n, _)| n.to_string()).collect(),
        psnr,
        correct,
        beats_opposite_and_still: beats,
        shift_px_per_frame: shifts,
        yaw_seen,
    })
}
