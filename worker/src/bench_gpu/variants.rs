//! An attention kernel variant (dense or VSA) against the default, timed in turn. Rows timed
//! one after the other inherit the clock the row before left the card at (its power cap acts
//! within tens of milliseconds), so a variant a few percent apart from the default is only seen
//! when both take rounds in turn and their sustained runs alternate.

use std::time::Duration;

use anyhow::Result;
use kernels::cuda::ops::{FlashKernel, Schedule};
use kernels::{ops, AttnMask, Device};
use pipeline::flops;

use super::{rand_qkv, round, sustained, with_env, Round};

/// The default before 2026-12-06: the queries read from shared memory at every product (the
/// default holds them in registers), and so no persistent blocks.
pub(super) fn q_shared() -> String {
    FlashKernel::Tma {
        bc: 128,
        stages: 3,
        schedule: Schedule::Auto,
        q_regs: false,
    }
    .tag()
}

/// The default's kernel with a block per item, each whole: against the default's persistent
/// blocks on items of few key tiles.
fn whole() -> String {
    FlashKernel::Tma {
        bc: 128,
        stages: 3,
        schedule: Schedule::Whole,
        q_regs: true,
    }
    .tag()
}

/// `f` through the default kernel and through `WORLDLINE_FLASH=tag`: see [`ab`].
pub(super) fn flash_ab(
    dev: Device,
    heavy: usize,
    what: &str,
    tag: &str,
    flop: f64,
    push: &mut impl FnMut(String, Duration, f64),
    f: impl FnMut() -> Result<()>,
) -> Result<()> {
    ab(dev, heavy, what, ("WORLDLINE_FLASH", tag), flop, push, f)
}

/// `f` through the default kernel and with the kernel switch `var` set to `tag`: `heavy` rounds of each
/// in turn, then each sustained for two seconds, twice in turn. Prints the ratios and pushes
/// the variant's rows (the default's are the caller's own rows).
pub(super) fn ab(
    dev: Device,
    heavy: usize,
    what: &str,
    (var, tag): (&str, &str),
    flop: f64,
    push: &mut impl FnMut(String, Duration, f64),
    mut f: impl FnMut() -> Result<()>,
) -> Result<()> {
    f()?;
    with_env(var, tag, &mut f)?;
    dev.synchronize()?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..heavy {
        a.push(round(dev, 1, &mut f)?);
        b.push(with_env(var, tag, || round(dev, 1, &mut f))?);
    }
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        sa.push(sustained(dev, &mut f)?.0);
        sb.push(with_env(var, tag, || sustained(dev, &mut f))?.0);
    }
    let (ba, ma) = best_median(&a);
    let (bb, mb) = best_median(&b);
    let (ta, tb) = (mean(&sa), mean(&sb));
    let ms = |t: Duration| t.as_secs_f64() * 1e3;
    let x = |d: Duration, v: Duration| d.as_secs_f64() / v.as_secs_f64();
    println!(
        "{what}, {tag} against the default in turn ({heavy} rounds each; times default / {tag}, \
         ratio default ÷ {tag}: above 1, {tag} is faster): best {:.3} / {:.3} ms ({:.3}x), \
         median {:.3} / {:.3} ({:.3}x), sustained {:.3} / {:.3} ({:.3}x; runs {:.3}, {:.3} / \
         {:.3}, {:.3})",
        ms(ba),
        ms(bb),
        x(ba, bb),
        ms(ma),
        ms(mb),
        x(ma, mb),
        ms(ta),
        ms(tb),
        x(ta, tb),
        ms(sa[0]),
        ms(sa[1]),
        ms(sb[0]),
        ms(sb[1]),
    );
    push(
        format!("{what}, {tag} (in turn with the default)"),
        bb,
        flop,
    );
    push(format!("{what}, {tag}, sustained (in turn)"), tb, flop);
    Ok(())
}

