//! The `worker` binary as a user meets it.

use std::process::Command;

fn worker(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_worker"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("RUST_LOG")
        .output()
        .expect("run worker")
}

#[test]
fn help_lists_the_model_flags() {
    let out = worker(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--weights",
        "--device",
        "--cards",
        "--seed",
        "--decoder",
        "--decoder-weights",
        "--out",
        "bench",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn default_run_plays_the_embedded_world_and_random_says_so() {
    let out = worker(&["--chunks", "1", "--log-format", "json"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("embedded default weights"), "{log}");
    assert!(log.contains("tiny/world"), "the world decoder: {log}");
    assert!(!log.contains("RANDOM"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 1, "{log}");
    let out = worker(&[
        "--weights",
        "random",
        "--chunks",
        "2",
        "--log-format",
        "json",
    ]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("RANDOM WEIGHTS"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 2, "{log}");
}

#[test]
fn bad_flags_fail_with_a_reason() {
    let cases: [(&[&str], &str); 11] = [
        (&["--model", "giant"], "unknown model 'giant'"),
        (&["--cards", "3"], "do not split over 3 cards"),
        (
            &["--device", "cuda", "--cards", "3"],
            "do not split over 3 cards",
        ),
        (
            &["--device", "cuda", "--cards", "2", "--gpus", "0"],
            "--gpus lists 1 GPU(s) ([0]) for --cards 2",
        ),
        (
            &["--device", "cuda", "--cards", "2", "--gpus", "1,1"],
            "--gpus lists GPU 1 twice",
        ),
        (
            &["--cards", "2", "--gpus", "0,1"],
            "--gpus needs --device cuda or rocm",
        ),
        (
            &["--device", "rocm"],
            "ROCm op backend is not in this build",
        ),
        (
            &["--weights", "/nonexistent/w.safetensors"],
            "/nonexistent/w.safetensors",
        ),
        (
            &["--decoder", "bogus"],
            "invalid value 'bogus' for '--decoder",
        ),
        (
            &["--decoder-weights", "/nonexistent/d.safetensors"],
            "opening --decoder-weights /nonexistent/d.safetensors",
        ),
        (
            &["--out", "/nonexistent/dir/x.y4m"],
            "creating --out /nonexistent/dir/x.y4m",
        ),
    ];
    for (args, want) in cases {
        let out = worker(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected '{want}' in:\n{err}");
    }
}

#[test]
fn cards_on_the_cpu_run_the_loopback_rank_group() {
    let out = worker(&["--cards", "4", "--chunks", "2", "--log-format", "json"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("\"cards\":4"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 2, "{log}");
}

/// A fresh folder for one test's files.
fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("worker-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Checks a YUV4MPEG2 file's header (`width`×`height`, 16:1, 4:2:0) and returns its frame count,
/// failing unless every frame is a `FRAME` marker and `width·height·3/2` bytes.
fn y4m_frames(bytes: &[u8], width: usize, height: usize) -> usize {
    let end = bytes.iter().position(|&b| b == b'\n').expect("header line");
    let header = std::str::from_utf8(&bytes[..end]).expect("ASCII header");
    let fields: Vec<&str> = header.split(' ').collect();
    assert_eq!(fields[0], "YUV4MPEG2", "{header}");
    for want in [format!("W{width}"), format!("H{height}"), "F16:1".into()] {
        assert!(fields.contains(&want.as_str()), "{header} lacks {want}");
    }
    assert!(
        fields.contains(&"C420jpeg") || fields.contains(&"C420"),
        "{header}"
    );
    let size = width * height * 3 / 2;
    let mut rest = &bytes[end + 1..];
    let mut frames = 0;
    while !rest.is_empty() {
        assert!(
            rest.starts_with(b"FRAME\n"),
            "frame {frames}: no FRAME marker"
        );
        rest = &rest[6..];
        assert!(rest.len() >= size, "frame {frames}: {} bytes", rest.len());
        rest = &rest[size..];
        frames += 1;
    }
    frames
}

#[test]
fn out_writes_every_decoded_frame_as_y4m() {
    let dir = temp_dir("y4m");
    for decoder in ["tiny", "vae"] {
        let path = dir.join(format!("{decoder}.y4m"));
        let path_arg = path.to_str().expect("UTF-8 temp path");
        // Random weights: the plumbing is checked here, and they bring random decoders.
        let args = [
            "--weights",
            "random",
            "--chunks",
            "2",
            "--decoder",
            decoder,
            "--out",
            path_arg,
        ];
        let out = worker(&args);
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{log}");
        assert!(log.contains("RANDOM DECODER WEIGHTS"), "{log}");
        assert!(log.contains("CPU-only"), "{log}");
        let bytes = std::fs::read(&path).expect("the --out file");
        // 3 latents per chunk: 1 + 4·2 = 9 frames, then 4·3 = 12.
        assert_eq!(y4m_frames(&bytes, 128, 128), 21, "{decoder}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn each_chunk_logs_its_frames_and_decode_time() {
    let out = worker(&["--chunks", "2", "--log-format", "json"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("\"frames\":9"), "{log}");
    assert!(log.contains("\"frames\":12"), "{log}");
    assert_eq!(log.matches("\"decode_ms\"").count(), 2, "{log}");
}

#[test]
fn serve_help_lists_its_flags() {
    let out = worker(&["serve", "--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--max-sessions",
        "--auth-token",
        "--model",
        "--device",
        "--decoder",
    ] {
        assert!(text.contains(flag), "serve --help lacks {flag}:\n{text}");
    }
}

#[test]
fn serve_refuses_bad_flags_before_listening() {
    for (args, why) in [
        (
            &["serve", "--max-sessions", "0"][..],
            "--max-sessions must be at least 1",
        ),
        (
            &["serve", "--listen", "nowhere"][..],
            "binding --listen nowhere",
        ),
    ] {
        let out = worker(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}
