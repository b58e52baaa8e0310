//! From command-line flags to a loaded model, with the checks a user should hit before any
//! weights are read.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use kernels::{DType, Device};
use pipeline::world::{self, assets::WorldAssets};
use pipeline::{EngineConfig, EngineGroup, ModelConfig, ModelLoader, WanModel, WeightStore};

use crate::decode::{DecoderArgs, DecoderKind};
use crate::stream::StreamArgs;
use tracing::{info, warn};

#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Model: tiny, lingbot-1.3b or lingbot-14b (append -act for the WASD action variant).
    #[arg(long, default_value = "tiny", global = true)]
    pub model: String,

    /// Checkpoint: a .safetensors file, a *.safetensors.index.json, or a folder with either;
    /// `random` for random weights from --seed. Without it, `tiny` runs the embedded default
    /// (trained on the procedural world, if this binary was built with it) and other models are
    /// random.
    #[arg(long, global = true)]
    pub weights: Option<PathBuf>,

    /// Device: auto (the first CUDA GPU when one answers, else cpu), cpu, cuda[:N] or rocm[:N].
    #[arg(long, default_value = "auto", global = true)]
    pub device: String,

    /// Cards for Ulysses sequence parallelism (the head count must divide by it).
    #[arg(long, default_value_t = 1, global = true)]
    pub cards: usize,

    /// GPUs of a multi-card run, comma-separated (e.g. 0,2): as many as --cards. Default: the
    /// --cards GPUs from the --device index on.
    #[arg(long, global = true, value_delimiter = ',')]
    pub gpus: Option<Vec<usize>>,

    /// Seed of random weights and of session noise.
    #[arg(long, default_value_t = 0, global = true)]
    pub seed: u64,

    /// Run dtype of the weights: f32, bf16, or fp8 (a bf16 model whose DiT blocks run their
    /// attention projections and FFN as fp8 e4m3 linears: weights per output channel,
    /// activations per token, quantized by the norm that writes them).
    #[arg(long, default_value = "f32", global = true)]
    pub dtype: String,

    /// Self-attention over the KV cache: bf16 (dense, in the model's dtype), fp8 (e4m3 q, k,
    /// v and softmax weights, one scale per 128-row tile and head, over an fp8 copy of the
    /// cache; Hopper's kernel, gfx950's and gfx94x's, or the CPU reference), or `vsa` /
    /// `vsa:SPARSITY` (sparse: each 4×4×4 query tile attends to the share 1 − SPARSITY of the
    /// key tiles whose means score highest, 0.9 by default; the model was trained dense, so
    /// this approximates it).
    #[arg(long, default_value = "bf16", global = true)]
    pub attention: String,

    #[command(flatten)]
    pub stream: StreamArgs,
}

/// Where the DiT's weights came from: for logs and `/status`.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightsSource {
    /// Built into the binary: the default model trained on the procedural world.
    Embedded,
    File(PathBuf),
    Random {
        seed: u64,
    },
}

impl WeightsSource {
    /// What `/status` says.
    pub fn json(&self) -> serde_json::Value {
        match self {
            WeightsSource::Embedded => serde_json::json!({
                "state": "embedded",
                "what": "the default world model, trained on the procedural world (pipeline/assets/world/TRAINING.md)",
            }),
            WeightsSource::File(p) => {
                serde_json::json!({"state": "loaded", "path": p.display().to_string()})
            }
            WeightsSource::Random { seed } => serde_json::json!({"state": "random", "seed": seed}),
        }
    }

    pub fn is_random(&self) -> bool {
        matches!(self, WeightsSource::Random { .. })
    }
}

/// The weights `args` ask for: `random`, a path, or (none given) the embedded default of
/// `tiny` when this build has it.
fn weights_source(args: &ModelArgs, cfg: &ModelConfig) -> WeightsSource {
    match &args.weights {
        Some(p) if p.as_os_str() == "random" => WeightsSource::Random { seed: args.seed },
        Some(p) => WeightsSource::File(p.clone()),
        None if cfg.name == world::assets::MODEL && world::assets::embedded().is_some() => {
            WeightsSource::Embedded
        }
        None => WeightsSource::Random { seed: args.seed },
    }
}

