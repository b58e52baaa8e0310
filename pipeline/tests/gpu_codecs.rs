//! The codecs on each GPU backend against the CPU reference: the tiny decoder and encoder and the
//! Wan VAE (decoder and encoder), each streamed over several chunks, and the umT5 text encoder,
//! with random weights, in f32 (TF32 GEMMs) and bf16 weights. Skipped, with the reason printed,
//! where no GPU is present.

mod common;

use common::{gpus, rel_l2};

use kernels::{DType, Device, Tensor};
use pipeline::rng::NormalRng;
use pipeline::text::{T5Config, T5Encoder};
use pipeline::vae::{
    Layout, TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig, VaeConfig, WanVae,
};
use pipeline::WeightStore;

fn random(seed: u64, shape: &[usize], scale: f32) -> Tensor {
    let v: Vec<f32> = NormalRng::new(seed)
        .normals(shape.iter().product())
        .into_iter()
        .map(|x| x * scale)
        .collect();
    Tensor::from_vec(v, shape).expect("tensor")
}

/// Tolerance of a whole network: the per-GEMM one (TF32 ~3e-4, bf16 1e-2) grown over the tens
/// of convolutions a chunk goes through (the Wan VAE decoder in f32 gave 2.3e-3 on an H200).
fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        3e-2
    } else {
        5e-3
    }
}

/// Streams `chunks` through `step` on the CPU and on `dev` (a fresh coder from `make` on each) and
/// compares every chunk's output.
fn compare<C>(
    what: &str,
    dev: Device,
    dtype: DType,
    chunks: &[Tensor],
    make: impl Fn(&WeightStore) -> C,
    step: impl Fn(&mut C, &Tensor) -> pipeline::Result<Tensor>,
) {
    let store = WeightStore::random(21, dtype);
    let mut cpu = make(&store);
    let mut gpu = make(&WeightStore::random(21, dtype).on_device(dev));
    for (i, c) in chunks.iter().enumerate() {
        let want = step(&mut cpu, c).expect("cpu");
        let got = step(&mut gpu, &c.to_device(dev).expect("upload")).expect("gpu");
        assert_eq!(got.device(), dev, "{what}: output on {dev}");
        assert_eq!(got.shape(), want.shape(), "{what} chunk {i}: shape");
        let got = got.to_device(Device::Cpu).expect("download").to_vec_f32();
        let e = rel_l2(&got, &want.to_vec_f32());
        println!("{what} {dtype:?} on {dev}, chunk {i}: rel L2 {e:.2e}");
        assert!(
            e < tol(dtype),
            "{what} {dtype:?} chunk {i}: rel L2 {e:.3e} ≥ {}",
            tol(dtype)
        );
    }
}

#[test]
fn tiny_decoder_and_encoder_match_the_cpu() {
    for dev in gpus() {
        for dtype in [DType::F32, DType::BF16] {
            let latents = [
                random(1, &[16, 2, 6, 8], 1.0),
                random(2, &[16, 3, 6, 8], 1.0),
            ];
            // The layout the device picks (channels-last where cuDNN loads), then the other.
            let picked = TinyDecoder::load(
                &TinyDecoderConfig::tiny(),
                &WeightStore::random(21, dtype).on_device(dev),
            )
            .expect("decoder")
            .layout();
            println!("tiny decoder on {dev}: {picked:?}");
            if std::env::var("WORLDLINE_REQUIRE_CUDNN").is_ok_and(|v| v == "1") {
                assert_eq!(picked, Layout::ChannelsLast, "cuDNN required on {dev}");
            }
            for layout in [Layout::ChannelsLast, Layout::ChannelsFirst] {
                compare(
                    &format!("tiny decoder {layout:?}"),
                    dev,
                    dtype,
                    &latents,
                    |s| {
                        let mut d =
                            TinyDecoder::load(&TinyDecoderConfig::tiny(), s).expect("decoder");
                        if !s.device().is_cpu() {
                            d.set_layout(layout).expect("layout");
                        }
                        d
                    },
                    |d, x| d.decode_chunk(x),
                );
            }
            let video = [
                random(3, &[3, 5, 48, 64], 0.5),
                random(4, &[3, 8, 48, 64], 0.5),
            ];
            let picked = TinyEncoder::load(
                &TinyEncoderConfig::tiny(),
                &WeightStore::random(22, dtype).on_device(dev),
            )
            .expect("encoder")
            .layout();
            println!("tiny encoder on {dev}: {picked:?}");
            if std::env::var("WORLDLINE_REQUIRE_CUDNN").is_ok_and(|v| v == "1") {
                assert_eq!(picked, Layout::ChannelsLast, "cuDNN required on {dev}");
            }
            for layout in [Layout::ChannelsLast, Layout::ChannelsFirst] {
                compare(
                    &format!("tiny encoder {layout:?}"),
                    dev,
                    dtype,
                    &video,
                    |s| {
                        let mut e =
                            TinyEncoder::load(&TinyEncoderConfig::tiny(), s).expect("encoder");
                        if !s.device().is_cpu() {
                            e.set_layout(layout).expect("layout");
                        }
                        e
                    },
                    |e, x| e.encode_chunk(x),
                );
            }
        }
    }
}

