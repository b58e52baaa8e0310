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
        "--listen",
        "serve",
        "generate",
        "bench",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn generate_plays_the_embedded_world_and_random_says_so() {
    let out = worker(&["generate", "--chunks", "1", "--log-format", "json"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("embedded default weights"), "{log}");
    assert!(
        !log.contains("trained with the default streaming loop"),
        "{log}"
    );
    assert!(log.contains("tiny/world"), "the world decoder: {log}");
    assert!(!log.contains("RANDOM"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 1, "{log}");
    let out = worker(&[
        "generate",
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
fn fp8_linears_run_and_say_so() {
    let out = worker(&[
        "generate",
        "--weights",
        "random",
        "--dtype",
        "fp8",
        "--chunks",
        "1",
        "--log-format",
        "json",
    ]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("bf16 + fp8 linears"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 1, "{log}");
}

#[test]
fn sparse_attention_runs_and_says_so() {
    let out = worker(&[
        "generate",
        "--attention",
        "vsa:0.5",
        "--chunks",
        "2",
        "--log-format",
        "json",
    ]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("vsa, sparsity 0.5 (the model was trained with dense attention"),
        "{log}"
    );
    assert!(log.contains("SPARSE ATTENTION"), "{log}");
    assert_eq!(log.matches("chunk done").count(), 2, "{log}");
}

#[test]
fn bad_flags_fail_with_a_reason() {
    let cases: [(&[&str], &str); 19] = [
        (&["--model", "giant"], "unknown model 'giant'"),
        (&["--dtype", "f16"], "the weights run in f32, bf16 or fp8"),
        (
            &["--attention", "fp16"],
            "--attention fp16: bf16, fp8, vsa or vsa:SPARSITY",
        ),
        (
            &["--attention", "vsa:1"],
            "--attention vsa:1: sparsity 1 is outside [0, 1)",
        ),
        (
            &["--attention", "vsa:most"],
            "--attention vsa:most: sparsity 'most' is not a number",
        ),
        // tiny's heads are 32 wide; the fp8 attention takes 128.
        (&["--attention", "fp8"], "fp8 attention takes head dim 128"),
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
            // No AMD GPU on a test machine: the backend says which device it could not open.
            &["--device", "rocm"],
            "rocm:0",
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
        (&["--chunk-frames", "0"], "--chunk-frames 0: from 1 to 16"),
        (
            &["--chunk-frames", "4", "--window-frames", "9"],
            "a window of 9 frames cannot hold 6 sink frames and a chunk of 4",
        ),
        (
            &["--steps", "0,500,250"],
            "step indices must increase (from the noisiest step on): 500 then 250",
        ),
    ];
    for (args, want) in cases {
        let args = [&["generate"], args].concat();
        let out = worker(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected '{want}' in:\n{err}");
    }
}

#[test]
fn cards_on_the_cpu_run_the_loopback_rank_group() {
    let out = worker(&[
        "generate",
        "--cards",
        "4",
        "--chunks",
        "2",
        "--log-format",
        "json",
    ]);
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
            "generate",
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
        assert!(log.contains("decoder ready"), "{log}");
        let bytes = std::fs::read(&path).expect("the --out file");
        // 3 latents per chunk: 1 + 4·2 = 9 frames, then 4·3 = 12.
        assert_eq!(y4m_frames(&bytes, 128, 128), 21, "{decoder}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn chunks_of_four_latent_frames_give_13_then_16_video_frames() {
    let dir = temp_dir("chunk4");
    let path = dir.join("four.y4m");
    let path_arg = path.to_str().expect("UTF-8 temp path");
    let out = worker(&[
        "generate",
        "--chunk-frames",
        "4",
        "--chunks",
        "2",
        "--log-format",
        "json",
        "--out",
        path_arg,
    ]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("\"chunk_frames\":4"),
        "the loop is logged: {log}"
    );
    assert!(
        log.contains("the embedded model was trained with the default streaming loop"),
        "{log}"
    );
    assert!(log.contains("\"frames\":13"), "{log}");
    assert!(log.contains("\"frames\":16"), "{log}");
    let bytes = std::fs::read(&path).expect("the --out file");
    assert_eq!(y4m_frames(&bytes, 128, 128), 29);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn each_chunk_logs_its_frames_and_decode_time() {
    let out = worker(&["generate", "--chunks", "2", "--log-format", "json"]);
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

/// `GET path` on a plain blocking socket: (status, body).
fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = text.split_once("\r\n\r\n").map(|b| b.1).unwrap_or("");
    (code, body.to_string())
}

/// Kills the child however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn without_a_subcommand_the_worker_serves_the_browser_client() {
    use std::io::BufRead;
    // Only --listen differs from `worker` alone (port 0: tests never take 8080).
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_worker"))
            .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
            .env_remove("RUST_LOG")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run worker"),
    );
    let stderr = child.0.stderr.take().expect("stderr");
    let mut log = String::new();
    let mut addr = None;
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line.expect("log line");
        log.push_str(&line);
        log.push('\n');
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["fields"]["message"] == "serving" {
            addr = v["fields"]["addr"].as_str().map(String::from);
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("no 'serving' line:\n{log}"));
    assert!(log.contains("\"model\":\"tiny\""), "{log}");
    let (code, page) = http_get(&addr, "/");
    assert_eq!(code, 200);
    assert!(page.contains("<title>Worldline</title>"), "{page}");
    let (code, js) = http_get(&addr, "/web/main.js");
    assert_eq!(code, 200);
    assert!(js.contains("WsTransport"), "{js}");
    assert_eq!(http_get(&addr, "/web/nothing.js").0, 404);
    let (code, status) = http_get(&addr, "/status");
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&status).expect("status JSON");
    assert_eq!(status["model"], "tiny");
    // `auto` is resolved before serving: the status names a real device.
    let device = status["device"].as_str().expect("device");
    assert!(device == "cpu" || device.starts_with("cuda:"), "{device}");
}
