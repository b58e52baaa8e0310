//! The procedural world: the renderer is deterministic and sees the scene it should (walls,
//! floor, ceiling, distinct wall colours, motion changes the picture), trajectories come from the
//! engine's rig and keep clear of solids, and the exporter writes NumPy files whose camera tokens
//! are the ones a real engine computes for the same controls.

mod common;

use std::sync::Arc;

use kernels::DType;
use pipeline::camera::{CameraRig, Controls, Pose};
use pipeline::engine::camera_tokens;
use pipeline::world::dataset::{self, DatasetOptions};
use pipeline::world::npy::read_header;
use pipeline::world::scene::{Scene, FLOOR_Y};
use pipeline::world::trajectory::{self, BODY_RADIUS};
use pipeline::world::{Split, Trajectory};
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

fn pixel(img: &[u8], w: usize, u: usize, v: usize) -> [u8; 3] {
    let at = (v * w + u) * 3;
    [img[at], img[at + 1], img[at + 2]]
}

fn dist(a: [u8; 3], b: [u8; 3]) -> i32 {
    (0..3).map(|k| (a[k] as i32 - b[k] as i32).abs()).sum()
}

#[test]
fn renderer_is_deterministic_and_sees_walls_floor_and_ceiling() {
    let cfg = EngineConfig::tiny(0);
    let r = dataset::renderer(&cfg, 1);
    let spawn = Scene::new().spawn();
    let a = r.render(&spawn);
    assert_eq!(a, r.render(&spawn), "same pose, same bytes");
    assert_eq!(a, dataset::renderer(&cfg, 1).render(&spawn));
    // A step forward changes the picture; the same step twice gives the same picture.
    let mut rig = CameraRig::new(cfg.camera.clone());
    let w = Controls {
        w: true,
        ..Default::default()
    };
    rig.advance(&w, 4, 4);
    let moved = r.render(&spawn.compose(&rig.pose()));
    let changed = a.iter().zip(&moved).filter(|(x, y)| x != y).count();
    assert!(
        changed > a.len() / 20,
        "a 0.25 m step changes {changed} bytes"
    );
    // Top rows see the ceiling, bottom rows the floor, and they differ; the floor is lit.
    let (top, bottom) = (pixel(&a, 128, 64, 1), pixel(&a, 128, 64, 126));
    assert!(
        dist(top, bottom) > 30,
        "ceiling {top:?} vs floor {bottom:?}"
    );
    // Looking at the four walls of room 1 from its middle: four distinct colours.
    let centre = Pose::level([4.5, 0.0, 5.0], 0.0);
    let colours: Vec<[u8; 3]> = (0..4)
        .map(|q| {
            let turn = Pose::level([0.0; 3], q as f64 * std::f64::consts::FRAC_PI_2);
            // Aim a little above the crates and pillars, at wall height.
            pixel(&r.render(&centre.compose(&turn)), 128, 70, 50)
        })
        .collect();
    for i in 0..4 {
        for j in 0..i {
            assert!(
                dist(colours[i], colours[j]) > 40,
                "walls {i} and {j}: {:?} vs {:?}",
                colours[i],
                colours[j]
            );
        }
    }
}

#[test]
fn supersampling_keeps_the_picture() {
    let cfg = EngineConfig::tiny(0);
    let spawn = Scene::new().spawn();
    let one = dataset::renderer(&cfg, 1).render(&spawn);
    let four = dataset::renderer(&cfg, 2).render(&spawn);
    let mean = one
        .iter()
        .zip(&four)
        .map(|(a, b)| (*a as f64 - *b as f64).abs())
        .sum::<f64>()
        / one.len() as f64;
    assert!(
        mean < 12.0,
        "2×2 rays stay close to 1 ray: mean |Δ| {mean:.1}"
    );
    assert_ne!(one, four);
}

#[test]
fn chunk_poses_are_the_engines_latent_poses_frame_by_frame() {
    let cfg = EngineConfig::tiny(0);
    let c = Controls {
        w: true,
        d: true,
        mouse_dx: 37.0,
        mouse_dy: -11.0,
        ..Default::default()
    };
    let (mut a, mut b) = (
        CameraRig::new(cfg.camera.clone()),
        CameraRig::new(cfg.camera.clone()),
    );
    for chunk in 0..3u64 {
        let p = a.chunk_poses(&c, chunk * 3, 3);
        let l = b.latent_poses(&c, chunk * 3, 3);
        assert_eq!(p.latent, l, "bit-equal to latent_poses");
        assert_eq!(p.video.len(), if chunk == 0 { 9 } else { 12 });
        // Latent i is the last video frame of its group of four.
        let last = *p.video.last().expect("frames");
        assert_eq!(last, *l.last().expect("latents"));
    }
}

