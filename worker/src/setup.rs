//! From command-line flags to a loaded model, with the checks a user should hit before any
//! weights are read.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use kernels::{DType, Device};
use pipeline::{EngineConfig, EngineGroup, ModelConfig, ModelLoader, WanModel, WeightStore};
use tracing::{info, warn};

#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Model: tiny, lingbot-1.3b or lingbot-14b (append -act for the WASD action variant).
    #[arg(long, default_value = "tiny", global = true)]
    pub model: String,

    /// Checkpoint: a .safetensors file, a *.safetensors.index.json, or a folder with either.
    /// Without it the weights are random from --seed.
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

    /// Run dtype of the weights: f32 or bf16.
    #[arg(long, default_value = "f32", global = true)]
    pub dtype: String,
}

impl ModelArgs {
    /// `--device`, with `auto` resolved to the best device present: a CUDA GPU that answers,
    /// else the CPU. (ROCm is not in this build, so `auto` never picks it.)
    pub fn device(&self) -> Result<Device> {
        if self.device == "auto" {
            return Ok(match Device::Cuda(0).ensure_available() {
                Ok(()) => Device::Cuda(0),
                Err(_) => Device::Cpu,
            });
        }
        self.device.parse().map_err(anyhow::Error::msg)
    }
}

pub struct Loaded {
    pub cfg: ModelConfig,
    /// The model, loaded here; `None` for a GPU rank group, whose ranks each load their own.
    pub model: Option<Arc<WanModel>>,
    /// Ranks of the session (threads over the loopback communicator on the CPU).
    pub cards: usize,
    /// A GPU rank group: its GPUs in rank order and how each rank loads its model.
    pub gpu_group: Option<(Vec<usize>, Arc<ModelLoader>)>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loaded({}, {} card(s))", self.cfg.name, self.cards)
    }
}

impl Loaded {
    /// Session defaults for the model: `tiny` at 128×128, LingBot at 480×832.
    pub fn engine_config(&self, seed: u64) -> EngineConfig {
        if self.cfg.name.starts_with("tiny") {
            EngineConfig::tiny(seed)
        } else {
            EngineConfig::lingbot(seed)
        }
    }

    /// The rank group of a multi-card session: NCCL across GPUs, loopback threads on the CPU.
    pub fn engine_group(&self, cfg: EngineConfig) -> Result<EngineGroup> {
        Ok(match (&self.gpu_group, &self.model) {
            (Some((gpus, load)), _) => EngineGroup::nccl(&self.cfg, load.clone(), cfg, gpus)?,
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

/// Fails, naming the GPU, unless each of `gpus` is present and idle (memory in use below
/// [`BUSY_GPU_BYTES`]).
fn check_idle(gpus: &[usize]) -> Result<()> {
    const GIB: f64 = (1u64 << 30) as f64;
    for &g in gpus {
        let dev = kernels::cuda::backend(g).with_context(|| format!("GPU {g}"))?;
        let (free, total) = dev.memory().with_context(|| format!("GPU {g}: memory"))?;
        let used = total.saturating_sub(free);
        if used > BUSY_GPU_BYTES {
            bail!(
                "GPU {g} ({}) is busy: {:.1} GiB of {:.1} GiB in use (idle is below {:.0} GiB);                  choose idle GPUs with --gpus",
                dev.name,
                used as f64 / GIB,
                total as f64 / GIB,
                BUSY_GPU_BYTES as f64 / GIB
            );
        }
        info!(
            gpu = g,
            name = %dev.name,
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
    let dtype: DType = args.dtype.parse().map_err(anyhow::Error::msg)?;
    if !matches!(dtype, DType::F32 | DType::BF16) {
        bail!("--dtype {}: the weights run in f32 or bf16", args.dtype);
    }
    let open = {
        let (weights, seed) = (args.weights.clone(), args.seed);
        move |device: Device| -> Result<WeightStore> {
            Ok(match &weights {
                Some(path) => WeightStore::open(path, dtype)
                    .with_context(|| format!("opening weights {}", path.display()))?,
                None => WeightStore::random(seed, dtype),
            }
            .on_device(device))
        }
    };
    if args.weights.is_none() {
        warn!(
            model = %cfg.name,
            seed = args.seed,
            "RANDOM WEIGHTS: no --weights given, so the model is random from the seed; its output is noise, fit for timing only"
        );
    }
    if multi_gpu {
        if let Device::Rocm(_) = device {
            bail!("--cards on ROCm: the ROCm backend is not in this build yet");
        }
        check_idle(&gpus)?;
        let model_cfg = cfg.clone();
        let load: Arc<ModelLoader> = Arc::new(move |device| {
            let store = open(device).map_err(|e| pipeline::Error::Config(format!("{e:#}")))?;
            let started = std::time::Instant::now();
            let model = WanModel::load(&model_cfg, &store)?;
            info!(
                model = %model_cfg.name,
                weights = %store.describe(),
                device = %device,
                seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                "rank model ready"
            );
            Ok(model)
        });
        info!(model = %cfg.name, ?gpus, "sequence parallel over NCCL");
        return Ok(Loaded {
            cfg,
            model: None,
            cards: gpus.len(),
            gpu_group: Some((gpus, load)),
        });
    }
    let store = open(device)?;
    let started = std::time::Instant::now();
    let model =
        WanModel::load(&cfg, &store).with_context(|| format!("loading {}", store.describe()))?;
    info!(
        model = %cfg.name,
        weights = %store.describe(),
        dtype = dtype.name(),
        device = %device,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model ready"
    );
    Ok(Loaded {
        cfg,
        model: Some(Arc::new(model)),
        cards: args.cards,
        gpu_group: None,
    })
}
