//! The fp8 e4m3fn codec (OCP "E4M3FN": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
//! infinities, one NaN pattern per sign, largest finite ±448) and its scaling rule.
//!
//! Encoding rounds to nearest, ties to even, and saturates: anything at or beyond ±448, infinities
//! included, becomes ±448. This is what `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` and
//! PyTorch's `to(torch.float8_e4m3fn)` after a clamp do, so GPU kernels can be checked against it.

use std::sync::atomic::{AtomicBool, Ordering};

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Smallest scale used: an all-zero (or nearly so) tensor must not divide by zero, and a scale this
/// small still maps every f32 the model produces into range.
pub const MIN_SCALE: f32 = 1e-12;

/// The code `encode` gives to NaN (sign bit clear).
pub const NAN_CODE: u8 = 0x7f;

/// Decodes one e4m3fn code.
pub fn decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (code >> 3) & 0x0f;
    let man = (code & 0x07) as f32;
    if exp == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        // Subnormal: no implicit one, exponent fixed at 1 - bias.
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp as i32 - 7)
    };
    sign * mag
}

/// Encodes one f32 as e4m3fn: round to nearest even, saturate to ±448.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    let min_normal = 2f32.powi(-6);
    let code = if a < min_normal {
        // Subnormal steps are 2^-9; code 8 (the rounding carry) is exactly the smallest normal.
        (a * 512.0).round_ties_even() as u8
    } else {
        // a is a normal f32 here, so its biased exponent field gives floor(log2 a) exactly.
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        // Scaling by a power of two is exact, so the rounding below is the only rounding.
        let q = (a * 2f32.powi(3 - e)).round_ties_even() as i32; // in [8, 16]
                                                                 // A carry to 16 lands on the next binade's code, as the layout is monotonic.
        (((e + 7) << 3) + (q - 8)) as u8
    };
    sign | code
}

/// The scale that maps `amax` onto the largest code: `max(amax / 448, MIN_SCALE)`.
pub fn scale_for_amax(amax: f32) -> f32 {
    (amax / E4M3_MAX).max(MIN_SCALE)
}

/// Largest magnitude of a slice, ignoring NaN (a NaN input still encodes as NaN).
pub fn amax(xs: &[f32]) -> f32 {
    xs.iter()
        .fold(0.0f32, |m, x| if x.abs() > m { x.abs() } else { m })
}

/// Quantizes `xs` with one scale: `codes[i] = encode(xs[i] / scale)`.
pub fn quantize_into(xs: &[f32], scale: f32, codes: &mut [u8]) {
    let inv = 1.0 / scale;
    for (c, x) in codes.iter_mut().zip(xs) {
        *c = encode(x * inv);
    }
}

/// Dequantizes `codes` with one scale.
pub fn dequantize_into(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(codes) {
        *o = decode(*c) * scale;
    }
}

/// Whether a GPU GEMM may take rowwise scales itself (cuBLASLt's and hipBLASLt's outer-vector
/// scale mode): yes unless `WORLDLINE_FP8_ROWWISE=pass`, which forces a unit-scale GEMM and a
/// separate pass over its output. Read per call, so a benchmark can time both paths in one
/// process.
pub(crate) fn rowwise_in_gemm() -> bool {
    std::env::var("WORLDLINE_FP8_ROWWISE").map_or(true, |v| v != "pass")
}

