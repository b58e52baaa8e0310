//! Edit mode (streaming video-to-video) on `tiny` weights with the `tiny` Wan2.1 VAE: strength 0
//! gives back encode→decode of the camera video bit for bit; higher strengths move the output
//! away from it, monotonically by PSNR; the second chunk goes through the cache of the first.

mod common;

use std::sync::Arc;

use common::assert_bits_eq;
use kernels::{DType, Tensor};
use pipeline::camera::Controls;
use pipeline::vae::{VaeConfig, WanVae};
use pipeline::{ChunkInputs, Edit, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

const H: usize = 32;
const W: usize = 48;

fn session() -> EngineConfig {
    EngineConfig {
        height: H,
        width: W,
        ..EngineConfig::tiny(11)
    }
}

/// A moving colour pattern in [-1, 1], `[3, frames, H, W]`, starting at frame `from`.
fn video(from: usize, frames: usize) -> Tensor {
    let mut v = Vec::with_capacity(3 * frames * H * W);
    for c in 0..3 {
        for f in from..from + frames {
            for y in 0..H {
                for x in 0..W {
                    let phase = (x as f32 * 0.3 + y as f32 * 0.2 + f as f32 * 0.25) + c as f32;
                    v.push(0.8 * phase.sin());
                }
            }
        }
    }
    Tensor::from_vec(v, &[3, frames, H, W]).expect("video")
}

fn psnr(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
    let mse = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    // Frames span [-1, 1]: a peak-to-peak of 2.
    10.0 * (4.0 / mse).log10()
}

struct Rig {
    model: Arc<WanModel>,
    vae: WanVae,
    /// The camera video's latents per chunk (9 frames, then 12).
    latents: Vec<Tensor>,
    /// encode→decode of the camera video per chunk.
    coded: Vec<Tensor>,
}

fn rig() -> Rig {
    let model = Arc::new(
        WanModel::load(&ModelConfig::tiny(), &WeightStore::random(5, DType::F32)).expect("model"),
    );
    let mut vae =
        WanVae::load(&VaeConfig::tiny(), &WeightStore::random(6, DType::F32)).expect("vae");
    let clips = [video(0, 9), video(9, 12)];
    let latents: Vec<Tensor> = clips
        .iter()
        .map(|c| vae.encode_chunk(c).expect("encode"))
        .collect();
    vae.reset();
    let coded = latents
        .iter()
        .map(|l| vae.decode_chunk(l).expect("decode"))
        .collect();
    vae.reset();
    Rig {
        model,
        vae,
        latents,
        coded,
    }
}

/// Two edited chunks at `strength`, decoded.
fn edit(rig: &mut Rig, strength: f64) -> Vec<Tensor> {
    let mut engine = Engine::new(rig.model.clone(), session()).expect("engine");
    rig.vae.reset();
    let controls = ChunkInputs {
        controls: Controls::default(),
    };
    rig.latents
        .clone()
        .iter()
        .map(|latents| {
            let e = Edit {
                latents: latents.clone(),
                strength,
            };
            let chunk = engine.next_chunk_edit(&controls, &e).expect("edit");
            if strength == 0.0 {
                assert_bits_eq("strength 0 latents", &chunk.latents, latents);
            }
            rig.vae.decode_chunk(&chunk.latents).expect("decode")
        })
        .collect()
}

#[test]
fn strength_zero_is_encode_decode_and_more_strength_moves_further() {
    let mut rig = rig();
    let kept = edit(&mut rig, 0.0);
    for (i, (k, c)) in kept.iter().zip(&rig.coded).enumerate() {
        assert_bits_eq(&format!("strength 0, chunk {i}"), k, c);
    }
    let mut last = [f64::INFINITY; 2];
    for strength in [0.1, 0.4, 0.7, 1.0] {
        let out = edit(&mut rig, strength);
        for (i, (o, c)) in out.iter().zip(&rig.coded).enumerate() {
            let p = psnr(o, c);
            assert!(
                p.is_finite(),
                "strength {strength}, chunk {i}: identical output"
            );
            assert!(
                p < last[i],
                "strength {strength}, chunk {i}: PSNR {p:.2} dB is not below {:.2} dB",
                last[i]
            );
            last[i] = p;
        }
    }
}

#[test]
fn bad_edits_are_refused_and_leave_the_engine_usable() {
    let rig = rig();
    let mut engine = Engine::new(rig.model.clone(), session()).expect("engine");
    let controls = ChunkInputs::default();
    let wrong = Edit {
        latents: Tensor::zeros(&[16, 2, 4, 6], DType::F32).expect("zeros"),
        strength: 0.5,
    };
    let err = engine
        .next_chunk_edit(&controls, &wrong)
        .expect_err("shape");
    assert!(err.to_string().contains("expected [16, 3, 4, 6]"), "{err}");
    let too_strong = Edit {
        latents: rig.latents[0].clone(),
        strength: 1.5,
    };
    let err = engine
        .next_chunk_edit(&controls, &too_strong)
        .expect_err("strength");
    assert!(err.to_string().contains("strength"), "{err}");
    // Refusals touch nothing: the first chunk is still chunk 0, and a world chunk follows.
    let ok = Edit {
        latents: rig.latents[0].clone(),
        strength: 0.5,
    };
    assert_eq!(
        engine.next_chunk_edit(&controls, &ok).expect("edit").index,
        0
    );
    assert_eq!(engine.next_chunk(&controls).expect("world").index, 1);
}