#[test]
fn random_play_keeps_clear_of_solids_and_splits_differ() {
    let scene = Scene::new();
    let cfg = EngineConfig::tiny(0);
    let mut keys = 0;
    for clip in 0..24 {
        let t = trajectory::random(&scene, &cfg, Split::Train, 5, clip, 6);
        assert_eq!(t.poses.len(), dataset::clip_frames(6, 3));
        for i in 0..t.poses.len() {
            let p = t.world_pose(i);
            assert!(
                scene.is_free(p.t[0], p.t[2], BODY_RADIUS),
                "clip {clip} frame {i} at {:?}",
                p.t
            );
            assert!(
                p.t[1].abs() < 1e-9 && p.t[1] < FLOOR_Y,
                "walking stays level"
            );
        }
        // Replaying the controls through a fresh rig gives the same poses (the rig integrates).
        let again = Trajectory::follow(&cfg, t.spawn, &t.controls);
        assert_eq!(again.poses, t.poses);
        keys += t.controls.iter().filter(|c| c.w).count();
    }
    assert!(keys > 10, "play walks forward often ({keys} W chunks)");
    let a = trajectory::random(&scene, &cfg, Split::Train, 5, 0, 4);
    let b = trajectory::random(&scene, &cfg, Split::HeldOut, 5, 0, 4);
    assert_ne!(a.spawn, b.spawn, "held-out clips come from another stream");
    // The motion check's commands (4 chunks, its default) from its spawn stay clear.
    for (name, c) in pipeline::world::verify::motion_commands() {
        let t = Trajectory::follow(&cfg, pipeline::world::verify::motion_spawn(), &[c; 4]);
        for i in 0..t.poses.len() {
            let p = t.world_pose(i);
            assert!(
                scene.is_free(p.t[0], p.t[2], BODY_RADIUS),
                "motion {name} frame {i} at {:?}",
                p.t
            );
        }
    }
    // Scripted tours from the default spawn stay clear too.
    for (name, controls) in trajectory::scripted(14) {
        let t = Trajectory::follow(&cfg, scene.spawn(), &controls);
        for i in 0..t.poses.len() {
            let p = t.world_pose(i);
            assert!(
                scene.is_free(p.t[0], p.t[2], BODY_RADIUS),
                "tour {name} frame {i} at {:?}",
                p.t
            );
        }
    }
}

fn read_npy(dir: &std::path::Path, name: &str) -> (String, Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(dir.join(name)).expect("npy file");
    let (descr, shape, off) = read_header(&bytes).expect("header");
    (descr, shape, bytes[off..].to_vec())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn exporter_writes_the_engines_camera_tokens() {
    let dir = common::CaseDir::new("world-dataset");
    let opts = DatasetOptions {
        clips: 2,
        chunks: 2,
        seed: 3,
        split: Split::Train,
        samples: 1,
        camera_tensor: true,
        threads: Some(2),
    };
    let summary = dataset::export(&dir.0, &opts).expect("export");
    assert_eq!(summary.frames, 2 * 21);
    let (descr, shape, frames) = read_npy(&dir.0, "frames.npy");
    assert_eq!(
        (descr.as_str(), shape.as_slice()),
        ("|u1", &[2, 21, 128, 128, 3][..])
    );
    assert_eq!(frames.len(), 2 * 21 * 128 * 128 * 3);
    let (descr, shape, camera) = read_npy(&dir.0, "camera.npy");
    assert_eq!(
        (descr.as_str(), shape.as_slice()),
        ("<f4", &[2, 2, 192, 1536][..])
    );
    let camera = f32s(&camera);
    let (_, shape, controls) = read_npy(&dir.0, "controls.npy");
    assert_eq!(shape, [2, 2, 10]);
    let controls = f32s(&controls);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.0.join("meta.json")).expect("meta"))
            .expect("json");
    assert_eq!(
        meta["files"]["poses.npy"]["shape"],
        serde_json::json!([2, 21, 3, 4])
    );

    // Clip 1 again, frames and all, from the trajectory generator and the renderer.
    let cfg = dataset::engine_config(3);
    let scene = Scene::new();
    let t = trajectory::random(&scene, &cfg, Split::Train, 3, 1, 2);
    let r = dataset::renderer(&cfg, 1);
    let clip1 = &frames[21 * r.frame_len()..];
    assert_eq!(&clip1[..r.frame_len()], r.render(&t.world_pose(0)));
    assert_eq!(&clip1[20 * r.frame_len()..], r.render(&t.world_pose(20)));

    // A real engine on the same controls: its chunk poses are the trajectory's, and the camera
    // tokens of its poses are what the file holds.
    let store = WeightStore::random(9, DType::F32);
    let model = Arc::new(WanModel::load(&ModelConfig::tiny(), &store).expect("model"));
    let mut engine = Engine::new(model, cfg.clone()).expect("engine");
    let mut prev: Option<Pose> = None;
    for k in 0..2 {
        let row = &controls[(2 + k) * 10..][..10];
        let c = Controls {
            w: row[0] == 1.0,
            a: row[1] == 1.0,
            s: row[2] == 1.0,
            d: row[3] == 1.0,
            q: row[4] == 1.0,
            e: row[5] == 1.0,
            i: row[6] == 1.0,
            k: row[7] == 1.0,
            mouse_dx: row[8] as f64,
            mouse_dy: row[9] as f64,
        };
        assert_eq!(c, t.controls[k]);
        let chunk = engine
            .next_chunk(&ChunkInputs { controls: c })
            .expect("chunk");
        assert_eq!(chunk.poses, t.latent[k], "engine poses = trajectory poses");
        let tokens = camera_tokens(&cfg, 6, prev.as_ref(), &chunk.poses, &c).expect("tokens");
        let n = 192 * 1536;
        let file = &camera[(2 + k) * n..][..n];
        assert!(
            tokens.to_vec_f32() == file,
            "chunk {k}: camera.npy differs from the engine's tokens"
        );
        prev = chunk.poses.last().copied();
    }
}