#[test]
fn wan_vae_matches_the_cpu() {
    for dev in gpus() {
        for dtype in [DType::F32, DType::BF16] {
            let latents = [
                random(5, &[16, 2, 4, 6], 1.0),
                random(6, &[16, 2, 4, 6], 1.0),
            ];
            compare(
                "Wan VAE decoder",
                dev,
                dtype,
                &latents,
                |s| WanVae::load(&VaeConfig::tiny(), s).expect("vae"),
                |v, x| v.decode_chunk(x),
            );
            let video = [
                random(7, &[3, 5, 32, 48], 0.5),
                random(8, &[3, 4, 32, 48], 0.5),
            ];
            compare(
                "Wan VAE encoder",
                dev,
                dtype,
                &video,
                |s| WanVae::load(&VaeConfig::tiny(), s).expect("vae"),
                |v, x| v.encode_chunk(x),
            );
        }
    }
}

/// The umT5 encoder at a narrow width but umT5's head dim (64), bucketing and layer layout: the
/// Wan context of 40 valid tokens (`encode`), and a masked pass over 48 ids of which the last 8
/// are padding (`forward`, keys past the valid ones masked).
#[test]
fn t5_encoder_matches_the_cpu() {
    let cfg = T5Config {
        vocab: 512,
        dim: 256,
        dim_attn: 256,
        dim_ffn: 640,
        num_heads: 4,
        num_layers: 2,
        text_len: 64,
        ..T5Config::umt5_xxl()
    };
    let ids: Vec<u32> = (0..48u32).map(|i| (i * 97 + 13) % 512).collect();
    for dev in gpus() {
        for dtype in [DType::F32, DType::BF16] {
            let cpu = T5Encoder::load(&cfg, &WeightStore::random(23, dtype)).expect("cpu t5");
            let gpu = T5Encoder::load(&cfg, &WeightStore::random(23, dtype).on_device(dev))
                .expect("gpu t5");
            for what in ["encode", "masked forward"] {
                let run = |e: &T5Encoder| match what {
                    "encode" => e.encode(&ids, 40),
                    _ => e.forward(&ids, 40),
                };
                let want = run(&cpu).expect("cpu");
                let got = run(&gpu).expect("gpu");
                assert_eq!(got.device(), dev, "T5 {what}: output on {dev}");
                assert_eq!(got.shape(), want.shape(), "T5 {what}: shape");
                let got = got.to_device(Device::Cpu).expect("download").to_vec_f32();
                let e = rel_l2(&got, &want.to_vec_f32());
                println!("T5 {what} {dtype:?} on {dev}: rel L2 {e:.2e}");
                assert!(e < tol(dtype), "T5 {what} {dtype:?}: rel L2 {e:.3e}");
            }
        }
    }
}
