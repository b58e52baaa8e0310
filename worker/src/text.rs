//! Prompts → text conditioning for sessions: which text encoder a worker has (`--text-encoder`,
//! the random `tiny` one, or none), and what it answers when it cannot apply a prompt.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kernels::{DType, Device, Tensor};
use pipeline::text::{T5Config, T5Encoder, T5Tokenizer, TextConditioner};
use pipeline::{ModelConfig, WeightStore};
use tracing::{info, warn};

use crate::setup::WeightsSource;

/// The weights file Wan ships the encoder as (converted from `.pth`, same names).
pub const UMT5_WEIGHTS: &str = "models_t5_umt5-xxl-enc-bf16.safetensors";
/// Where a Wan checkpoint folder keeps the tokenizer.
pub const UMT5_TOKENIZER: &str = "google/umt5-xxl/tokenizer.json";

/// What a worker does with prompts.
pub enum Prompts {
    /// Prompts are encoded (cached per prompt) and change the stream from the next chunk.
    Encoder {
        conditioner: Box<Mutex<TextConditioner>>,
        /// For `/status`: `{"state":"random"|"loaded",...}`.
        source: serde_json::Value,
    },
    /// The model takes no text: a prompt is kept, not applied (the answer says why).
    NotConditioned(String),
    /// No text encoder: a prompt cannot be applied (the answer says how to get one).
    Unavailable(String),
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prompts::Encoder { source, .. } => write!(f, "Prompts::Encoder({source})"),
            Prompts::NotConditioned(_) => write!(f, "Prompts::NotConditioned"),
            Prompts::Unavailable(_) => write!(f, "Prompts::Unavailable"),
        }
    }
}

/// A prompt's context and how it was had.
#[derive(Debug)]
pub struct Encoded {
    pub context: Tensor,
    pub cached: bool,
    pub time: Duration,
}

impl Prompts {
    /// What `/status` says about prompts.
    pub fn json(&self) -> serde_json::Value {
        match self {
            Prompts::Encoder { source, .. } => source.clone(),
            Prompts::NotConditioned(why) => {
                serde_json::json!({"state": "not_conditioned", "why": why})
            }
            Prompts::Unavailable(why) => serde_json::json!({"state": "unavailable", "why": why}),
        }
    }

    /// The context of `prompt` (the empty prompt is the null context, all padding, that every
    /// session starts with); `Err` is what the client is told.
    pub fn encode(&self, prompt: &str, text_dim: usize) -> std::result::Result<Encoded, String> {
        let started = Instant::now();
        let conditioner = match self {
            Prompts::Encoder { conditioner, .. } => conditioner,
            Prompts::NotConditioned(why) | Prompts::Unavailable(why) => return Err(why.clone()),
        };
        if prompt.trim().is_empty() {
            let context = Tensor::zeros(&[0, text_dim], DType::F32).map_err(|e| e.to_string())?;
            return Ok(Encoded {
                context,
                cached: true,
                time: started.elapsed(),
            });
        }
        // One encoder for the worker: a prompt one session encoded is cached for all.
        let mut c = conditioner.lock().unwrap_or_else(|e| e.into_inner());
        let cached = c.is_cached(prompt);
        let context = c
            .context(prompt)
            .map_err(|e| format!("encoding the prompt: {e}"))?;
        Ok(Encoded {
            context,
            cached,
            time: started.elapsed(),
        })
    }
}

/// The T5 shape for `model`: umT5-XXL for Wan's 4096-wide text, else the `tiny` layout at the
/// model's text width and length.
fn t5_config(model: &ModelConfig) -> T5Config {
    if model.text_dim == T5Config::umt5_xxl().dim {
        return T5Config::umt5_xxl();
    }
    T5Config {
        dim: model.text_dim,
        dim_attn: model.text_dim,
        text_len: model.text_len,
        ..T5Config::tiny()
    }
}

/// The weights file and `tokenizer.json` of `--text-encoder PATH`: a folder (holding
/// [`UMT5_WEIGHTS`] or a single `.safetensors`, and `tokenizer.json` or [`UMT5_TOKENIZER`]), or
/// the weights file itself with the tokenizer beside it.
fn text_encoder_files(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("--text-encoder {}", path.display()))?;
    let (dir, weights) = if meta.is_dir() {
        let named = path.join(UMT5_WEIGHTS);
        let weights = if named.is_file() {
            named
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("--text-encoder {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            if found.len() != 1 {
                bail!(
                    "--text-encoder {}: expected {UMT5_WEIGHTS} or exactly one .safetensors file, found {}",
                    path.display(),
                    found.len()
                );
            }
            found.remove(0)
        };
        (path.to_path_buf(), weights)
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (dir, path.to_path_buf())
    };
    let tokenizer = [dir.join("tokenizer.json"), dir.join(UMT5_TOKENIZER)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "--text-encoder {}: no tokenizer.json (or {UMT5_TOKENIZER}) in {}",
                path.display(),
                dir.display()
            )
        })?;
    Ok((weights, tokenizer))
}