impl ModelArgs {
    /// `--device`, with `auto` resolved to the best device present: a CUDA GPU that answers,
    /// else a ROCm GPU (with a warning: that backend has never run on an AMD GPU), else the CPU.
    pub fn device(&self) -> Result<Device> {
        if self.device == "auto" {
            if Device::Cuda(0).ensure_available().is_ok() {
                return Ok(Device::Cuda(0));
            }
            if Device::Rocm(0).ensure_available().is_ok() {
                tracing::warn!("{}", kernels::rocm::UNRUN);
                return Ok(Device::Rocm(0));
            }
            return Ok(Device::Cpu);
        }
        self.device.parse().map_err(anyhow::Error::msg)
    }
}

/// The model's streaming defaults before any loop flag: `tiny` at 128×128, LingBot at 480×832.
pub fn engine_defaults(cfg: &ModelConfig, seed: u64) -> EngineConfig {
    if cfg.name.starts_with("tiny") {
        EngineConfig::tiny(seed)
    } else {
        EngineConfig::lingbot(seed)
    }
}

pub struct Loaded {
    pub cfg: ModelConfig,
    pub weights: WeightsSource,
    /// The embedded world's assets when its DiT runs (its decoder and first frame go with it).
    pub world: Option<WorldAssets>,
    /// The I2V first-frame latent every session starts from (the embedded world's first view).
    pub first_latent: Option<Vec<f32>>,
    /// The streaming loop's flags, checked when loading.
    pub stream: StreamArgs,
    /// The model, loaded here; `None` for a GPU rank group, whose ranks each load their own.
    pub model: Option<Arc<WanModel>>,
    /// Ranks of the session (threads over the loopback communicator on the CPU).
    pub cards: usize,
    /// A GPU rank group: its GPUs in rank order (all CUDA or all ROCm) and how each rank loads
    /// its model.
    pub gpu_group: Option<(Vec<Device>, Arc<ModelLoader>)>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loaded({}, {} card(s))", self.cfg.name, self.cards)
    }
}

impl Loaded {
    /// Session settings: the model's defaults with the streaming loop's flags applied.
    pub fn engine_config(&self, seed: u64) -> Result<EngineConfig> {
        let cfg = self.stream.apply(engine_defaults(&self.cfg, seed))?;
        Ok(EngineConfig {
            first_latent: self.first_latent.clone(),
            ..cfg
        })
    }

    /// [`engine_config`](Self::engine_config) at another size: the embedded world's first
    /// view is rendered and encoded again at that size.
    pub fn engine_config_at(&self, seed: u64, width: usize, height: usize) -> Result<EngineConfig> {
        let mut cfg = EngineConfig {
            width,
            height,
            ..self.engine_config(seed)?
        };
        if let Some(w) = &self.world {
            let mut enc = w.encoder().context("loading the embedded encoder")?;
            cfg.first_latent = Some(
                world::assets::first_latent(&mut enc, &cfg).context("encoding the first view")?,
            );
        }
        Ok(cfg)
    }

    /// The decoder flags with the embedded world's decoder as the default of its model: a tiny
    /// decoder with no `--decoder-weights` is the one trained with the DiT.
    pub fn decoder_args(&self, args: &DecoderArgs) -> DecoderArgs {
        let mut out = args.clone();
        if args.decoder == DecoderKind::Tiny && args.decoder_weights.is_none() {
            out.world = self.world;
        }
        out
    }

    /// The rank group of a multi-card session: NCCL across CUDA GPUs, RCCL across ROCm GPUs,
    /// loopback threads on the CPU.
    pub fn engine_group(&self, cfg: EngineConfig) -> Result<EngineGroup> {
        Ok(match (&self.gpu_group, &self.model) {
            (Some((gpus, load)), _) => {
                let ordinals: Vec<usize> = gpus
                    .iter()
                    .map(|d| match d {
                        Device::Cuda(i) | Device::Rocm(i) => Ok(*i),
                        Device::Cpu => Err(anyhow::anyhow!("a CPU in a GPU rank group")),
                    })
                    .collect::<Result<_>>()?;
                match gpus.first() {
                    Some(Device::Rocm(_)) => {
                        EngineGroup::rccl(&self.cfg, load.clone(), cfg, &ordinals)?
                    }
                    _ => EngineGroup::nccl(&self.cfg, load.clone(), cfg, &ordinals)?,
                }
            }
            (None, Some(model)) => EngineGroup::loopback(model.clone(), cfg, self.cards)?,
            (None, None) => bail!("no model and no rank group"),
        })
    }
}

/// A GPU with more than this much memory in use is taken to be someone else's.
pub const BUSY_GPU_BYTES: usize = 4 << 30;

