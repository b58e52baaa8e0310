//! The streaming chunk engine (MODELS.md §5): per chunk of latent frames, a few flow-matching
//! steps with re-noising between them, then a pass at t = 0 that rewrites the chunk's K/V with
//! clean context. Caches: self-attention K/V (sink + rolling window), text K/V per prompt, camera
//! scale/shift per chunk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kernels::{ops, DType, KvCache, Tensor};
use sp::{Communicator, TokenShard};
use tracing::{debug, info_span};

use crate::camera::{ray_token_rows, relative_poses, CameraConfig, CameraRig, Controls, Pose};
use crate::config::{LATENT_CHANNELS, MASK_CHANNELS, VAE_STRIDE};
use crate::model::{Attn, CameraContext, TextContext, WanModel, ROPE_POSITIONS};
use crate::rng::NormalRng;
use crate::sampler::FlowSchedule;
use crate::{Error, Result};

/// Session settings of the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Output size in pixels (multiples of 16).
    pub height: usize,
    pub width: usize,
    /// Latent frames per chunk (LingBot v1 Fast: 3).
    pub chunk_frames: usize,
    /// Latent frames the self-attention cache keeps, sink frames included.
    pub window_frames: usize,
    pub sink_frames: usize,
    /// Indices into the schedule table (LingBot v2: `[0, 250, 500, 750]`).
    pub step_indices: Vec<usize>,
    pub shift: f64,
    pub num_train_steps: usize,
    /// Seed of the session's noise.
    pub seed: u64,
    pub camera: CameraConfig,
    /// The first-frame latent `[16, H/8, W/8]` (flat) every session of an I2V model starts from,
    /// and returns to on reset, unless [`Engine::set_first_frame`] gives another (the embedded
    /// default: its world's first view).
    pub first_latent: Option<Vec<f32>>,
}

impl EngineConfig {
    /// LingBot's streaming settings at 480×832: chunks of 3, a window of 18 with 6 sink frames,
    /// the v2 step list, shift 10.
    pub fn lingbot(seed: u64) -> Self {
        EngineConfig {
            height: 480,
            width: 832,
            chunk_frames: 3,
            window_frames: 18,
            sink_frames: 6,
            step_indices: vec![0, 250, 500, 750],
            shift: 10.0,
            num_train_steps: 1000,
            seed,
            camera: CameraConfig::default(),
            first_latent: None,
        }
    }

    /// The same loop at 128×128 for the `tiny` model.
    pub fn tiny(seed: u64) -> Self {
        EngineConfig {
            height: 128,
            width: 128,
            ..Self::lingbot(seed)
        }
    }

    pub fn latent_hw(&self) -> (usize, usize) {
        (self.height / VAE_STRIDE, self.width / VAE_STRIDE)
    }

    /// Checks the settings an engine would refuse, without building one (so a command line can
    /// fail before any weights load).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.height == 0
            || self.width == 0
            || !self.height.is_multiple_of(16)
            || !self.width.is_multiple_of(16)
        {
            return bad(format!(
                "resolution {}×{} must be non-zero multiples of 16",
                self.height, self.width
            ));
        }
        if self.chunk_frames == 0 {
            return bad("chunk_frames must be at least 1".into());
        }
        if self.window_frames < self.sink_frames + self.chunk_frames {
            return bad(format!(
                "a window of {} frames cannot hold {} sink frames and a chunk of {}",
                self.window_frames, self.sink_frames, self.chunk_frames
            ));
        }
        // Each step must start from more noise than the next re-noises to.
        if let Some(w) = self.step_indices.windows(2).find(|w| w[0] >= w[1]) {
            return bad(format!(
                "step indices must increase (from the noisiest step on): {} then {}",
                w[0], w[1]
            ));
        }
        FlowSchedule::new(self.num_train_steps, self.shift)?.steps(&self.step_indices)?;
        Ok(())
    }
}

/// What arrived for one chunk.
#[derive(Clone, Debug, Default)]
pub struct ChunkInputs {
    pub controls: Controls,
}

/// Wall time of the stages of one chunk.
#[derive(Clone, Debug, Default)]
pub struct ChunkTimings {
    pub camera: Duration,
    pub steps: Vec<Duration>,
    pub refresh: Duration,
}

