//! `worker world …`: the procedural world of the embedded default (training data, pictures).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use pipeline::world::dataset::{self, DatasetOptions};
use pipeline::world::Split;
use tracing::info;

#[derive(Debug, Subcommand)]
pub enum WorldCommand {
    /// Render random play and write the training set (see pipeline/train/DATASET.md).
    Dataset(DatasetArgs),
}

#[derive(Debug, Args)]
pub struct DatasetArgs {
    /// Output folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Clips to render.
    #[arg(long, default_value_t = 64)]
    clips: usize,
    /// Chunks per clip (3 latent frames each; a clip has 1 + 4(3·chunks − 1) frames).
    #[arg(long, default_value_t = 4)]
    chunks: usize,
    /// Seed of the trajectories.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// train, or heldout (a disjoint stream for evaluation).
    #[arg(long, default_value = "train")]
    split: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Rays per pixel side (2: 2×2 supersampling).
    #[arg(long, default_value_t = 2)]
    samples: usize,
    /// Skip camera.npy (the exact camera tokens; 1.2 MB per chunk), rebuildable from
    /// rel_poses.npy and pixel_rays.npy.
    #[arg(long)]
    no_camera_tensor: bool,
}

pub fn run(cmd: &WorldCommand) -> Result<()> {
    match cmd {
        WorldCommand::Dataset(a) => {
            let split: Split = a.split.parse()?;
            let opts = DatasetOptions {
                clips: a.clips,
                chunks: a.chunks,
                seed: a.seed,
                split,
                samples: a.samples.clamp(1, 8),
                camera_tensor: !a.no_camera_tensor,
                threads: a.threads,
            };
            let s = dataset::export(&a.out, &opts)
                .with_context(|| format!("writing the data set to {}", a.out.display()))?;
            info!(
                clips = s.clips,
                frames = s.frames,
                seconds = format!("{:.2}", s.seconds),
                frames_per_second = format!("{:.0}", s.frames as f64 / s.seconds.max(1e-9)),
                out = %a.out.display(),
                split = split.name(),
                "data set written"
            );
            Ok(())
        }
    }
}
