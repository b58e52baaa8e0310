//! The CPU reference backend: plain Rust over f32 slices (f64 where the upstream model computes
//! in f64), rows in parallel with rayon, matrix products through the `gemm` crate.
//!
//! Every function here keeps a fixed order of summation per output element whatever the thread
//! count, so results are bit-identical across runs and machines' core counts.

pub mod attention;
pub mod conv;
pub mod linear;
pub mod norm;
pub mod rope;