/// The worker's prompt handling for `model` on `device`.
pub fn load(
    text_encoder: Option<&Path>,
    model: &ModelConfig,
    weights: &WeightsSource,
    device: Device,
    dtype: DType,
    seed: u64,
) -> Result<Prompts> {
    if *weights == WeightsSource::Embedded {
        if text_encoder.is_some() {
            bail!("--text-encoder: the embedded default world model was trained with the null prompt (pipeline/assets/world/TRAINING.md) and has no text conditioning; give --weights to serve another model");
        }
        info!("prompts: the embedded default world model has no text conditioning; prompts are kept, not applied");
        return Ok(Prompts::NotConditioned(
            "this model has no text conditioning: the embedded default world model was trained with the null prompt (pipeline/assets/world/TRAINING.md); the prompt is kept but not applied".into(),
        ));
    }
    let cfg = t5_config(model);
    let started = Instant::now();
    let (tokenizer, store, source) = match text_encoder {
        Some(path) => {
            let (w, t) = text_encoder_files(path)?;
            let tok = T5Tokenizer::from_file(&t, cfg.text_len)
                .with_context(|| format!("loading the tokenizer {}", t.display()))?;
            let store = WeightStore::open(&w, dtype)
                .with_context(|| format!("opening the text encoder {}", w.display()))?;
            let json = serde_json::json!({
                "state": "loaded", "config": cfg.name, "weights": w.display().to_string(),
                "tokenizer": t.display().to_string(),
            });
            (tok, store, json)
        }
        // Random conditioning only on a random model: on trained weights it would silently
        // perturb what they learned.
        None if model.name.starts_with("tiny") && weights.is_random() => {
            warn!(
                seed,
                "RANDOM TEXT ENCODER: no --text-encoder, so the tiny model's T5 is random from the seed with a built-in character tokenizer; prompts change the stream but mean nothing"
            );
            let tok = T5Tokenizer::builtin(cfg.text_len)?;
            let json = serde_json::json!({
                "state": "random", "seed": seed, "config": cfg.name,
                "tokenizer": "built-in characters (pipeline::text::builtin_json)",
            });
            (tok, WeightStore::random(seed, dtype), json)
        }
        None => {
            warn!(model = %model.name, "prompts are unavailable: no --text-encoder");
            return Ok(Prompts::Unavailable(format!(
                "prompts are unavailable: this worker serves {} without a text encoder (start it with --text-encoder DIR: {UMT5_WEIGHTS} and tokenizer.json)",
                model.name
            )));
        }
    };
    let store = store.on_device(device);
    let encoder = T5Encoder::load(&cfg, &store)
        .with_context(|| format!("loading the text encoder from {}", store.describe()))?;
    let conditioner = TextConditioner::new(tokenizer, encoder)?;
    info!(
        config = %cfg.name,
        weights = %store.describe(),
        device = %device,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "text encoder ready"
    );
    Ok(Prompts::Encoder {
        conditioner: Box::new(Mutex::new(conditioner)),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the system's temporary directory.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("worldline-text-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn context(p: &Prompts, text: &str) -> Vec<f32> {
        p.encode(text, ModelConfig::tiny().text_dim)
            .expect("encode")
            .context
            .to_vec_f32()
    }

    #[test]
    fn a_text_encoder_folder_loads_by_the_official_names() {
        let model = ModelConfig::tiny();
        let random = WeightsSource::Random { seed: 3 };
        let builtin = load(None, &model, &random, Device::Cpu, DType::F32, 3).expect("random");
        assert_eq!(builtin.json()["state"], "random");
        // The same weights written as a checkpoint with a tokenizer.json beside them.
        let dir = scratch("folder");
        let store = WeightStore::random(3, DType::F32);
        let shapes = t5_config(&model).weight_shapes();
        let tensors: Vec<(String, Tensor)> = shapes
            .iter()
            .map(|(name, shape)| (name.clone(), store.root().get(shape, name).expect("tensor")))
            .collect();
        let named: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
        pipeline::weights::save_safetensors(&dir.join(UMT5_WEIGHTS), &named).expect("save");
        let no_tokenizer = load(Some(&dir), &model, &random, Device::Cpu, DType::F32, 9);
        let why = format!("{:#}", no_tokenizer.expect_err("no tokenizer"));
        assert!(why.contains("no tokenizer.json"), "{why}");
        let tok = dir.join(UMT5_TOKENIZER);
        std::fs::create_dir_all(tok.parent().expect("parent")).expect("dirs");
        std::fs::write(&tok, pipeline::text::builtin_json()).expect("tokenizer");
        let loaded = load(Some(&dir), &model, &random, Device::Cpu, DType::F32, 9).expect("load");
        assert_eq!(loaded.json()["state"], "loaded");
        let a = context(&loaded, "a castle at dusk");
        assert_eq!(a, context(&builtin, "a castle at dusk"));
        assert_ne!(a, context(&loaded, "a stone bridge"));
        // The empty prompt is the null context: no rows.
        assert!(context(&loaded, "  ").is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_a_text_encoder_prompts_are_answered_not_applied() {
        let big = ModelConfig::lingbot_1_3b();
        let random = WeightsSource::Random { seed: 0 };
        let p = load(None, &big, &random, Device::Cpu, DType::F32, 0).expect("load");
        let why = p.encode("a castle", big.text_dim).expect_err("unavailable");
        assert!(
            why.starts_with("prompts are unavailable") && why.contains("--text-encoder"),
            "{why}"
        );
        assert_eq!(p.json()["state"], "unavailable");
        let tiny = ModelConfig::tiny();
        // Trained tiny weights from a file get no random conditioning either.
        let file = WeightsSource::File(PathBuf::from("dit.safetensors"));
        let p = load(None, &tiny, &file, Device::Cpu, DType::F32, 0).expect("load");
        assert_eq!(p.json()["state"], "unavailable");
        let p = load(
            None,
            &tiny,
            &WeightsSource::Embedded,
            Device::Cpu,
            DType::F32,
            0,
        )
        .expect("embedded");
        let why = p
            .encode("a castle", tiny.text_dim)
            .expect_err("not conditioned");
        assert!(
            why.starts_with("this model has no text conditioning"),
            "{why}"
        );
        let refused = load(
            Some(Path::new("/nonexistent")),
            &tiny,
            &WeightsSource::Embedded,
            Device::Cpu,
            DType::F32,
            0,
        );
        assert!(format!("{:#}", refused.expect_err("refused")).contains("null prompt"));
    }
}