/// Sets `key` to `value` unless the user set it; says so either way.
fn default_env(key: &str, value: &str, why: &str) {
    match std::env::var_os(key) {
        Some(v) => info!("{key}={} (set by the user)", v.to_string_lossy()),
        None => {
            // Set before any rank thread starts and before the library reads it.
            std::env::set_var(key, value);
            info!("{key}={value}: {why}");
        }
    }
}

/// The GPUs of a multi-card run: `--gpus`, or `--cards` of them from the device's index on.
fn choose_gpus(args: &ModelArgs, device: Device) -> Result<Vec<usize>> {
    let first = match device {
        Device::Cuda(i) | Device::Rocm(i) => i,
        Device::Cpu => bail!("no GPUs on the cpu device"),
    };
    let gpus = match &args.gpus {
        Some(list) => list.clone(),
        None => (first..first + args.cards).collect(),
    };
    if gpus.len() != args.cards {
        bail!(
            "--gpus lists {} GPU(s) ({gpus:?}) for --cards {}",
            gpus.len(),
            args.cards
        );
    }
    for (i, g) in gpus.iter().enumerate() {
        if gpus[..i].contains(g) {
            bail!("--gpus lists GPU {g} twice");
        }
    }
    Ok(gpus)
}

/// The ROCm backend's start-up check on `rocm:ordinal` (a few ops against the CPU reference):
/// it has never run on the project's machines, so a wrong result stops the worker here.
fn rocm_self_check(ordinal: usize) -> Result<()> {
    let started = std::time::Instant::now();
    // Where the newer fast paths fail the check and the forms they replaced pass it, the
    // process keeps to the latter (kernels::rocm::conservative_paths), says so, and serves.
    let (all, fast_failed) =
        kernels::rocm::self_check_with_fallback(ordinal).with_context(|| {
            format!(
            "rocm:{ordinal}: start-up check against the CPU reference, with the fast paths and \
             without them (other never-run paths can be set aside to find the culprit: \
             WORLDLINE_ROCM_ATTENTION=gemm, WORLDLINE_ROCM_FP8_GEMM=0)"
        )
        })?;
    if let Some(e) = fast_failed {
        tracing::warn!(
            device = %Device::Rocm(ordinal),
            error = %e,
            "ROCm start-up check failed with the fast paths (gfx950's 16x16x32 MFMA kernels, \
             rowwise fp8 scales and bias/GELU in hipBLASLt's GEMM) and passed without them: \
             running without them"
        );
    }
    kernels::rocm::note_self_check(ordinal, all.len());
    let worst = all
        .iter()
        .map(|a| a.rel_l2 / a.tolerance.max(f64::MIN_POSITIVE))
        .fold(0.0f64, f64::max);
    info!(
        device = %Device::Rocm(ordinal),
        ops = all.len(),
        worst_of_tolerance = format!("{worst:.3}"),
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "ROCm start-up check passed"
    );
    Ok(())
}