/// One generated chunk.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub index: u64,
    /// Absolute index of the chunk's first latent frame.
    pub first_frame: u64,
    /// Clean latents `[16, chunk_frames, H/8, W/8]` for the decoder.
    pub latents: Tensor,
    /// Absolute camera pose of each latent frame.
    pub poses: Vec<Pose>,
    pub timings: ChunkTimings,
}

/// A streaming session on one model.
#[derive(Debug)]
pub struct Engine {
    model: Arc<WanModel>,
    cfg: EngineConfig,
    schedule: FlowSchedule,
    steps: Vec<i64>,
    caches: Vec<KvCache>,
    text: TextContext,
    first_latent: Option<Tensor>,
    rng: NormalRng,
    rig: CameraRig,
    last_pose: Option<Pose>,
    next_frame: u64,
    next_chunk: u64,
    /// Under sequence parallelism: this rank's communicator. The engine state (noise, camera
    /// rig, sampler) is replicated on every rank and evolves identically; the DiT runs on the
    /// rank's token shard and its caches hold the rank's heads.
    comm: Option<Arc<dyn Communicator>>,
    /// Measurement only: see [`set_resend_window`](Self::set_resend_window).
    resend_window: bool,
    /// The edit the next chunk starts from (set by [`next_chunk_edit`](Self::next_chunk_edit)).
    edit: Option<Edit>,
}

/// Edit mode's input for one chunk: the camera chunk's latents and how far to move from them.
#[derive(Clone, Debug)]
pub struct Edit {
    /// `[16, chunk_frames, H/8, W/8]`, normalised like the DiT's latents.
    pub latents: Tensor,
    /// 0 keeps the input; 1 starts from pure noise (world mode's steps).
    pub strength: f64,
}

impl Engine {
    pub fn new(model: Arc<WanModel>, cfg: EngineConfig) -> Result<Self> {
        Self::build(model, cfg, None)
    }

    /// One rank's engine of a rank group on `comm` (see [`crate::parallel::EngineGroup`]).
    pub fn with_communicator(
        model: Arc<WanModel>,
        cfg: EngineConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        Self::build(model, cfg, Some(comm))
    }

    fn build(
        model: Arc<WanModel>,
        cfg: EngineConfig,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        cfg.validate()?;
        let mc = &model.cfg;
        let schedule = FlowSchedule::new(cfg.num_train_steps, cfg.shift)?;
        let steps = schedule.steps(&cfg.step_indices)?;
        let (h, w) = cfg.latent_hw();
        let frame_hw = [h / mc.patch[1], w / mc.patch[2]];
        let tokens_per_frame = frame_hw[0] * frame_hw[1];
        // GPUs attend in bf16 (the tensor-core kernel); the CPU reference keeps f32.
        let cache_dtype = if model.device().is_cpu() {
            DType::F32
        } else {
            DType::BF16
        };
        let cards = comm.as_ref().map_or(1, |c| c.world_size());
        let heads = sp::heads_per_card(mc.num_heads, cards)?;
        let caches = (0..mc.num_layers)
            .map(|_| {
                KvCache::new_on(
                    cfg.window_frames,
                    cfg.sink_frames,
                    tokens_per_frame,
                    heads,
                    mc.head_dim(),
                    cache_dtype,
                    model.device(),
                )
            })
            .map(|c| match c {
                Ok(c) if model.fp8_attention => c.with_fp8_attention(),
                // Sparse attention's key-tile means from sums kept as frames arrive, so a call
                // reads its chunk's keys for them instead of the whole window's.
                Ok(c) if model.sparse_attention().is_some() => c.with_key_sums(frame_hw),
                other => other,
            })
            .collect::<kernels::Result<Vec<_>>>()?;
        // Until a prompt arrives the context is all padding (what an empty prompt pads to).
        let text = model.encode_text(&Tensor::zeros(&[0, mc.text_dim], DType::F32)?, None)?;
        let mut engine = Engine {
            rng: NormalRng::for_name(cfg.seed, "noise"),
            rig: CameraRig::new(cfg.camera.clone()),
            model,
            schedule,
            steps,
            caches,
            text,
            first_latent: None,
            last_pose: None,
            next_frame: 0,
            next_chunk: 0,
            cfg,
            comm,
            resend_window: false,
            edit: None,
        };
        engine.set_default_first_frame()?;
        Ok(engine)
    }

