//! The streaming loop's shape from the command line: chunk size, KV window, denoising steps.
//!
//! The defaults are the engine's LingBot settings (`EngineConfig::lingbot`): chunks of 3 latent
//! frames with LingBot v2's window and step list. Checkpoints trained another way (LingBot v2
//! streams chunks of 4; v1 Fast steps at 0,179,358,679) need their own, and a model given a
//! loop it was not trained with still runs, so each flag is checked only for what would break
//! the engine or exhaust a card.

use anyhow::{bail, Result};
use clap::Args;
use pipeline::EngineConfig;
use serde_json::json;

/// Most latent frames in one chunk (64 video frames): 4× the largest published chunk.
pub const MAX_CHUNK_FRAMES: usize = 16;
/// Most latent frames the KV window holds: 3.5× LingBot v2's 18.
pub const MAX_WINDOW_FRAMES: usize = 64;
/// Most denoising steps per chunk: the few-step models use 4.
pub const MAX_STEPS: usize = 50;

#[derive(Clone, Debug, Default, Args)]
pub struct StreamArgs {
    /// Latent frames per chunk (4 video frames each, 1 + 4(N − 1) in a stream's first chunk).
    /// Default 3; LingBot v2 checkpoints were trained with 4.
    #[arg(long, global = true, value_name = "N")]
    pub chunk_frames: Option<usize>,

    /// Latent frames the self-attention cache holds, sink frames included. Default 18.
    #[arg(long, global = true, value_name = "N")]
    pub window_frames: Option<usize>,

    /// Of those, the stream's first frames, kept when the window rolls. Default 6.
    #[arg(long, global = true, value_name = "N")]
    pub sink_frames: Option<usize>,

    /// Denoising steps of a chunk: increasing indices into the 1000-entry flow schedule,
    /// comma-separated. Default 0,250,500,750 (LingBot v2; v1 Fast: 0,179,358,679).
    #[arg(long, global = true, value_delimiter = ',', value_name = "I,I,...")]
    pub steps: Option<Vec<usize>>,

    /// Shift of the flow schedule. Default 10.
    #[arg(long, global = true, value_name = "S")]
    pub shift: Option<f64>,
}

impl StreamArgs {
    /// `cfg` with the flags given applied, refused with the flag's name when the engine could
    /// not run it.
    pub fn apply(&self, mut cfg: EngineConfig) -> Result<EngineConfig> {
        if let Some(n) = self.chunk_frames {
            if n == 0 || n > MAX_CHUNK_FRAMES {
                bail!("--chunk-frames {n}: from 1 to {MAX_CHUNK_FRAMES}");
            }
            cfg.chunk_frames = n;
        }
        if let Some(n) = self.window_frames {
            if n > MAX_WINDOW_FRAMES {
                bail!("--window-frames {n}: at most {MAX_WINDOW_FRAMES}");
            }
            cfg.window_frames = n;
        }
        if let Some(n) = self.sink_frames {
            cfg.sink_frames = n;
        }
        if let Some(steps) = &self.steps {
            if steps.is_empty() || steps.len() > MAX_STEPS {
                bail!(
                    "--steps: from 1 to {MAX_STEPS} indices, {} given",
                    steps.len()
                );
            }
            cfg.step_indices = steps.clone();
        }
        if let Some(s) = self.shift {
            if !(s.is_finite() && s > 0.0 && s <= 1000.0) {
                bail!("--shift {s}: a positive number up to 1000");
            }
            cfg.shift = s;
        }
        if let Err(e) = cfg.validate() {
            bail!("the streaming loop (--chunk-frames, --window-frames, --sink-frames, --steps, --shift): {e}");
        }
        Ok(cfg)
    }
}

/// The loop as logs and `/status` give it.
pub fn describe(cfg: &EngineConfig) -> serde_json::Value {
    json!({
        "chunk_frames": cfg.chunk_frames,
        "window_frames": cfg.window_frames,
        "sink_frames": cfg.sink_frames,
        "steps": cfg.step_indices,
        "shift": cfg.shift,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(chunk: Option<usize>, window: Option<usize>, sink: Option<usize>) -> StreamArgs {
        StreamArgs {
            chunk_frames: chunk,
            window_frames: window,
            sink_frames: sink,
            ..StreamArgs::default()
        }
    }

    #[test]
    fn no_flags_keep_the_defaults() {
        let base = EngineConfig::lingbot(7);
        let out = StreamArgs::default().apply(base.clone()).expect("defaults");
        assert_eq!(out, base);
    }

    #[test]
    fn flags_replace_only_their_field() {
        let a = StreamArgs {
            chunk_frames: Some(4),
            steps: Some(vec![0, 179, 358, 679]),
            ..StreamArgs::default()
        };
        let out = a
            .apply(EngineConfig::lingbot(0))
            .expect("v1 steps, v2 chunks");
        assert_eq!(out.chunk_frames, 4);
        assert_eq!(out.step_indices, [0, 179, 358, 679]);
        assert_eq!((out.window_frames, out.sink_frames), (18, 6));
        assert_eq!(out.shift, 10.0);
    }

    #[test]
    fn bad_loops_are_refused_with_the_reason() {
        let cases: [(StreamArgs, &str); 8] = [
            (args(Some(0), None, None), "--chunk-frames 0: from 1 to 16"),
            (args(Some(17), None, None), "--chunk-frames 17"),
            (args(None, Some(65), None), "--window-frames 65: at most 64"),
            (
                args(Some(4), Some(9), None),
                "cannot hold 6 sink frames and a chunk of 4",
            ),
            (
                StreamArgs {
                    steps: Some(vec![0, 500, 250]),
                    ..StreamArgs::default()
                },
                "step indices must increase",
            ),
            (
                StreamArgs {
                    steps: Some(vec![0, 1000]),
                    ..StreamArgs::default()
                },
                "step index 1000 outside the 1000-step table",
            ),
            (
                StreamArgs {
                    steps: Some(vec![]),
                    ..StreamArgs::default()
                },
                "--steps: from 1 to 50 indices, 0 given",
            ),
            (
                StreamArgs {
                    shift: Some(f64::NAN),
                    ..StreamArgs::default()
                },
                "--shift NaN",
            ),
        ];
        for (a, want) in cases {
            let err = a
                .apply(EngineConfig::lingbot(0))
                .expect_err(want)
                .to_string();
            assert!(err.contains(want), "expected '{want}' in: {err}");
        }
    }
}
