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
        "bench",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn default_run_says_its_weights_are_random_and_streams_chunks() {
    let out = worker(&["--chunks", "2", "--log-format", "json"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("RANDOM WEIGHTS"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 2, "{log}");
}

#[test]
fn bad_flags_fail_with_a_reason() {
    let cases: [(&[&str], &str); 8] = [
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
        (&["--device", "rocm"], "ROCm backend is not in this build"),
        (
            &["--weights", "/nonexistent/w.safetensors"],
            "/nonexistent/w.safetensors",
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
