//! From command-line flags to a loaded model, with the checks a user should hit before any
//! weights are read.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use kernels::{DType, Device};
use pipeline::{EngineConfig, ModelConfig, WanModel, WeightStore};
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

    /// Device: cpu, cuda[:N] or rocm[:N].
    #[arg(long, default_value = "cpu", global = true)]
    pub device: String,

    /// Cards for Ulysses sequence parallelism (the head count must divide by it).
    #[arg(long, default_value_t = 1, global = true)]
    pub cards: usize,

    /// Seed of random weights and of session noise.
    #[arg(long, default_value_t = 0, global = true)]
    pub seed: u64,

    /// Run dtype of the weights: f32 or bf16.
    #[arg(long, default_value = "f32", global = true)]
    pub dtype: String,
}

pub struct Loaded {
    pub model: Arc<WanModel>,
    /// Ranks of the session (threads over the loopback communicator on the CPU).
    pub cards: usize,
}

impl Loaded {
    /// Session defaults for the model: `tiny` at 128×128, LingBot at 480×832.
    pub fn engine_config(&self, seed: u64) -> EngineConfig {
        if self.model.cfg.name.starts_with("tiny") {
            EngineConfig::tiny(seed)
        } else {
            EngineConfig::lingbot(seed)
        }
    }
}

pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let cfg = ModelConfig::by_name(&args.model)?;
    let device: Device = args.device.parse().map_err(anyhow::Error::msg)?;
    sp::heads_per_card(cfg.num_heads, args.cards)?;
    if args.cards > 1 && !device.is_cpu() {
        bail!(
            "--cards {} on {device}: sequence parallelism across GPUs needs the NCCL/RCCL \
             communicator, which is not wired yet; use --cards 1 (--device cpu runs the \
             loopback rank group)",
            args.cards
        );
    }
    device.ensure_available()?;
    let dtype: DType = args.dtype.parse().map_err(anyhow::Error::msg)?;
    if !matches!(dtype, DType::F32 | DType::BF16) {
        bail!("--dtype {}: the weights run in f32 or bf16", args.dtype);
    }
    let store = match &args.weights {
        Some(path) => WeightStore::open(path, dtype)
            .with_context(|| format!("opening weights {}", path.display()))?,
        None => WeightStore::random(args.seed, dtype),
    }
    .on_device(device);
    if store.is_random() {
        warn!(
            model = %cfg.name,
            seed = args.seed,
            "RANDOM WEIGHTS: no --weights given, so the model is random from the seed; its output is noise, fit for timing only"
        );
    }
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
        model: Arc::new(model),
        cards: args.cards,
    })
}
