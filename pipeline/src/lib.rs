//! Worldline's models and the streaming chunk engine: the Wan/LingBot DiT with a Rust tree that
//! mirrors the checkpoint names, weight loading, the few-step flow-matching sampler, camera
//! conditioning from controls, [`Engine`], which turns inputs into latents chunk by chunk, and the
//! streaming Wan2.1 VAE ([`WanVae`]) between latents and frames.
//! No sockets, no async: the worker drives it from its own threads.

pub mod camera;
pub mod config;
pub mod engine;
mod error;
pub mod flops;
pub mod model;
pub mod parallel;
pub mod rng;
pub mod sampler;
pub mod text;
pub mod vae;
pub mod weights;
pub mod world;

pub use config::ModelConfig;
pub use engine::{Chunk, ChunkInputs, Edit, Engine, EngineConfig};
pub use error::{Error, Result};
pub use model::WanModel;
pub use parallel::{EngineGroup, ModelLoader};
pub use vae::{VaeConfig, WanVae};
pub use weights::{RandomDraws, WeightStore};
