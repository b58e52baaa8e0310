//! FLOPs of the DiT's matrix work (2 per multiply-add), for benchmarks: linears and attention
//! products. Norms, activations and modulation are O(tokens·dim) and left out.

use crate::config::ModelConfig;

pub fn linear(rows: usize, k: usize, n: usize) -> f64 {
    2.0 * rows as f64 * k as f64 * n as f64
}

/// `QKᵀ` and `PV` for `q` queries over `kv` keys across all heads.
pub fn attention(q: usize, kv: usize, dim: usize) -> f64 {
    4.0 * q as f64 * kv as f64 * dim as f64
}

/// One block forward over `tokens` queries attending `kv` self-attention keys, with cached text
/// K/V and cached camera scale/shift.
pub fn block(cfg: &ModelConfig, tokens: usize, kv: usize) -> f64 {
    let d = cfg.dim;
    4.0 * linear(tokens, d, d)          // self-attention q, k, v, o
        + attention(tokens, kv, d)
        + 2.0 * linear(tokens, d, d)    // cross-attention q, o
        + attention(tokens, cfg.text_len, d)
        + linear(tokens, d, cfg.ffn_dim)
        + linear(tokens, cfg.ffn_dim, d)
}

/// One model forward (patch embedding, blocks, head).
pub fn forward(cfg: &ModelConfig, tokens: usize, kv: usize) -> f64 {
    let p: usize = cfg.patch.iter().product();
    linear(tokens, cfg.in_dim * p, cfg.dim)
        + cfg.num_layers as f64 * block(cfg, tokens, kv)
        + linear(tokens, cfg.dim, p * cfg.out_dim)
}

/// The clean-context refresh: every block but the last in full, then the last block's K/V.
pub fn refresh(cfg: &ModelConfig, tokens: usize, kv: usize) -> f64 {
    let p: usize = cfg.patch.iter().product();
    linear(tokens, cfg.in_dim * p, cfg.dim)
        + cfg.num_layers.saturating_sub(1) as f64 * block(cfg, tokens, kv)
        + 2.0 * linear(tokens, cfg.dim, cfg.dim)
}

/// The per-chunk camera condition: embedding, its MLP, and each block's four camera linears.
pub fn camera(cfg: &ModelConfig, tokens: usize) -> f64 {
    let Some(c) = cfg.control_dim else { return 0.0 };
    let p: usize = cfg.patch.iter().product();
    let d = cfg.dim;
    linear(tokens, c * 64 * p, d)
        + 2.0 * linear(tokens, d, d)
        + cfg.num_layers as f64 * 4.0 * linear(tokens, d, d)
}

/// A whole chunk: camera condition, `steps` forwards and the refresh.
pub fn chunk(cfg: &ModelConfig, tokens: usize, kv: usize, steps: usize) -> f64 {
    camera(cfg, tokens) + steps as f64 * forward(cfg, tokens, kv) + refresh(cfg, tokens, kv)
}
