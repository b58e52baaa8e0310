//! The umT5 encoder against an independent NumPy implementation (`tests/ref/t5_ref.py`, written
//! from the architecture facts, f64, the full masked pass over padded ids) on `tiny` random
//! weights under the official names; the bucket function against hand-computed values; the
//! `umt5-xxl` key table without allocating the model. Needs `python3` with `numpy` and
//! `safetensors` (`WORLDLINE_PYTHON` picks another interpreter).

mod common;

use common::{assert_close, random, CaseDir};
use kernels::DType;
use pipeline::text::{relative_position_bucket, T5Block, T5Config, T5Encoder};
use pipeline::WeightStore;

fn config_json(cfg: &T5Config, case: &str) -> serde_json::Value {
    let mut json = serde_json::to_value(cfg).expect("config json");
    json["case"] = case.into();
    json
}

#[test]
fn block_matches_numpy() {
    let dir = CaseDir::new("t5-block");
    let cfg = T5Config::tiny();
    let store = WeightStore::random(31, DType::F32);
    let block = T5Block::load(&store.root().pp("blk"), &cfg).expect("block");
    let x = random(32, &[7, cfg.dim]);
    // Two padded positions at the end: masked as keys, still computed as queries.
    let y = block.forward(&x, 5).expect("forward");
    let mut case = config_json(&cfg, "block");
    case["prefix"] = "blk".into();
    case["mask_len"] = 5.into();
    let reference = common::run_reference("t5_ref.py", &dir.0, case, &store, &[("x", &x)]);
    assert_close("T5 block (5 of 7 valid)", &y, &reference, "block");
}

#[test]
fn encoder_matches_numpy() {
    let dir = CaseDir::new("t5-encoder");
    let cfg = T5Config::tiny();
    let store = WeightStore::random(33, DType::F32);
    let enc = T5Encoder::load(&cfg, &store).expect("tiny");
    store.check_all_used().expect("all used");
    // 9 tokens then padding id 0 up to text_len, as the tokenizer hands them over.
    let mut ids: Vec<u32> = vec![5, 17, 3, 60, 22, 41, 9, 1, 63];
    let valid = ids.len();
    ids.resize(cfg.text_len, 0);
    let hidden = enc.forward(&ids, valid).expect("masked pass");
    let context = enc.encode(&ids, valid).expect("encode");
    assert_eq!(context.shape(), &[cfg.text_len, cfg.dim]);
    let ids_f: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    let ids_t = kernels::Tensor::from_vec(ids_f, &[ids.len()]).expect("ids");
    let mut case = config_json(&cfg, "encoder");
    case["mask_len"] = valid.into();
    let reference = common::run_reference("t5_ref.py", &dir.0, case, &store, &[("ids", &ids_t)]);
    assert_close(
        "tiny encoder, masked padded pass",
        &hidden,
        &reference,
        "hidden",
    );
    assert_close("tiny encoder, Wan context", &context, &reference, "context");
    let ctx = context.to_vec_f32();
    assert!(ctx[valid * cfg.dim..].iter().all(|&v| v == 0.0));
}

#[test]
fn bucket_matches_hand_computed_values() {
    // (|rel|, bucket for rel ≤ 0, bucket for rel > 0) with 32 buckets, max distance 128:
    // exact below 8, then 8 + floor(ln(r/8) / ln(16) · 8) capped at 15 (+16 for rel > 0).
    let cases = [
        (0, 0, 0),
        (1, 1, 17),
        (7, 7, 23),
        (8, 8, 24),
        (11, 8, 24),
        (12, 9, 25),  // ln 1.5 / ln 16 · 8 = 1.17
        (16, 10, 26), // exactly 2
        (31, 11, 27),
        (32, 12, 28),  // exactly 4
        (63, 13, 29),  // 5.95
        (64, 14, 30),  // exactly 6
        (100, 15, 31), // 7.29
        (127, 15, 31),
        (128, 15, 31), // 8, capped
        (1000, 15, 31),
    ];
    for (r, neg, pos) in cases {
        if r > 0 {
            assert_eq!(relative_position_bucket(r, 32, 128), pos, "rel +{r}");
        }
        assert_eq!(relative_position_bucket(-r, 32, 128), neg, "rel -{r}");
    }
}

#[test]
fn umt5_xxl_key_table() {
    let cfg = T5Config::umt5_xxl();
    let table = cfg.weight_shapes();
    assert_eq!(table.len(), 2 + 24 * 10);
    let shape = |k: &str| {
        table
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| panic!("no key {k}"))
    };
    assert_eq!(shape("token_embedding.weight"), [256_384, 4096]);
    assert_eq!(shape("blocks.0.attn.q.weight"), [4096, 4096]);
    assert_eq!(shape("blocks.23.attn.o.weight"), [4096, 4096]);
    assert_eq!(shape("blocks.5.ffn.gate.0.weight"), [10_240, 4096]);
    assert_eq!(shape("blocks.5.ffn.fc1.weight"), [10_240, 4096]);
    assert_eq!(shape("blocks.5.ffn.fc2.weight"), [4096, 10_240]);
    assert_eq!(shape("blocks.23.pos_embedding.embedding.weight"), [32, 64]);
    assert_eq!(shape("blocks.0.norm1.weight"), [4096]);
    assert_eq!(shape("norm.weight"), [4096]);
    // 256384·4096 + 24·(4·4096² + 3·4096·10240 + 2·4096 + 32·64) + 4096.
    assert_eq!(cfg.num_params(), 5_680_910_336);
}

#[test]
fn loader_asks_for_exactly_the_key_table() {
    let cfg = T5Config::tiny();
    let store = WeightStore::random(34, DType::F32);
    T5Encoder::load(&cfg, &store).expect("tiny");
    let mut asked = store.loaded_shapes().expect("shapes");
    let mut table = cfg.weight_shapes();
    asked.sort();
    table.sort();
    assert_eq!(asked, table);
}

#[test]
fn umt5_xxl_loader_fails_on_the_first_missing_key() {
    // A checkpoint without the model's keys: the loader stops at the first one, before
    // allocating anything of the 5.7B parameters.
    let dir = CaseDir::new("t5-empty");
    let path = dir.0.join("empty.safetensors");
    let other = random(35, &[2]);
    pipeline::weights::save_safetensors(&path, &[("unrelated".to_string(), &other)]).expect("save");
    let store = WeightStore::open(&path, DType::BF16).expect("open");
    let err = T5Encoder::load(&T5Config::umt5_xxl(), &store)
        .expect_err("no weights")
        .to_string();
    assert!(
        err.contains("token_embedding.weight") && err.contains("[256384, 4096]"),
        "{err}"
    );
}

#[test]
fn encode_rejects_bad_inputs() {
    let cfg = T5Config::tiny();
    let enc = T5Encoder::load(&cfg, &WeightStore::random(36, DType::F32)).expect("tiny");
    assert!(enc.encode(&[1, 2], 3).is_err());
    assert!(enc.encode(&[cfg.vocab as u32], 1).is_err());
    let empty = enc.encode(&[], 0).expect("empty prompt");
    assert!(empty.to_vec_f32().iter().all(|&v| v == 0.0));
}