fn best_median(rounds: &[Round]) -> (Duration, Duration) {
    let mut t: Vec<Duration> = rounds.iter().map(|r| r.device).collect();
    t.sort();
    match (t.first(), t.get(t.len() / 2)) {
        (Some(&b), Some(&m)) => (b, m),
        _ => (Duration::MAX, Duration::MAX),
    }
}

fn mean(t: &[Duration]) -> Duration {
    t.iter().sum::<Duration>() / t.len().max(1) as u32
}

/// The self-attention of a chunk over the 18-frame window (4680 queries, 28080 keys) at
/// lingbot-14b's 40 heads and lingbot-1.3b's 12, the default against [`q_shared`].
pub(super) fn attention_ab(
    dev: Device,
    heavy: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    let (lq, lk, d) = (4680, 28080, 128);
    for heads in [40, 12] {
        let [q, k, v] = rand_qkv(dev, 3, lq, lk, heads, d)?;
        flash_ab(
            dev,
            heavy,
            &format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}"),
            &q_shared(),
            flops::attention(lq, lk, heads * d),
            push,
            || {
                ops::attention(&q, &k, &v, lk, AttnMask::None)?;
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// The text cross-attention (a chunk's 4680 queries over 512 text tokens: four key tiles an
/// item), the default's persistent blocks against a block per item.
pub(super) fn cross_ab(
    dev: Device,
    heavy: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    let (lq, text, d) = (4680, 512, 128);
    for heads in [40, 12] {
        let [q, k, v] = rand_qkv(dev, 41, lq, text, heads, d)?;
        flash_ab(
            dev,
            heavy,
            &format!("attention bf16 {lq}q x {text}k x {heads}h x {d} (text cross)"),
            &whole(),
            flops::attention(lq, text, heads * d),
            push,
            || {
                ops::attention(&q, &k, &v, text, AttnMask::None)?;
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// The fine kernel's variants `vsa_ab` times against the default unless
/// `WORLDLINE_BENCH_VSA_AB` names others (a comma list of `WORLDLINE_VSA_FINE` values, or of
/// `VAR=value` for another switch): every tile in a whole box (the default until 2026-12-06).
const VSA_AB: &str = "persist";

/// VSA at sparsity 0.9 in the model's form (select-only, key means from a cache's frame sums) at
/// a 3-frame chunk over the 18-frame window and a 4-frame one over 20, 40 heads: the fine
/// kernel's default (the window's edge tiles loaded in boxes of 32 tokens) against each variant
/// of `VSA_AB`.
pub(super) fn vsa_ab(
    dev: Device,
    heavy: usize,
    push: &mut impl FnMut(String, Duration, f64),
) -> Result<()> {
    let (heads, d) = (40, 128);
    let list = std::env::var("WORLDLINE_BENCH_VSA_AB").unwrap_or_else(|_| VSA_AB.into());
    for (q_grid, k_grid) in [([3, 30, 52], [18, 30, 52]), ([4, 30, 52], [20, 30, 52])] {
        let (lq, lk): (usize, usize) = (q_grid.iter().product(), k_grid.iter().product());
        let [q, k, v] = rand_qkv(dev, 3, lq, lk, heads, d)?;
        let ks = kernels::vsa::frame_sums(&k, 0, k_grid)?;
        let top_k = kernels::vsa::top_k(0.9, kernels::vsa::tiles(k_grid, kernels::vsa::TILE));
        for tag in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            ab(
                dev,
                heavy,
                &format!(
                    "vsa bf16 sparsity 0.9 select-only from key sums {lq}q x {lk}k x {heads}h x {d}"
                ),
                tag.split_once('=').unwrap_or(("WORLDLINE_VSA_FINE", tag)),
                0.0,
                push,
                || {
                    let sums = kernels::vsa::KeySums {
                        k: &ks,
                        v: None,
                        q: None,
                    };
                    let only = kernels::vsa::Coarse::SelectOnly;
                    kernels::vsa::attention_cached(&q, &k, &v, sums, only, q_grid, k_grid, top_k)?;
                    Ok(())
                },
            )?;
        }
    }
    Ok(())
}