/// Says once per process which path rowwise scales take (each path once, as shapes may differ);
/// `library` is the GEMM library's name.
pub(crate) fn log_rowwise(library: &str, in_gemm: bool, why: impl FnOnce() -> String) {
    static IN_GEMM: AtomicBool = AtomicBool::new(false);
    static PASS: AtomicBool = AtomicBool::new(false);
    let flag = if in_gemm { &IN_GEMM } else { &PASS };
    if flag.swap(true, Ordering::Relaxed) {
        return;
    }
    if in_gemm {
        tracing::info!("fp8 rowwise scales: in {library}'s GEMM (outer-vector scale mode)");
    } else {
        tracing::info!(
            reason = %why(),
            "fp8 rowwise scales: a separate pass after a unit-scale {library} GEMM"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Value of a code computed from the format's definition by a different route (integer
    /// arithmetic on the fields), so `decode` is not checked against itself.
    fn reference_value(code: u8) -> Option<f64> {
        let s = if code >> 7 == 1 { -1.0 } else { 1.0 };
        let e = ((code >> 3) & 15) as i32;
        let m = (code & 7) as i32;
        if e == 15 && m == 7 {
            return None;
        }
        let (int_mant, exp) = if e == 0 {
            (m, -6 - 3)
        } else {
            (8 + m, e - 7 - 3)
        };
        Some(s * int_mant as f64 * 2f64.powi(exp))
    }

    #[test]
    fn all_256_codes_decode_and_round_trip() {
        let mut nans = 0;
        for code in 0..=255u8 {
            match reference_value(code) {
                None => {
                    nans += 1;
                    assert!(decode(code).is_nan(), "code {code:#04x} must be NaN");
                }
                Some(v) => {
                    assert_eq!(decode(code) as f64, v, "code {code:#04x}");
                    let back = encode(decode(code));
                    // +0 and -0 keep their sign; every finite code encodes back to itself.
                    assert_eq!(back, code, "round trip of code {code:#04x} ({v})");
                }
            }
        }
        assert_eq!(nans, 2);
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0xfe), -448.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
    }

    #[test]
    fn encode_is_nearest_with_ties_to_even() {
        // Every midpoint between neighbouring finite positive codes goes to the even code, and
        // points just off the midpoint go to the nearer code.
        for code in 0u8..0x7e {
            let lo = decode(code);
            let hi = decode(code + 1);
            let mid = (lo as f64 + hi as f64) / 2.0;
            let mid32 = mid as f32;
            assert_eq!(mid32 as f64, mid, "midpoint exact in f32");
            let even = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(encode(mid32), even, "tie between {lo} and {hi}");
            assert_eq!(encode(-mid32), 0x80 | even);
            let below = f32::from_bits(mid32.to_bits() - 1);
            let above = f32::from_bits(mid32.to_bits() + 1);
            assert_eq!(encode(below), code, "just below the midpoint of {lo},{hi}");
            assert_eq!(
                encode(above),
                code + 1,
                "just above the midpoint of {lo},{hi}"
            );
        }
    }

    #[test]
    fn encode_saturates_and_keeps_nan() {
        for x in [448.0f32, 449.0, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(x), 0x7e, "{x}");
            assert_eq!(encode(-x), 0xfe, "{}", -x);
        }
        assert_eq!(encode(447.0), 0x7e, "447 rounds to 448");
        assert_eq!(encode(431.0), 0x7d, "431 is nearer 416 than 448");
        assert!(decode(encode(f32::NAN)).is_nan());
        // Below half the smallest subnormal: rounds to zero, sign kept.
        assert_eq!(encode(2f32.powi(-11)), 0x00);
        assert_eq!(encode(-2f32.powi(-11)), 0x80);
        assert_eq!(encode(2f32.powi(-10) * 1.01), 0x01);
    }

    #[test]
    fn scale_rule_maps_amax_to_the_largest_code() {
        let xs = [0.5f32, -3.0, 2.25, 0.0];
        let s = scale_for_amax(amax(&xs));
        assert_eq!(s, 3.0 / 448.0);
        let mut codes = [0u8; 4];
        quantize_into(&xs, s, &mut codes);
        assert_eq!(codes[1], 0xfe);
        let mut back = [0f32; 4];
        dequantize_into(&codes, s, &mut back);
        for (a, b) in xs.iter().zip(back) {
            // Relative step of e4m3 is 2^-3, so the error is at most half of it.
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-6, "{a} vs {b}");
        }
        assert_eq!(scale_for_amax(0.0), MIN_SCALE);
    }
}
