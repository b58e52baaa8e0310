//! A synthetic camera: a test pattern that moves with time (colour bars scrolling sideways and a
//! bright square on a circle), JPEG-encoded, so a worker that takes camera input sees motion.

use std::f64::consts::TAU;
use std::time::Duration;

use jpeg_encoder::{ColorType, Encoder};

use crate::Error;

/// Colour bars (75 % SMPTE order).
const BARS: [[u8; 3]; 7] = [
    [191, 191, 191],
    [191, 191, 0],
    [0, 191, 191],
    [0, 191, 0],
    [191, 0, 191],
    [191, 0, 0],
    [0, 0, 191],
];

/// Largest side the camera makes, so a wrong flag cannot ask for gigabytes.
pub const MAX_SIDE: usize = 4096;

#[derive(Clone, Debug)]
pub struct Camera {
    width: usize,
    height: usize,
    quality: u8,
}

impl Camera {
    pub fn new(width: usize, height: usize, quality: u8) -> Result<Camera, Error> {
        if !(8..=MAX_SIDE).contains(&width) || !(8..=MAX_SIDE).contains(&height) {
            return Err(Error::Config(format!(
                "camera size {width}x{height}: each side must be 8..={MAX_SIDE}"
            )));
        }
        Ok(Camera {
            width,
            height,
            quality: quality.clamp(1, 100),
        })
    }

    /// The pattern at content time `t`, as RGB bytes.
    pub fn rgb(&self, t: Duration) -> Vec<u8> {
        let (w, h) = (self.width, self.height);
        let s = t.as_secs_f64();
        // Bars scroll one screen width every 4 s; the square circles once every 2 s.
        let shift = ((s / 4.0).fract() * w as f64) as usize;
        let side = (w.min(h) / 6).max(2);
        let cx = w as f64 / 2.0 + (w as f64 / 3.0) * (TAU * s / 2.0).cos();
        let cy = h as f64 / 2.0 + (h as f64 / 3.0) * (TAU * s / 2.0).sin();
        let (x0, y0) = (cx as usize - side / 2, cy as usize - side / 2);
        let mut out = Vec::with_capacity(3 * w * h);
        for y in 0..h {
            for x in 0..w {
                let px = if (x0..x0 + side).contains(&x) && (y0..y0 + side).contains(&y) {
                    [255, 255, 255]
                } else {
                    BARS[((x + shift) % w) * BARS.len() / w]
                };
                out.extend_from_slice(&px);
            }
        }
        out
    }

    /// The pattern at content time `t` as a baseline JPEG.
    pub fn jpeg(&self, t: Duration) -> Result<Vec<u8>, Error> {
        let mut out = Vec::new();
        // Both sides are ≤ MAX_SIDE, so they fit in u16.
        let (w, h) = (self.width as u16, self.height as u16);
        Encoder::new(&mut out, self.quality)
            .encode(&self.rgb(t), w, h, ColorType::Rgb)
            .map_err(|e| Error::Camera(e.to_string()))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_moves_and_encodes() {
        let cam = Camera::new(64, 48, 80).expect("camera");
        let a = cam.rgb(Duration::ZERO);
        let b = cam.rgb(Duration::from_millis(500));
        assert_eq!(a.len(), 64 * 48 * 3);
        assert_ne!(a, b, "the pattern should change over time");
        let jpeg = cam.jpeg(Duration::from_millis(250)).expect("jpeg");
        assert_eq!(&jpeg[..2], [0xFF, 0xD8]);
        assert!(Camera::new(4, 48, 80).is_err());
    }
}
