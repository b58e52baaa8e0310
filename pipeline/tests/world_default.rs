//! The shipped default (`pipeline/assets/world/`, built in): the DiT and the autoencoder load
//! by their official names, a chunk runs, and a short scripted walk through the real streaming
//! engine and decoder resembles the renderer's frames of the same poses beyond a fixed PSNR
//! (set well below the measured value: it catches breakage, not noise).

use std::sync::Arc;

use kernels::DType;
use pipeline::camera::Controls;
use pipeline::world::assets;
use pipeline::world::verify::{self, Codec};
use pipeline::world::{dataset, Scene};
use pipeline::{ModelConfig, WanModel};

/// Mean PSNR (dB) of the walk against the renderer must beat this.
const PSNR_FLOOR: f64 = 16.0;

#[test]
fn shipped_weights_load_and_a_short_walk_resembles_the_renderer() {
    let a = assets::embedded()
        .expect("this build has the embedded default (pipeline/assets/world/*.safetensors)");
    let store = a.dit_store(DType::F32).expect("dit");
    let model = Arc::new(WanModel::load(&ModelConfig::tiny(), &store).expect("DiT loads"));
    store
        .check_all_used()
        .expect("no stray keys in dit.safetensors");
    let ae = a.ae_store().expect("ae");
    let mut codec = Codec {
        encoder: a.encoder().expect("encoder loads"),
        decoder: a.decoder().expect("decoder loads"),
    };
    drop(ae);
    let cfg = dataset::engine_config(0);
    let renderer = dataset::renderer(&cfg, 2);
    let w = Controls {
        w: true,
        ..Default::default()
    };
    let played = verify::play(
        &model,
        &cfg,
        &mut codec,
        &renderer,
        Scene::new().spawn(),
        &[w, w],
    )
    .expect("two chunks play");
    let s = verify::score("walk", &played, cfg.height, cfg.width);
    println!(
        "walk: {} frames, PSNR {:.2} dB (first second {:.2}), SSIM {:.3}",
        s.frames, s.psnr_all, s.psnr_first_second, s.ssim_first_second
    );
    assert_eq!(s.frames, 21);
    assert!(
        s.psnr_all > PSNR_FLOOR,
        "the default's walk is {:.2} dB from the renderer (floor {PSNR_FLOOR})",
        s.psnr_all
    );
}
