//! The embedded default's loading path on weights exported from random init through our own
//! store (the shipped files are checked by `world_default.rs` when the build has them): the DiT
//! and both halves of the autoencoder load from in-memory safetensors by their official names,
//! the first view encodes to the engine's first-frame latent, and a session that starts from it
//! (and starts again after reset) runs.

mod common;

use std::sync::Arc;

use kernels::{DType, Tensor};
use pipeline::vae::{TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
use pipeline::weights::save_safetensors;
use pipeline::world::assets::{self, WorldAssets};
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

/// The tensors a store handed out, as safetensors bytes with a 'static life.
fn exported(store: &WeightStore, name: &str) -> &'static [u8] {
    let dir = common::CaseDir::new(name);
    let tensors = store.loaded_tensors().expect("tensors");
    let named: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    let path = dir.0.join("w.safetensors");
    save_safetensors(&path, &named).expect("save");
    Box::leak(std::fs::read(&path).expect("read").into_boxed_slice())
}

fn random_assets() -> WorldAssets {
    let dit = WeightStore::random(61, DType::F32);
    WanModel::load(&ModelConfig::tiny(), &dit).expect("random DiT");
    let ae = WeightStore::random(62, DType::F32);
    TinyEncoder::load(&TinyEncoderConfig::world(), &ae).expect("random encoder");
    TinyDecoder::load(&TinyDecoderConfig::world(), &ae).expect("random decoder");
    WorldAssets {
        dit: exported(&dit, "assets-dit"),
        ae: exported(&ae, "assets-ae"),
        training: "",
    }
}

#[test]
fn embedded_path_loads_and_a_session_starts_from_the_first_view() {
    let a = random_assets();
    let store = a.dit_store(DType::F32).expect("dit store");
    assert!(!store.is_random());
    assert!(store.describe().starts_with("embedded:"));
    let model = Arc::new(WanModel::load(&ModelConfig::tiny(), &store).expect("model"));
    store
        .check_all_used()
        .expect("every stored key is a model weight");
    // The same numbers as the store they were exported from.
    let again = WanModel::load(&ModelConfig::tiny(), &WeightStore::random(61, DType::F32))
        .expect("random again");
    assert!(model.patch_embedding_weight.to_vec_f32() == again.patch_embedding_weight.to_vec_f32());

    let mut enc = a.encoder().expect("encoder");
    let mut dec = a.decoder().expect("decoder");
    let base = EngineConfig::tiny(4);
    let first = assets::first_latent(&mut enc, &base).expect("first latent");
    assert_eq!(first.len(), 16 * 16 * 16);
    // The first view is the spawn render, encoded as one frame.
    let frame = assets::spawn_frame(&base).expect("frame");
    assert_eq!(frame.shape(), [3, 1, 128, 128]);
    let direct = enc.encode(&frame).expect("encode").to_vec_f32();
    assert!(direct == first);

    let cfg = EngineConfig {
        first_latent: Some(first.clone()),
        ..base.clone()
    };
    let mut engine = Engine::new(model.clone(), cfg.clone()).expect("engine");
    let inputs = ChunkInputs::default();
    let a0 = engine.next_chunk(&inputs).expect("chunk").latents;
    let frames = dec.decode_chunk(&a0).expect("decode");
    assert_eq!(frames.shape(), [3, 9, 128, 128]);
    engine.reset();
    let b0 = engine
        .next_chunk(&inputs)
        .expect("chunk after reset")
        .latents;
    common::assert_bits_eq("after reset the first view is used again", &a0, &b0);
    // Without the first view the chunk differs: the latent is really the conditioning.
    let mut plain = Engine::new(model, base).expect("engine");
    let c0 = plain.next_chunk(&inputs).expect("chunk").latents;
    assert!(c0.to_vec_f32() != a0.to_vec_f32());
    // A latent of the wrong size is refused when the engine is built.
    let bad = EngineConfig {
        first_latent: Some(vec![0.0; 7]),
        ..cfg
    };
    let model = Arc::new(WanModel::load(&ModelConfig::tiny(), &store).expect("model"));
    let err = Engine::new(model, bad).expect_err("7 values");
    assert!(err.to_string().contains("first_latent"), "{err}");
}
