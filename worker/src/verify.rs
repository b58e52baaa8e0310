//! `worker verify world`: the default model's play against the renderer (see
//! `pipeline::world::verify`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kernels::DType;
use pipeline::vae::{TinyDecoder, TinyDecoderConfig, TinyEncoder, TinyEncoderConfig};
use pipeline::world::verify::{self, Codec, TourScore};
use pipeline::world::{dataset, trajectory, Scene};
use pipeline::WeightStore;
use tracing::info;

use crate::decode::DecoderArgs;
use crate::setup::{self, ModelArgs};

#[derive(Debug, Subcommand)]
pub enum VerifyCommand {
    /// Scripted held-out tours through the streaming engine and the tiny decoder, against the
    /// renderer's frames of the same poses: PSNR and SSIM of the first and last second, and a
    /// motion check (W/S/A/D/still, each against its own renders and the others').
    World(WorldArgs),
}

#[derive(Debug, Args)]
pub struct WorldArgs {
    /// Chunks per tour (14: 165 frames, 10.3 s).
    #[arg(long, default_value_t = 14)]
    chunks: usize,
    /// Chunks per command of the motion check.
    #[arg(long, default_value_t = 4)]
    motion_chunks: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The world autoencoder: the embedded one with the embedded DiT, else `--decoder-weights`
/// (a file with `encoder.*` and `decoder.*` of the `world` configs).
fn codec(loaded: &setup::Loaded, dec: &DecoderArgs) -> Result<Codec> {
    if let Some(path) = &dec.decoder_weights {
        let store = WeightStore::open(path, DType::F32)
            .with_context(|| format!("opening --decoder-weights {}", path.display()))?;
        return Ok(Codec {
            encoder: TinyEncoder::load(&TinyEncoderConfig::world(), &store)?,
            decoder: TinyDecoder::load(&TinyDecoderConfig::world(), &store)?,
        });
    }
    match &loaded.world {
        Some(w) => Ok(Codec {
            encoder: w.encoder()?,
            decoder: w.decoder()?,
        }),
        None => bail!(
            "verify world needs the world autoencoder: run the embedded default (no --weights) or give --decoder-weights with encoder.* and decoder.* of the world configs"
        ),
    }
}

pub fn run(args: &ModelArgs, dec: &DecoderArgs, cmd: &VerifyCommand) -> Result<()> {
    let VerifyCommand::World(a) = cmd;
    if a.chunks == 0 || a.chunks > 40 || a.motion_chunks == 0 || a.motion_chunks > 40 {
        bail!("--chunks and --motion-chunks must be 1 to 40");
    }
    let loaded = setup::load(args)?;
    let Some(model) = loaded.model.clone() else {
        bail!("verify world runs on one card");
    };
    let mut codec = codec(&loaded, dec)?;
    let cfg = loaded.engine_config(args.seed)?;
    let renderer = dataset::renderer(&cfg, 2);
    let spawn = Scene::new().spawn();
    let mut scores: Vec<TourScore> = Vec::new();
    for (name, controls) in trajectory::scripted(a.chunks) {
        let started = std::time::Instant::now();
        let played = verify::play(&model, &cfg, &mut codec, &renderer, spawn, &controls)
            .with_context(|| format!("tour {name}"))?;
        let s = verify::score(name, &played, cfg.height, cfg.width);
        info!(
            tour = name,
            frames = s.frames,
            seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
            "tour played"
        );
        scores.push(s);
    }
    let motion = verify::motion_check(&model, &cfg, &mut codec, &renderer, a.motion_chunks)?;

    println!(
        "{:<20} {:>6} {:>11} {:>11} {:>11} {:>11}",
        "tour", "frames", "PSNR 1st s", "SSIM 1st s", "PSNR last s", "SSIM last s"
    );
    for s in &scores {
        println!(
            "{:<20} {:>6} {:>11.2} {:>11.3} {:>11.2} {:>11.3}",
            s.name,
            s.frames,
            s.psnr_first_second,
            s.ssim_first_second,
            s.psnr_last_second,
            s.ssim_last_second
        );
    }
    let avg = |f: fn(&TourScore) -> f64| scores.iter().map(f).sum::<f64>() / scores.len() as f64;
    let mean = serde_json::json!({
        "psnr_first_second": avg(|s| s.psnr_first_second),
        "ssim_first_second": avg(|s| s.ssim_first_second),
        "psnr_last_second": avg(|s| s.psnr_last_second),
        "ssim_last_second": avg(|s| s.ssim_last_second),
    });
    println!(
        "{:<20} {:>6} {:>11.2} {:>11.3} {:>11.2} {:>11.3}",
        "mean",
        "",
        avg(|s| s.psnr_first_second),
        avg(|s| s.ssim_first_second),
        avg(|s| s.psnr_last_second),
        avg(|s| s.ssim_last_second)
    );
    println!(
        "\nmotion check (PSNR dB of the clip generated for a command, rows, against the renders of each command, columns):"
    );
    print!("{:<6}", "");
    for c in &motion.commands {
        print!("{c:>8}");
    }
    println!();
    for (c, row) in motion.commands.iter().zip(&motion.psnr) {
        print!("{c:<6}");
        for v in row {
            print!("{v:>8.2}");
        }
        println!();
    }
    println!(
        "{} of {} commands are closest to their own renders of all",
        motion.correct,
        motion.commands.len()
    );
    for (c, ok) in &motion.beats_opposite_and_still {
        println!(
            "{c}: own renders beat the opposite command's and standing still's: {}",
            if *ok { "yes" } else { "NO" }
        );
    }
    println!("\nhorizontal image motion, px per frame (renders / generated):");
    for r in &motion.shift_px_per_frame {
        println!("{:<6}{:>8.2}{:>8.2}", r.command, r.truth, r.generated);
    }
    for (c, ok) in &motion.yaw_seen {
        println!(
            "{c}: the clip pans the renders' way at least half as fast: {}",
            if *ok { "yes" } else { "NO" }
        );
    }
    if let Some(path) = &a.json {
        let json = serde_json::json!({
            "model": loaded.cfg.name,
            "weights": loaded.weights.json(),
            "tours": scores,
            "mean": mean,
            "motion": motion,
            "chunks": a.chunks,
            "motion_chunks": a.motion_chunks,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        info!(json = %path.display(), "results written");
    }
    Ok(())
}
