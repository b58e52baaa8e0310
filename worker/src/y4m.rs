//! A YUV4MPEG2 writer: RGB frames in `[-1, 1]` to 4:2:0 BT.601 full-range YUV (`C420jpeg`:
//! each chroma sample is the mean of a 2×2 block, sited at its centre).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Frame rate of written streams (LingBot's 16 fps).
pub const FPS: u32 = 16;

/// BT.601 full-range (JFIF) `(Y, Cb, Cr)` of an RGB pixel in `[0, 255]`, unrounded.
pub fn rgb_to_ycbcr(r: f32, g: f32, b: f32) -> (f32, f32, f32) {
    let y = 0.299 * r + 0.587 * g + 0.114 * b;
    let cb = 128.0 - 0.168_736 * r - 0.331_264 * g + 0.5 * b;
    let cr = 128.0 + 0.5 * r - 0.418_688 * g - 0.081_312 * b;
    (y, cb, cr)
}

/// A sample in `[-1, 1]` as `[0, 255]`.
fn to_255(v: f32) -> f32 {
    (v.clamp(-1.0, 1.0) + 1.0) * 127.5
}

fn to_byte(v: f32) -> u8 {
    v.round().clamp(0.0, 255.0) as u8
}

/// One frame's planes (`Y`, then `Cb`, then `Cr`) from its `R`, `G`, `B` planes of
/// `width × height` samples in `[-1, 1]`.
pub fn frame_to_yuv420(rgb: [&[f32]; 3], width: usize, height: usize) -> Vec<u8> {
    let (cw, ch) = (width.div_ceil(2), height.div_ceil(2));
    let mut luma = Vec::with_capacity(width * height);
    let mut cb = vec![0f32; cw * ch];
    let mut cr = vec![0f32; cw * ch];
    let mut count = vec![0f32; cw * ch];
    let pixels = rgb[0].iter().zip(rgb[1]).zip(rgb[2]).take(width * height);
    for (i, ((&r, &g), &b)) in pixels.enumerate() {
        let (y, u, v) = rgb_to_ycbcr(to_255(r), to_255(g), to_255(b));
        luma.push(to_byte(y));
        let c = (i / width / 2) * cw + (i % width) / 2;
        cb[c] += u;
        cr[c] += v;
        count[c] += 1.0;
    }
    let mean =
        |s: &[f32]| -> Vec<u8> { s.iter().zip(&count).map(|(v, n)| to_byte(v / n)).collect() };
    let mut out = luma;
    out.extend(mean(&cb));
    out.extend(mean(&cr));
    out
}

/// A `.y4m` file being written.
#[derive(Debug)]
pub struct Y4mWriter {
    path: PathBuf,
    out: BufWriter<File>,
    width: usize,
    height: usize,
    /// Frames written so far.
    pub frames: u64,
}

impl Y4mWriter {
    /// Creates `path` and writes the stream header.
    pub fn create(path: &Path, width: usize, height: usize) -> Result<Self> {
        let file =
            File::create(path).with_context(|| format!("creating --out {}", path.display()))?;
        let mut w = Y4mWriter {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            width,
            height,
            frames: 0,
        };
        let header = format!("YUV4MPEG2 W{width} H{height} F{FPS}:1 Ip A1:1 C420jpeg\n");
        w.write(header.as_bytes())?;
        Ok(w)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Appends the frames of `[3, t, height, width]` samples (channel-major, as a tensor's
    /// `to_vec_f32`) and flushes, so the file holds whole frames between chunks.
    pub fn append(&mut self, data: &[f32], t: usize) -> Result<()> {
        let plane = self.width * self.height;
        if data.len() != 3 * t * plane {
            bail!(
                "{} values for {t} frames of 3×{}×{}",
                data.len(),
                self.height,
                self.width
            );
        }
        for f in 0..t {
            let ch = |c: usize| &data[(c * t + f) * plane..][..plane];
            let yuv = frame_to_yuv420([ch(0), ch(1), ch(2)], self.width, self.height);
            self.write(b"FRAME\n")?;
            self.write(&yuv)?;
            self.frames += 1;
        }
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BT.601 full range of known colours (JFIF), each within ±1.
    #[test]
    fn known_colours_convert_to_bt601_full_range() {
        let cases: [([f32; 3], [u8; 3]); 5] = [
            ([1.0, -1.0, -1.0], [76, 85, 255]),
            ([-1.0, 1.0, -1.0], [150, 44, 21]),
            ([-1.0, -1.0, 1.0], [29, 255, 107]),
            ([1.0, 1.0, 1.0], [255, 128, 128]),
            ([-1.0, -1.0, -1.0], [0, 128, 128]),
        ];
        for (rgb, want) in cases {
            let planes: Vec<Vec<f32>> = rgb.iter().map(|&v| vec![v; 4]).collect();
            let yuv = frame_to_yuv420([&planes[0], &planes[1], &planes[2]], 2, 2);
            assert_eq!(yuv.len(), 6, "{rgb:?}");
            let got = [yuv[0], yuv[4], yuv[5]];
            assert!(yuv[..4].iter().all(|&y| y == yuv[0]), "{rgb:?}: {yuv:?}");
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (*g as i32 - w as i32).abs() <= 1,
                    "{rgb:?}: {got:?} vs {want:?}"
                );
            }
        }
    }

    #[test]
    fn chroma_is_the_mean_of_each_two_by_two_block() {
        // Left column white, right column black: one chroma sample per 2×2, neutral grey.
        let r = [1.0, -1.0, 1.0, -1.0];
        let yuv = frame_to_yuv420([&r, &r, &r], 2, 2);
        assert_eq!(yuv, vec![255, 0, 255, 0, 128, 128]);
    }

    #[test]
    fn a_wrong_sample_count_is_refused() {
        let dir = std::env::temp_dir().join(format!("y4m-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("x.y4m");
        let mut w = Y4mWriter::create(&path, 2, 2).expect("create");
        assert!(w.append(&[0.0; 11], 1).is_err());
        w.append(&[0.0; 12], 1).expect("one frame");
        drop(w);
        let bytes = std::fs::read(&path).expect("read");
        let header = b"YUV4MPEG2 W2 H2 F16:1 Ip A1:1 C420jpeg\nFRAME\n";
        assert!(bytes.starts_with(header));
        assert_eq!(bytes.len(), header.len() + 6);
        std::fs::remove_dir_all(&dir).ok();
    }
}
