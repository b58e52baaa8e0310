//! Cross-check against an independent NumPy implementation (`tests/ref/lingbot_ref.py`, written
//! from MODELS.md, f64 throughout) on the `tiny` LingBot config with shared random weights saved
//! in the official key layout. Needs `python3` with `numpy` and `safetensors`
//! (`WORLDLINE_PYTHON` picks another interpreter); `.ci/run` installs them.

use std::path::Path;
use std::sync::Arc;

mod common;

use common::{random, read_outputs, rel_l2, run_script, CaseDir, TOLERANCE};

use kernels::{DType, Tensor};
use pipeline::camera::{fold_rays, ray_map, relative_poses, CameraRig, Controls};
use pipeline::model::Attn;
use pipeline::rng::NormalRng;
use pipeline::weights::save_safetensors;
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

/// Writes the model config and its weights (every key the model loaded, official names).
fn write_model(dir: &Path, cfg: &ModelConfig, store: &WeightStore, case: serde_json::Value) {
    let mut json = serde_json::to_value(cfg).expect("config json");
    let obj = json.as_object_mut().expect("object");
    for (k, v) in case.as_object().expect("case object") {
        obj.insert(k.clone(), v.clone());
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&json).expect("json"),
    )
    .expect("config");
    common::write_weights(dir, store);
}

fn tiny_model(seed: u64) -> (ModelConfig, WeightStore, Arc<WanModel>) {
    let cfg = ModelConfig::tiny();
    let store = WeightStore::random(seed, DType::F32);
    let model = Arc::new(WanModel::load(&cfg, &store).expect("tiny"));
    (cfg, store, model)
}

#[test]
fn one_forward_matches_numpy() {
    let dir = CaseDir::new("forward");
    let (cfg, store, model) = tiny_model(11);
    let (f, h, w) = (3, 4, 6);
    let x = random(1, &[cfg.in_dim, f, h, w]);
    let context = random(2, &[20, cfg.text_dim]);
    let plucker = random(3, &[f, 8 * h, 8 * w, 6]);
    write_model(
        &dir.0,
        &cfg,
        &store,
        serde_json::json!({ "case": "forward" }),
    );
    let t = Tensor::from_vec(vec![500.0], &[1]).expect("t");
    let inputs = [
        ("x".to_string(), &x),
        ("t".into(), &t),
        ("context".into(), &context),
        ("plucker".into(), &plucker),
    ];
    save_safetensors(&dir.0.join("inputs.safetensors"), &inputs).expect("inputs");

    let text = model.encode_text(&context, None).expect("text");
    let tokens = fold_rays(&plucker.to_vec_f32(), f, 8 * h, 8 * w, 6).expect("fold");
    let camera = model.camera_context(&tokens).expect("camera");
    let ours = model
        .forward(&x, 500.0, 0, &text, Some(&camera), Attn::Full, None)
        .expect("forward")
        .expect("output");

    run_script("lingbot_ref.py", &[dir.0.as_os_str()]);
    let reference = read_outputs(&dir.0);
    let e = rel_l2(&ours.to_vec_f32(), &reference["out"]);
    println!("forward: relative L2 {e:.2e}");
    assert!(
        e < TOLERANCE,
        "forward differs from NumPy: relative L2 {e:.3e}"
    );
}

#[test]
fn streaming_chunks_match_numpy() {
    let dir = CaseDir::new("stream");
    let (cfg, store, model) = tiny_model(12);
    let engine_cfg = EngineConfig {
        height: 32,
        width: 48,
        chunk_frames: 2,
        window_frames: 5,
        sink_frames: 1,
        ..EngineConfig::tiny(99)
    };
    let chunks = 4;
    let (lh, lw) = engine_cfg.latent_hw();
    let fc = engine_cfg.chunk_frames;
    let case = serde_json::json!({
        "case": "stream",
        "stream": {
            "chunk_frames": fc, "num_chunks": chunks, "window_frames": engine_cfg.window_frames,
            "sink_frames": engine_cfg.sink_frames, "step_indices": engine_cfg.step_indices,
            "shift": engine_cfg.shift, "num_train_steps": engine_cfg.num_train_steps,
        }
    });
    write_model(&dir.0, &cfg, &store, case);

    let context = random(4, &[7, cfg.text_dim]);
    let first = random(5, &[16, lh, lw]);
    let controls = [
        Controls {
            w: true,
            ..Default::default()
        },
        Controls {
            w: true,
            d: true,
            mouse_dx: 30.0,
            ..Default::default()
        },
        Controls {
            q: true,
            i: true,
            ..Default::default()
        },
        Controls {
            s: true,
            a: true,
            mouse_dy: -20.0,
            ..Default::default()
        },
    ];
    let mut engine = Engine::new(model.clone(), engine_cfg.clone()).expect("engine");
    engine.set_prompt(&context).expect("prompt");
    engine.set_first_frame(&first).expect("first frame");
    let ours: Vec<Tensor> = controls
        .iter()
        .map(|c| {
            engine
                .next_chunk(&ChunkInputs { controls: *c })
                .expect("chunk")
                .latents
        })
        .collect();

    // The engine's inputs, rebuilt from its documented contract: noise from the session stream in
    // draw order, camera poses from the rig, rays at pixel size.
    let mut rng = NormalRng::for_name(engine_cfg.seed, "noise");
    let mut rig = CameraRig::new(engine_cfg.camera.clone());
    let mut prev = None;
    let mut inputs: Vec<(String, Tensor)> = vec![
        ("context".into(), context.clone()),
        ("first_latent".into(), first.clone()),
    ];
    let noise_shape = [16, fc, lh, lw];
    for (c, ctl) in controls.iter().enumerate() {
        for s in 0..engine_cfg.step_indices.len() {
            let n = rng.normals(noise_shape.iter().product());
            inputs.push((
                format!("noise.{c}.{s}"),
                Tensor::from_vec(n, &noise_shape).expect("noise"),
            ));
        }
        let poses = rig.latent_poses(ctl, (c * fc) as u64, fc);
        let rel = relative_poses(prev.as_ref(), &poses, rig.step_length());
        prev = poses.last().copied();
        let map = ray_map(
            &rel,
            &[],
            engine_cfg.height,
            engine_cfg.width,
            engine_cfg.camera.intrinsics_832x480,
            6,
        )
        .expect("rays");
        let p =
            Tensor::from_vec(map, &[fc, engine_cfg.height, engine_cfg.width, 6]).expect("plucker");
        inputs.push((format!("plucker.{c}"), p));
    }
    let named: Vec<(String, &Tensor)> = inputs.iter().map(|(k, t)| (k.clone(), t)).collect();
    save_safetensors(&dir.0.join("inputs.safetensors"), &named).expect("inputs");

    run_script("lingbot_ref.py", &[dir.0.as_os_str()]);
    let reference = read_outputs(&dir.0);
    for (c, x0) in ours.iter().enumerate() {
        let e = rel_l2(&x0.to_vec_f32(), &reference[&format!("x0.{c}")]);
        println!("chunk {c}: relative L2 {e:.2e}");
        assert!(
            e < TOLERANCE,
            "chunk {c} differs from NumPy: relative L2 {e:.3e}"
        );
    }
}
