//! `worker`: the Worldline streaming world-model worker.

mod bench;
mod bench_codecs;
mod bench_gpu;
mod bench_sp;
mod verify;
mod world;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use pipeline::camera::Controls;
use pipeline::{Chunk, ChunkInputs, Engine, EngineGroup};
use tracing::info;
use worker::{decode, server, setup};

#[derive(Debug, Parser)]
#[command(
    name = "worker",
    version,
    about = "Real-time streaming world-model worker (LingBot-World / Wan DiT)",
    long_about = "Real-time streaming world-model worker (LingBot-World / Wan DiT).\n\n\
        With no subcommand it serves (as `worker serve`): the browser client at \
        http://127.0.0.1:8080/, WebSocket sessions, metrics.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(flatten)]
    model: setup::ModelArgs,

    #[command(flatten)]
    decode: decode::DecoderArgs,

    /// `worker` alone serves: these are `worker serve`'s flags.
    #[command(flatten)]
    serve: server::ServeArgs,

    /// Log format: text or json.
    #[arg(long, default_value = "text", global = true)]
    log_format: String,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve sessions over HTTP/WebSocket (see worker/PROTOCOL.md): the browser client at `/`,
    /// `/v1/ws`, `/metrics`, `/healthz`, `/readyz`, `/status`. The default.
    Serve(server::ServeArgs),
    /// Run the chunk engine without a network: generate, decode and log chunks (`--out` writes
    /// the frames as YUV4MPEG2).
    Generate {
        /// Chunks to generate before exiting.
        #[arg(long, default_value_t = 8)]
        chunks: u64,
    },
    /// Time the CPU reference: one `tiny` chunk and one lingbot-1.3b block at 480×832, with FLOPs
    /// counted and GFLOP/s against the GEMM crate's peak on this machine.
    Bench {
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Repetitions of each measurement (the best is reported).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// `cpu` (default): the CPU reference. `kernels`: GPU GEMMs, attention and a DiT block
        /// on --device, at LingBot's shapes. `vsa`: only the dense and sparse attention rows of
        /// `kernels`. `blocks`: only its DiT block rows. `gemm-algos`: the `kernels` GEMMs with each of the first ranks of
        /// cuBLASLt's heuristic answers, timed against each other (CUDA). `gemm-configs`: the
        /// same GEMMs with other configurations (tile, cluster, stages …) of the heuristic's
        /// first algorithm, the fastest against its own (CUDA). `sp`: the streaming
        /// loop of --model on 1, 2, 4 … --cards GPUs (Ulysses), each against one card,
        /// --chunks timed chunks. `gemm-rows`: a rank's GEMM rows against the whole chunk's.
        /// `codecs`: the tiny decoder/encoder and the Wan2.1 VAE on one 480×832 chunk on
        /// --device, and one umT5-xxl prompt encode on a GPU (--codecs picks).
        #[arg(default_value = "cpu")]
        suite: String,
        /// `sp`: timed chunks per run.
        #[arg(long, default_value_t = 8)]
        chunks: u64,
        /// `sp`: the ranks share --device's one GPU as threads over the in-process loopback
        /// (no NCCL): their work runs one after another on one stream, so a chunk takes about
        /// the one-card time when the work divides evenly, and the excess is what does not
        /// (links not included). For hosts with one GPU.
        #[arg(long)]
        one_gpu: bool,
        /// `codecs`: weight dtypes to run, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "bf16,f32")]
        codec_dtypes: Vec<String>,
        /// `codecs`: rows to run, comma-separated: tiny-dec, tiny-enc, vae-dec, vae-enc, text
        /// (the umT5-xxl prompt encode, bf16, GPU only).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "tiny-dec,tiny-enc,vae-dec,vae-enc,text"
        )]
        codecs: Vec<String>,
    },
    /// The procedural world of the embedded default: training data.
    #[command(subcommand)]
    World(world::WorldCommand),
    /// Checks of a model against ground truth.
    #[command(subcommand)]
    Verify(verify::VerifyCommand),
}

fn init_logging(format: &str) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        "text" => builder.init(),
        "json" => builder.json().init(),
        other => anyhow::bail!("unknown --log-format '{other}' (expected text or json)"),
    }
    Ok(())
}