/// Fails, naming the GPU, unless each of `gpus` (of `device`'s kind) is present and idle
/// (memory in use below [`BUSY_GPU_BYTES`]).
fn check_idle(device: Device, gpus: &[usize]) -> Result<()> {
    const GIB: f64 = (1u64 << 30) as f64;
    for &g in gpus {
        let (name, (free, total)) = match device {
            Device::Rocm(_) => {
                let dev = kernels::rocm::backend(g).with_context(|| format!("GPU {g}"))?;
                let mem = dev.memory().with_context(|| format!("GPU {g}: memory"))?;
                (dev.name.clone(), mem)
            }
            _ => {
                let dev = kernels::cuda::backend(g).with_context(|| format!("GPU {g}"))?;
                let mem = dev.memory().with_context(|| format!("GPU {g}: memory"))?;
                (dev.name.clone(), mem)
            }
        };
        let used = total.saturating_sub(free);
        if used > BUSY_GPU_BYTES {
            bail!(
                "GPU {g} ({}) is busy: {:.1} GiB of {:.1} GiB in use (idle is below {:.0} GiB); \
                 choose idle GPUs with --gpus",
                name,
                used as f64 / GIB,
                total as f64 / GIB,
                BUSY_GPU_BYTES as f64 / GIB
            );
        }
        info!(
            gpu = g,
            name = %name,
            used_gib = format!("{:.1}", used as f64 / GIB),
            "GPU idle"
        );
    }
    Ok(())
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let cfg = ModelConfig::by_name(&args.model)?;
    let mut device = args.device()?;
    sp::heads_per_card(cfg.num_heads, args.cards)?;
    let stream = args.stream.apply(engine_defaults(&cfg, args.seed))?;
    info!(
        chunk_frames = stream.chunk_frames,
        window_frames = stream.window_frames,
        sink_frames = stream.sink_frames,
        steps = ?stream.step_indices,
        shift = stream.shift,
        "streaming loop"
    );
    if args.gpus.is_some() && device.is_cpu() {
        bail!("--gpus needs --device cuda or rocm");
    }
    let multi_gpu = !device.is_cpu() && args.cards > 1;
    let gpus = if device.is_cpu() {
        Vec::new()
    } else {
        choose_gpus(args, device)?
    };
    if let Some(&g) = gpus.first() {
        // The first card (the only one without --cards) is the one --gpus names.
        device = match device {
            Device::Rocm(_) => Device::Rocm(g),
            _ => Device::Cuda(g),
        };
    }
    if multi_gpu {
        if let Device::Rocm(_) = device {
            default_env(
                "HSA_NO_SCRATCH_RECLAIM",
                "1",
                "RCCL needs scratch memory kept across kernels on multi-card runs",
            );
        }
        // NVLink multicast (NVLS) buys nothing for these exchanges and can take a shared
        // host's GPUs down; keep it off unless asked for.
        default_env(
            "NCCL_NVLS_ENABLE",
            "0",
            "NVLink multicast stays off for sequence parallelism",
        );
    }
    device.ensure_available()?;
    if let Device::Rocm(first) = device {
        warn!(device = %device, "{}", kernels::rocm::UNRUN);
        let cards = if gpus.is_empty() {
            vec![first]
        } else {
            gpus.clone()
        };
        for g in cards {
            rocm_self_check(g)?;
        }
    }
    let (dtype, fp8_linears) = run_dtype(&args.dtype)?;
    let attention = attention(&args.attention)?;
    if let Attention::Sparse(s) = attention {
        warn!(
            sparsity = s,
            "SPARSE ATTENTION: the model was trained with dense attention; --attention vsa approximates it (its output differs from the model's)"
        );
    }
    let source = weights_source(args, &cfg);
    // The embedded model learned exactly the default loop (pipeline/assets/world/TRAINING.md).
    if source == WeightsSource::Embedded && stream != engine_defaults(&cfg, args.seed) {
        warn!(
            "the embedded model was trained with the default streaming loop (chunks of 3, a window of 18 with 6 sink frames, steps 0,250,500,750, shift 10); this one is outside what it learned"
        );
    }
    let world = match source {
        WeightsSource::Embedded => world::assets::embedded(),
        _ => None,
    };
    let open = {
        let source = source.clone();
        move |device: Device| -> Result<WeightStore> {
            Ok(match &source {
                WeightsSource::File(path) => WeightStore::open(path, dtype)
                    .with_context(|| format!("opening weights {}", path.display()))?,
                WeightsSource::Random { seed } => WeightStore::random(*seed, dtype),
                WeightsSource::Embedded => world
                    .context("no embedded weights in this build")?
                    .dit_store(dtype)?,
            }
            .on_device(device))
        }
    };
    match &source {
        WeightsSource::Random { seed } => warn!(
            model = %cfg.name,
            seed,
            "RANDOM WEIGHTS: the model is random from the seed (--weights random, or no --weights and no embedded default for this model); its output is noise, fit for timing only"
        ),
        WeightsSource::Embedded => info!(
            model = %cfg.name,
            "embedded default weights: trained on the procedural world (pipeline/assets/world/TRAINING.md)"
        ),
        WeightsSource::File(_) => {}
    }
    // The embedded world starts every session from its first view, encoded as in training.
    let first_latent = match &world {
        Some(w) => {
            let mut enc = w.encoder().context("loading the embedded encoder")?;
            let ecfg = EngineConfig::tiny(args.seed);
            Some(world::assets::first_latent(&mut enc, &ecfg).context("encoding the first view")?)
        }
        None => None,
    };
    if multi_gpu {
        check_idle(device, &gpus)?;
        let model_cfg = cfg.clone();
        let load: Arc<ModelLoader> = Arc::new(move |device| {
            let store = open(device).map_err(|e| pipeline::Error::Config(format!("{e:#}")))?;
            let started = std::time::Instant::now();
            let mut model = WanModel::load(&model_cfg, &store)?;
            if fp8_linears {
                model.quantize_linears_fp8()?;
            }
            attention.apply(&mut model)?;
            info!(
                model = %model_cfg.name,
                weights = %store.describe(),
                device = %device,
                seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                "rank model ready"
            );
            Ok(model)
        });
        let (library, gpus): (&str, Vec<Device>) = match device {
            Device::Rocm(_) => {
                warn!(
                    "{}; its RCCL rank group has never run either",
                    kernels::rocm::UNRUN
                );
                ("RCCL", gpus.iter().map(|&g| Device::Rocm(g)).collect())
            }
            _ => ("NCCL", gpus.iter().map(|&g| Device::Cuda(g)).collect()),
        };
        info!(model = %cfg.name, ?gpus, "sequence parallel over {library}");
        return Ok(Loaded {
            cfg,
            weights: source,
            world,
            first_latent,
            stream: args.stream.clone(),
            model: None,
            cards: gpus.len(),
            gpu_group: Some((gpus, load)),
        });
    }
    let store = open(device)?;
    let started = std::time::Instant::now();
    let mut model =
        WanModel::load(&cfg, &store).with_context(|| format!("loading {}", store.describe()))?;
    if fp8_linears {
        model
            .quantize_linears_fp8()
            .context("--dtype fp8: quantizing the DiT's linears")?;
    }
    attention
        .apply(&mut model)
        .with_context(|| format!("--attention {}", args.attention))?;
    info!(
        model = %cfg.name,
        weights = %store.describe(),
        dtype = if fp8_linears { "bf16 + fp8 linears" } else { dtype.name() },
        attention = %attention.describe(),
        device = %device,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model ready"
    );
    Ok(Loaded {
        cfg,
        weights: source,
        world,
        first_latent,
        stream: args.stream.clone(),
        model: Some(Arc::new(model)),
        cards: args.cards,
        gpu_group: None,
    })
}