    /// The configured first frame, if any ([`EngineConfig::first_latent`]).
    fn set_default_first_frame(&mut self) -> Result<()> {
        if let Some(lat) = &self.cfg.first_latent {
            let (h, w) = self.cfg.latent_hw();
            let t = Tensor::from_vec(lat.clone(), &[LATENT_CHANNELS, h, w]).map_err(|_| {
                Error::Config(format!(
                    "first_latent holds {} values, expected [{LATENT_CHANNELS}, {h}, {w}]",
                    lat.len()
                ))
            })?;
            self.set_first_frame(&t)?;
        }
        Ok(())
    }

    /// Under sequence parallelism, makes every attention call also move the cached window's
    /// K/V through the links as the stock Ulysses layout must, so `worker bench sp` measures
    /// both exchanges on one run. The output does not change.
    pub fn set_resend_window(&mut self, on: bool) {
        self.resend_window = on;
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The timesteps each chunk is denoised at.
    pub fn timesteps(&self) -> &[i64] {
        &self.steps
    }

    /// Sets the prompt from text-encoder output `[n ≤ text_len, text_dim]`; takes effect at the
    /// next chunk. Its cross-attention K/V are computed once here.
    pub fn set_prompt(&mut self, context: &Tensor) -> Result<()> {
        self.text = self.model.encode_text(context, None)?;
        Ok(())
    }

    /// Sets the first-frame latent `[16, H/8, W/8]` (I2V conditioning of latent frame 0). Only
    /// before the first chunk: later frames see it through the cache, not through their input.
    pub fn set_first_frame(&mut self, latent: &Tensor) -> Result<()> {
        let (h, w) = self.cfg.latent_hw();
        if latent.shape() != [LATENT_CHANNELS, h, w] {
            return Err(Error::Input(format!(
                "first-frame latent {:?}: expected [{LATENT_CHANNELS}, {h}, {w}]",
                latent.shape()
            )));
        }
        if !self.model.cfg.is_i2v() {
            return Err(Error::Input(format!(
                "model '{}' takes no first frame",
                self.model.cfg.name
            )));
        }
        if self.next_frame != 0 {
            return Err(Error::Input(
                "the first frame can only be set before the first chunk (reset first)".into(),
            ));
        }
        self.first_latent = Some(
            latent
                .reshape(&[LATENT_CHANNELS, 1, h, w])?
                .to_device(self.model.device())?,
        );
        Ok(())
    }

    /// Starts the stream over: empty caches, camera at the origin, noise from the seed again,
    /// the configured first frame (if any) again.
    pub fn reset(&mut self) {
        self.caches.iter_mut().for_each(KvCache::clear);
        self.rng = NormalRng::for_name(self.cfg.seed, "noise");
        self.rig = CameraRig::new(self.cfg.camera.clone());
        self.first_latent = None;
        self.last_pose = None;
        self.next_frame = 0;
        self.next_chunk = 0;
        // Checked when the engine was built: it fits.
        let _ = self.set_default_first_frame();
    }

    /// Shape of one noise draw: `[16, chunk_frames, H/8, W/8]`.
    pub fn noise_shape(&self) -> [usize; 4] {
        let (h, w) = self.cfg.latent_hw();
        [LATENT_CHANNELS, self.cfg.chunk_frames, h, w]
    }

    /// Standard normal noise from the session stream, `NormalRng::for_name(seed, "noise")`. The
    /// draw order (per chunk: the initial noise, then one draw per re-noise) is part of the
    /// contract: any backend or card count reproduces it.
    fn draw_noise(&mut self) -> Result<Tensor> {
        let shape = self.noise_shape();
        let noise = Tensor::from_vec(self.rng.normals_fast(shape.iter().product()), &shape)?;
        Ok(noise.to_device(self.model.device())?)
    }

    /// First-frame conditioning of the chunk: 4 mask channels (1 on absolute latent frame 0) and
    /// the first-frame latent on that frame, zeros elsewhere.
    fn conditioning(&self) -> Result<Tensor> {
        let [_, f, h, w] = self.noise_shape();
        let plane = h * w;
        let mut y = vec![0f32; (MASK_CHANNELS + LATENT_CHANNELS) * f * plane];
        if let (0, Some(first)) = (self.next_frame, &self.first_latent) {
            for c in 0..MASK_CHANNELS {
                y[c * f * plane..][..plane].fill(1.0);
            }
            let lat = first.to_vec_f32();
            for c in 0..LATENT_CHANNELS {
                y[(MASK_CHANNELS + c) * f * plane..][..plane]
                    .copy_from_slice(&lat[c * plane..][..plane]);
            }
        }
        let y = Tensor::from_vec(y, &[MASK_CHANNELS + LATENT_CHANNELS, f, h, w])?;
        Ok(y.to_device(self.model.device())?)
    }

    /// Edit mode (streaming video-to-video): the chunk starts from the camera chunk's
    /// `latents` noised to the level `strength` picks, then runs the few-step loop (with the
    /// prompt, the camera conditioning and the cache of earlier chunks) and the K/V refresh as
    /// [`next_chunk`](Self::next_chunk) does. Strength 0 returns the input latents unchanged.
    pub fn next_chunk_edit(&mut self, inputs: &ChunkInputs, edit: &Edit) -> Result<Chunk> {
        let want = self.noise_shape();
        if edit.latents.shape() != want {
            return Err(Error::Input(format!(
                "edit latents {:?}: expected {want:?}",
                edit.latents.shape()
            )));
        }
        if !(0.0..=1.0).contains(&edit.strength) {
            return Err(Error::Input(format!(
                "edit strength {}: expected 0 to 1",
                edit.strength
            )));
        }
        self.edit = Some(edit.clone());
        let chunk = self.next_chunk(inputs);
        self.edit = None;
        chunk
    }

    /// The steps of an edit and its starting latents. The steps are as many as world mode's,
    /// spread over the schedule table from the first entry whose σ is at most `strength` to
    /// its end, so strength 1 gives world mode's steps and lower strengths start later (less
    /// noise). The start mixes the input with fresh noise at that entry's σ, as re-noising
    /// between steps does.
    fn edit_start(&mut self, edit: &Edit) -> Result<(Vec<i64>, Tensor)> {
        let dev = self.model.device();
        let latents = edit.latents.to_dtype(DType::F32)?.to_device(dev)?;
        let first = self.schedule.first_at_most(edit.strength);
        let Some(first) = first else {
            // Nothing to denoise: the chunk is its input (the refresh still caches it).
            return Ok((Vec::new(), latents));
        };
        let n = self.steps.len();
        let len = self.schedule.len();
        let indices: Vec<usize> = (0..n).map(|k| first + k * (len - first) / n).collect();
        let steps = self.schedule.steps(&indices)?;
        let sigma = self.schedule.sigma_second(steps[0])?;
        let noise = self.draw_noise()?;
        Ok((steps, ops::axpby(1.0 - sigma, &latents, sigma, &noise)?))
    }

    /// Generates the next chunk.
    pub fn next_chunk(&mut self, inputs: &ChunkInputs) -> Result<Chunk> {
        let index = self.next_chunk;
        let first_frame = self.next_frame;
        let span = info_span!("chunk", index, first_frame);
        let _enter = span.enter();
        let n = self.cfg.chunk_frames;
        if first_frame as usize + n > ROPE_POSITIONS {
            return Err(Error::Input(format!(
                "the session reached latent frame {first_frame}: RoPE positions end at {ROPE_POSITIONS}; reset the session"
            )));
        }
        let model = self.model.clone();
        let mc = &model.cfg;
        let mut timings = ChunkTimings::default();

        let started = Instant::now();
        let poses = self.rig.latent_poses(&inputs.controls, first_frame, n);
        let camera = match mc.control_dim {
            Some(channels) => {
                // A rank builds only its own shard's tokens: the whole chunk's rays would cost
                // every rank the one-card time, in which its card waits.
                let (ranks, rank) = self
                    .comm
                    .as_ref()
                    .map_or((1, 0), |c| (c.world_size(), c.rank()));
                let rays = camera_token_rows(
                    &self.cfg,
                    channels,
                    self.last_pose.as_ref(),
                    &poses,
                    &inputs.controls,
                    ranks,
                    rank,
                )?;
                Some(model.camera_context(&rays)?)
            }
            None => None,
        };
        timings.camera = started.elapsed();

        let y = if mc.is_i2v() {
            Some(self.conditioning()?)
        } else {
            None
        };
        let with_y = |x: &Tensor| -> Result<Tensor> {
            Ok(match &y {
                Some(y) => Tensor::cat(&[x, y], 0)?,
                None => x.clone(),
            })
        };
        let (steps, mut x) = match self.edit.take() {
            None => (self.steps.clone(), self.draw_noise()?),
            Some(edit) => self.edit_start(&edit)?,
        };
        let mut x0 = x.clone();
        for (s, &t) in steps.iter().enumerate() {
            let started = Instant::now();
            let attn = Attn::Cache {
                caches: &mut self.caches,
                kv_only: false,
                resend_window: self.resend_window,
            };
            let v = dit(
                &model,
                self.comm.as_deref(),
                &with_y(&x)?,
                t as f64,
                first_frame,
                &self.text,
                camera.as_ref(),
                attn,
            )?
            .ok_or_else(|| Error::Config("forward returned no output".into()))?;
            x0 = ops::axpby(1.0, &x, -self.schedule.sigma_first(t)?, &v)?;
            if let Some(&next) = steps.get(s + 1) {
                let sigma = self.schedule.sigma_second(next)?;
                let noise = self.draw_noise()?;
                x = ops::axpby(1.0 - sigma, &x0, sigma, &noise)?;
            }
            timings.steps.push(started.elapsed());
            debug!(step = s, t, "denoised");
        }
        let started = Instant::now();
        let attn = Attn::Cache {
            caches: &mut self.caches,
            kv_only: true,
            resend_window: self.resend_window,
        };
        dit(
            &model,
            self.comm.as_deref(),
            &with_y(&x0)?,
            0.0,
            first_frame,
            &self.text,
            camera.as_ref(),
            attn,
        )?;
        timings.refresh = started.elapsed();

        self.last_pose = poses.last().copied();
        self.next_frame += n as u64;
        self.next_chunk += 1;
        Ok(Chunk {
            index,
            first_frame,
            latents: x0,
            poses,
            timings,
        })
    }
}

/// The DiT's camera input for one chunk, `[frames·(H/16)·(W/16), channels·256]` tokens (before
/// any sequence-parallel sharding): the chunk's latent poses relative to their predecessors
/// (`prev`: the last latent pose of the previous chunk, `None` at the session start), translations
/// in full-speed steps, as per-pixel rays at the session's size, folded into tokens. The engine
/// and the training-set exporter both call this, so what the model is trained on is what it sees.
pub fn camera_tokens(
    cfg: &EngineConfig,
    channels: usize,
    prev: Option<&Pose>,
    poses: &[Pose],
    controls: &Controls,
) -> Result<Tensor> {
    camera_token_rows(cfg, channels, prev, poses, controls, 1, 0)
}

/// Rank `rank`'s token shard (of `ranks`, see [`TokenShard`]) of [`camera_tokens`], zero-padded
/// as [`TokenShard::take`] pads it, computed without the other ranks' tokens.
pub fn camera_token_rows(
    cfg: &EngineConfig,
    channels: usize,
    prev: Option<&Pose>,
    poses: &[Pose],
    controls: &Controls,
    ranks: usize,
    rank: usize,
) -> Result<Tensor> {
    let n = poses.len();
    let rel = relative_poses(prev, poses, cfg.camera.step_length());
    let wasd = vec![controls.wasd(); n];
    let (h, w) = (cfg.height, cfg.width);
    let tokens = n * (h / (2 * VAE_STRIDE)) * (w / (2 * VAE_STRIDE));
    let shard = TokenShard::new(tokens, ranks, rank)?;
    ray_token_rows(
        &rel,
        &wasd,
        h,
        w,
        cfg.camera.intrinsics_832x480,
        channels,
        shard.start(),
        shard.real(),
        shard.per_rank(),
    )
}

/// One DiT forward, on this rank's shard when the engine is part of a rank group.
#[allow(clippy::too_many_arguments)]
fn dit(
    model: &WanModel,
    comm: Option<&dyn Communicator>,
    x: &Tensor,
    t: f64,
    first_frame: u64,
    text: &TextContext,
    camera: Option<&CameraContext>,
    attn: Attn,
) -> Result<Option<Tensor>> {
    match comm {
        None => model.forward(x, t, first_frame, text, camera, attn, None),
        Some(c) => model.forward_parallel(x, t, first_frame, text, camera, attn, c),
    }
}