fn main() -> Result<()> {
    let mut cli = Cli::parse();
    init_logging(&cli.log_format)?;
    // `auto` becomes a device here, once, so every later step (and the log) names it.
    if matches!(cli.command, None | Some(Command::Serve(_))) {
        lower_compute_priority();
    }
    let device = cli.model.device()?;
    cli.model.device = device.to_string();
    match cli.command {
        Some(Command::Bench {
            json,
            repeat,
            suite,
            chunks,
            one_gpu,
            codec_dtypes,
            codecs,
        }) => match suite.as_str() {
            "cpu" => bench::run(json.as_deref(), repeat.max(1)),
            "kernels" => bench_gpu::run(&cli.model.device, json.as_deref(), repeat.max(1)),
            "vsa" => bench_gpu::run_vsa(&cli.model.device, json.as_deref(), repeat.max(1)),
            "blocks" => bench_gpu::run_blocks(&cli.model.device, json.as_deref(), repeat.max(1)),
            "sp" => bench_sp::run(&cli.model, chunks as usize, json.as_deref(), one_gpu),
            "gemm-rows" => bench_sp::gemm_rows(&cli.model),
            "gemm-algos" => {
                bench_gpu::run_gemm_algos(&cli.model.device, json.as_deref(), repeat.max(1))
            }
            "gemm-configs" => {
                bench_gpu::run_gemm_configs(&cli.model.device, json.as_deref(), repeat.max(1))
            }
            "codecs" => bench_codecs::run(
                &cli.model.device,
                json.as_deref(),
                repeat.max(1),
                &codec_dtypes,
                &codecs,
            ),
            other => anyhow::bail!(
                "unknown bench suite '{other}' (expected cpu, kernels, vsa, blocks, sp, gemm-rows, gemm-algos, gemm-configs or codecs)"
            ),
        },
        Some(Command::World(cmd)) => world::run(&cmd),
        Some(Command::Verify(cmd)) => verify::run(&cli.model, &cli.decode, &cmd),
        Some(Command::Serve(args)) => server::serve_main(&cli.model, &cli.decode, &args),
        None => server::serve_main(&cli.model, &cli.decode, &cli.serve),
        Some(Command::Generate { chunks }) => generate(&cli.model, &cli.decode, chunks),
    }
}

/// Serving: the CPU compute pool (the model's ops on the CPU) runs below the async runtime's
/// priority, so camera decode, encoding, pacing and sends preempt it. A model that cannot keep up
/// then delays its own next chunk, not the frames already made. Must run before anything uses the
/// pool (loading random weights does).
fn lower_compute_priority() {
    let built = rayon::ThreadPoolBuilder::new()
        .start_handler(|_| {
            #[cfg(target_os = "linux")]
            // SAFETY: gettid and setpriority take no pointers; this only raises the calling
            // thread's nice value (Linux applies it per thread).
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, COMPUTE_NICE);
            }
        })
        .build_global();
    if let Err(e) = built {
        tracing::warn!("compute threads keep the default priority: {e}");
    }
}

/// Nice value of the compute pool's threads while serving.
const COMPUTE_NICE: libc::c_int = 10;

/// One card, or a rank group of `--cards` ranks.
enum Session {
    One(Box<Engine>),
    Group(EngineGroup),
}

/// A fixed tour: forward, turn right, strafe, look up, so every control path runs.
fn tour(i: u64) -> Controls {
    let tour = [
        Controls {
            w: true,
            ..Default::default()
        },
        Controls {
            w: true,
            d: true,
            ..Default::default()
        },
        Controls {
            e: true,
            ..Default::default()
        },
        Controls {
            i: true,
            mouse_dx: 40.0,
            ..Default::default()
        },
    ];
    tour[(i % tour.len() as u64) as usize]
}

/// Logs one chunk: the engine's timings, the latents' RMS and what the decoder made of them.
fn report(chunk: &Chunk, decoded: &decode::Decoded) {
    let t = &chunk.timings;
    let steps: Vec<String> = t
        .steps
        .iter()
        .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
        .collect();
    let x = chunk.latents.to_vec_f32();
    let rms = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
    info!(
        chunk = chunk.index,
        first_frame = chunk.first_frame,
        camera_ms = format!("{:.1}", t.camera.as_secs_f64() * 1e3),
        steps_ms = steps.join("/"),
        refresh_ms = format!("{:.1}", t.refresh.as_secs_f64() * 1e3),
        latent_rms = format!("{rms:.3}"),
        frames = decoded.frames,
        decode_ms = format!("{:.1}", decoded.time.as_secs_f64() * 1e3),
        "chunk done"
    );
}

/// Runs the chunk engine on the chosen model, decodes each chunk and reports it: the engine
/// without a network (`worker serve` serves sessions).
fn generate(args: &setup::ModelArgs, dec: &decode::DecoderArgs, chunks: u64) -> Result<()> {
    let loaded = setup::load(args)?;
    let dec = &loaded.decoder_args(dec);
    let cfg = loaded.engine_config(args.seed)?;
    let resolution = format!("{}x{}", cfg.width, cfg.height);
    let tiny = loaded.cfg.name.starts_with("tiny");
    let size = (cfg.width, cfg.height);
    let mut sink = decode::FrameSink::new(dec, args.seed, tiny, size, args.device()?)?;
    let mut session = match &loaded.model {
        Some(model) if loaded.cards == 1 => {
            Session::One(Box::new(Engine::new(model.clone(), cfg)?))
        }
        _ => Session::Group(loaded.engine_group(cfg)?),
    };
    info!(
        model = %loaded.cfg.name,
        resolution,
        cards = loaded.cards,
        "streaming {chunks} chunks (no sessions: `worker serve` serves them)"
    );
    for i in 0..chunks {
        let inputs = ChunkInputs { controls: tour(i) };
        let chunk = match &mut session {
            Session::One(e) => e.next_chunk(&inputs)?,
            Session::Group(g) => g.next_chunk(&inputs)?,
        };
        let decoded = sink
            .push(&chunk.latents)
            .with_context(|| format!("chunk {}", chunk.index))?;
        report(&chunk, &decoded);
    }
    Ok(())
}