/// How the DiT's self-attention runs (`--attention`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Attention {
    /// Dense, in the model's dtype.
    Dense,
    /// Dense over an fp8 copy of the KV cache.
    Fp8,
    /// VSA's fine branch keeping the share `1 − sparsity` of the key tiles.
    Sparse(f64),
}

/// VSA's sparsity where `--attention vsa` names none: FastVideo's.
pub const DEFAULT_SPARSITY: f64 = 0.9;

impl Attention {
    pub fn apply(self, model: &mut pipeline::WanModel) -> pipeline::Result<()> {
        match self {
            Attention::Dense => Ok(()),
            Attention::Fp8 => model.use_fp8_attention(),
            Attention::Sparse(s) => model.use_sparse_attention(s),
        }
    }

    /// For logs and `/status`: what runs, and that sparse attention approximates the model.
    pub fn describe(self) -> String {
        match self {
            Attention::Dense => "bf16".into(),
            Attention::Fp8 => "fp8".into(),
            Attention::Sparse(s) => format!(
                "vsa, sparsity {s} (the model was trained with dense attention: this approximates it)"
            ),
        }
    }
}

/// `--attention`: `bf16`, `fp8`, `vsa` or `vsa:SPARSITY` with SPARSITY in [0, 1).
pub fn attention(arg: &str) -> Result<Attention> {
    let sparsity = |s: &str| -> Result<f64> {
        let x: f64 = s
            .parse()
            .map_err(|_| anyhow::anyhow!("--attention {arg}: sparsity '{s}' is not a number"))?;
        if !(0.0..1.0).contains(&x) {
            bail!("--attention {arg}: sparsity {x} is outside [0, 1)");
        }
        Ok(x)
    };
    Ok(match arg {
        "bf16" => Attention::Dense,
        "fp8" => Attention::Fp8,
        "vsa" => Attention::Sparse(DEFAULT_SPARSITY),
        other => match other.strip_prefix("vsa:") {
            Some(s) => Attention::Sparse(sparsity(s)?),
            None => bail!("--attention {other}: bf16, fp8, vsa or vsa:SPARSITY"),
        },
    })
}

/// `--dtype`: the weights' run dtype, and whether the DiT blocks' linears run in fp8.
pub fn run_dtype(arg: &str) -> Result<(DType, bool)> {
    if arg == "fp8" {
        return Ok((DType::BF16, true));
    }
    let dtype: DType = arg.parse().map_err(anyhow::Error::msg)?;
    if !matches!(dtype, DType::F32 | DType::BF16) {
        bail!("--dtype {arg}: the weights run in f32, bf16 or fp8 (bf16 with fp8 linears)");
    }
    Ok((dtype, false))
}
