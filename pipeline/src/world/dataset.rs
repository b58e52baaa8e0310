//! The training set of the embedded default: rendered clips of random play with the exact
//! inputs the engine gives the DiT. Layout, units and conventions: `pipeline/train/DATASET.md`.

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::json;

use crate::camera::{pixel_ray, relative_poses, CameraConfig, Controls, Pose, MODEL_FPS};
use crate::config::{ModelConfig, VAE_TIME_STRIDE};
use crate::engine::{camera_tokens, EngineConfig};
use crate::{Error, Result};

use super::npy::{NpyType, NpyWriter};
use super::render::Renderer;
use super::scene::Scene;
use super::trajectory::{self, Split, Trajectory};

/// Largest export accepted (clips × video frames), so a typo cannot fill the disk.
pub const MAX_FRAMES: usize = 2_000_000;

/// What to export.
#[derive(Clone, Debug)]
pub struct DatasetOptions {
    pub clips: usize,
    /// Chunks per clip (`3·chunks` latent frames, `1 + 4(3·chunks − 1)` video frames).
    pub chunks: usize,
    pub seed: u64,
    pub split: Split,
    /// Rays per pixel side (2: 2×2 supersampling).
    pub samples: usize,
    /// Write `camera.npy`, the DiT's camera tokens (large: 1.2 MB per chunk).
    pub camera_tensor: bool,
    /// Worker threads (default: all cores).
    pub threads: Option<usize>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct DatasetSummary {
    pub clips: usize,
    pub frames: usize,
    pub seconds: f64,
}

/// The engine settings the data is made for (the `tiny` model's session).
pub fn engine_config(seed: u64) -> EngineConfig {
    EngineConfig::tiny(seed)
}

/// The renderer at the session's size and the engine's intrinsics.
pub fn renderer(cfg: &EngineConfig, samples: usize) -> Renderer {
    Renderer::new(
        Scene::new(),
        cfg.height,
        cfg.width,
        cfg.camera.intrinsics_832x480,
        samples,
    )
}

/// Video frames of a clip of `chunks` chunks of `chunk_frames` latents.
pub fn clip_frames(chunks: usize, chunk_frames: usize) -> usize {
    1 + VAE_TIME_STRIDE * (chunks * chunk_frames).saturating_sub(1)
}

/// `[R | t]` rows of a pose, 12 values.
fn pose_rows(p: &Pose) -> [f64; 12] {
    let mut out = [0.0; 12];
    for i in 0..3 {
        out[i * 4..i * 4 + 3].copy_from_slice(&p.r[i]);
        out[i * 4 + 3] = p.t[i];
    }
    out
}

/// Keys and mouse of a chunk: `w a s d q e i k` as 0/1, then mouse dx, dy in pixels.
pub fn control_row(c: &Controls) -> [f32; 10] {
    let b = |v: bool| if v { 1.0 } else { 0.0 };
    [
        b(c.w),
        b(c.a),
        b(c.s),
        b(c.d),
        b(c.q),
        b(c.e),
        b(c.i),
        b(c.k),
        c.mouse_dx as f32,
        c.mouse_dy as f32,
    ]
}

/// The camera tokens of every chunk of `t`, as the engine computes them for its chunks.
pub fn trajectory_camera_tokens(
    cfg: &EngineConfig,
    channels: usize,
    t: &Trajectory,
) -> Result<Vec<kernels::Tensor>> {
    let mut prev: Option<Pose> = None;
    let mut out = Vec::with_capacity(t.latent.len());
    for (poses, c) in t.latent.iter().zip(&t.controls) {
        out.push(camera_tokens(cfg, channels, prev.as_ref(), poses, c)?);
        prev = poses.last().copied();
    }
    Ok(out)
}

/// One rendered clip.
struct Clip {
    t: Trajectory,
    frames: Vec<u8>,
    camera: Vec<f32>,
}

fn make_clip(
    scene: &Scene,
    r: &Renderer,
    cfg: &EngineConfig,
    channels: usize,
    opts: &DatasetOptions,
    clip: u64,
) -> Result<Clip> {
    let t = trajectory::random(scene, cfg, opts.split, opts.seed, clip, opts.chunks);
    let mut frames = vec![0u8; t.poses.len() * r.frame_len()];
    for (i, f) in frames.chunks_exact_mut(r.frame_len()).enumerate() {
        r.render_into(&t.world_pose(i), f);
    }
    let camera = if opts.camera_tensor {
        trajectory_camera_tokens(cfg, channels, &t)?
            .iter()
            .flat_map(|x| x.to_vec_f32())
            .collect()
    } else {
        Vec::new()
    };
    Ok(Clip { t, frames, camera })
}

/// Writes the data set to `out` (created if missing).
pub fn export(out: &Path, opts: &DatasetOptions) -> Result<DatasetSummary> {
    let started = Instant::now();
    let cfg = engine_config(opts.seed);
    let model = ModelConfig::tiny();
    let channels = model
        .control_dim
        .ok_or_else(|| Error::Config("the tiny model takes no camera".into()))?;
    let (n, k) = (opts.clips, opts.chunks);
    let f = clip_frames(k, cfg.chunk_frames);
    let l = k * cfg.chunk_frames;
    if n == 0 || k == 0 {
        return Err(Error::Input(
            "--clips and --chunks must be at least 1".into(),
        ));
    }
    if n.saturating_mul(f) > MAX_FRAMES {
        return Err(Error::Input(format!(
            "{n} clips of {f} frames is more than {MAX_FRAMES} frames"
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::File {
        path: out.to_path_buf(),
        msg: e.to_string(),
    })?;
    let (h, w) = (cfg.height, cfg.width);
    let (gh, gw) = (h / 16, w / 16);
    let tokens = cfg.chunk_frames * gh * gw;
    let feat = channels * 256;
    let mut files = vec![
        ("frames", NpyType::U8, vec![n, f, h, w, 3]),
        ("controls", NpyType::F32, vec![n, k, 10]),
        ("poses", NpyType::F64, vec![n, f, 3, 4]),
        ("latent_poses", NpyType::F64, vec![n, l, 3, 4]),
        ("rel_poses", NpyType::F64, vec![n, l, 3, 4]),
        ("spawn", NpyType::F64, vec![n, 3, 4]),
    ];
    if opts.camera_tensor {
        files.push(("camera", NpyType::F32, vec![n, k, tokens, feat]));
    }
    let mut writers = files
        .iter()
        .map(|(name, ty, shape)| NpyWriter::create(&out.join(format!("{name}.npy")), *ty, shape))
        .collect::<Result<Vec<_>>>()?;

    let scene = Scene::new();
    let r = renderer(&cfg, opts.samples);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.unwrap_or(0))
        .build()
        .map_err(|e| Error::Config(format!("thread pool: {e}")))?;
    let batch = pool.current_num_threads() * 4;
    let step = cfg.camera.step_length();
    for start in (0..n).step_by(batch) {
        let ids: Vec<u64> = (start..(start + batch).min(n)).map(|i| i as u64).collect();
        let clips = pool.install(|| {
            ids.par_iter()
                .map(|&i| make_clip(&scene, &r, &cfg, channels, opts, i))
                .collect::<Result<Vec<_>>>()
        })?;
        for c in &clips {
            writers[0].write_u8(&c.frames)?;
            let controls: Vec<f32> = c.t.controls.iter().flat_map(control_row).collect();
            writers[1].write_f32(&controls)?;
            let rows = |ps: &[Pose]| -> Vec<f64> { ps.iter().flat_map(pose_rows).collect() };
            writers[2].write_f64(&rows(&c.t.poses))?;
            let latent: Vec<Pose> = c.t.latent.concat();
            writers[3].write_f64(&rows(&latent))?;
            let mut rel = Vec::with_capacity(l);
            let mut prev: Option<Pose> = None;
            for chunk in &c.t.latent {
                rel.extend(relative_poses(prev.as_ref(), chunk, step));
                prev = chunk.last().copied();
            }
            writers[4].write_f64(&rows(&rel))?;
            writers[5].write_f64(&pose_rows(&c.t.spawn))?;
            if opts.camera_tensor {
                writers[6].write_f32(&c.camera)?;
            }
        }
    }
    for wr in writers {
        wr.finish()?;
    }
    let k_px = CameraConfig::intrinsics_px(cfg.camera.intrinsics_832x480, h, w);
    let mut rays = NpyWriter::create(&out.join("pixel_rays.npy"), NpyType::F64, &[h, w, 3])?;
    let dirs: Vec<f64> = (0..h)
        .flat_map(|v| (0..w).flat_map(move |u| pixel_ray(k_px, u, v)))
        .collect();
    rays.write_f64(&dirs)?;
    rays.finish()?;

    let mut file_meta = serde_json::Map::new();
    for (name, ty, shape) in files.iter().chain(std::iter::once(&(
        "pixel_rays",
        NpyType::F64,
        vec![h, w, 3],
    ))) {
        file_meta.insert(
            format!("{name}.npy"),
            json!({"dtype": ty.numpy_name(), "shape": shape}),
        );
    }
    let cam = &cfg.camera;
    let meta = json!({
        "format": "worldline-world-dataset/1",
        "split": opts.split.name(),
        "seed": opts.seed,
        "clips": n,
        "chunks": k,
        "latent_frames_per_chunk": cfg.chunk_frames,
        "latent_frames": l,
        "video_frames": f,
        "first_chunk_video_frames": clip_frames(1, cfg.chunk_frames),
        "later_chunk_video_frames": VAE_TIME_STRIDE * cfg.chunk_frames,
        "fps": MODEL_FPS,
        "height": h,
        "width": w,
        "supersampling": opts.samples,
        "camera": {
            "move_speed_m_per_s": cam.move_speed,
            "turn_rate_deg_per_s": cam.turn_rate_deg,
            "mouse_deg_per_px": cam.mouse_deg_per_px,
            "max_pitch_deg": cam.max_pitch_deg,
            "intrinsics_832x480": cam.intrinsics_832x480,
            "intrinsics_px": k_px,
            "step_length_m": step,
        },
        "model": {
            "name": model.name,
            "control_dim": channels,
            "camera_tokens_per_chunk": tokens,
            "camera_features": feat,
            "latent_hw": [h / 8, w / 8],
            "token_grid": [cfg.chunk_frames, gh, gw],
        },
        "engine": {
            "step_indices": cfg.step_indices,
            "shift": cfg.shift,
            "num_train_steps": cfg.num_train_steps,
            "window_frames": cfg.window_frames,
            "sink_frames": cfg.sink_frames,
        },
        "controls_columns": ["w", "a", "s", "d", "q", "e", "i", "k", "mouse_dx_px", "mouse_dy_px"],
        "files": file_meta,
    });
    let text = serde_json::to_string_pretty(&meta).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(out.join("meta.json"), text).map_err(|e| Error::File {
        path: out.join("meta.json"),
        msg: e.to_string(),
    })?;
    Ok(DatasetSummary {
        clips: n,
        frames: n * f,
        seconds: started.elapsed().as_secs_f64(),
    })
}
