//! The umT5 tokenizer on a small `tokenizer.json` the test writes (the umT5 layout: a Unigram
//! model, Metaspace pre-tokenizer, `$A </s>` post-processor, `<pad>` 0, `</s>` 1, `<unk>` 2), and
//! the per-prompt context cache.

mod common;

use common::CaseDir;
use kernels::DType;
use pipeline::text::{T5Config, T5Encoder, T5Tokenizer, TextConditioner};
use pipeline::WeightStore;

fn special(id: u32, content: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": true
    })
}

fn tiny_tokenizer_json() -> String {
    let metaspace = serde_json::json!({
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true
    });
    let mut vocab = vec![
        serde_json::json!(["<pad>", 0.0]),
        serde_json::json!(["</s>", 0.0]),
        serde_json::json!(["<unk>", 0.0]),
    ];
    for (piece, score) in [
        ("▁", -2.0),
        ("▁a", -3.0),
        ("▁cat", -3.0),
        ("▁sat", -3.0),
        ("▁on", -3.0),
        ("▁the", -3.0),
        ("▁mat", -3.0),
        ("c", -5.0),
        ("a", -5.0),
        ("t", -5.0),
        ("s", -5.0),
        ("m", -5.0),
    ] {
        vocab.push(serde_json::json!([piece, score]));
    }
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": null,
        "pre_tokenizer": metaspace,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "</s>", "type_id": 0}}
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "</s>", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 0}},
                {"SpecialToken": {"id": "</s>", "type_id": 0}}
            ],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}
        },
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": 2, "vocab": vocab, "byte_fallback": false}
    })
    .to_string()
}

fn tiny_tokenizer(text_len: usize) -> (CaseDir, T5Tokenizer) {
    let dir = CaseDir::new("t5-tokenizer");
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, tiny_tokenizer_json()).expect("write tokenizer.json");
    let tok = T5Tokenizer::from_file(&path, text_len).expect("load tokenizer.json");
    (dir, tok)
}

#[test]
fn round_trip_with_padding_and_eos() {
    let (_dir, tok) = tiny_tokenizer(16);
    // Whitespace runs collapse as in Wan's `clean='whitespace'`.
    let (ids, valid) = tok.encode("  a cat\n sat on   the mat ").expect("encode");
    assert_eq!(ids.len(), 16);
    assert_eq!(&ids[..valid], &[4, 5, 6, 7, 8, 9, 1]);
    assert!(ids[valid..].iter().all(|&i| i == tok.pad_id()));
    assert_eq!(tok.pad_id(), 0);
    assert_eq!(tok.decode(&ids).expect("decode"), "a cat sat on the mat");
    // A word outside the whole-word pieces falls back to the characters.
    let (ids, valid) = tok.encode("cats").expect("encode");
    assert_eq!(&ids[..valid], &[5, 13, 1]); // ▁cat, s, </s>
    assert_eq!(tok.decode(&ids).expect("decode"), "cats");
}

#[test]
fn long_prompts_truncate_to_text_len_keeping_eos() {
    let (_dir, tok) = tiny_tokenizer(4);
    let (ids, valid) = tok.encode("a cat sat on the mat").expect("encode");
    assert_eq!(valid, 4);
    assert_eq!(ids, [4, 5, 6, 1]);
}

#[test]
fn bad_tokenizer_json_is_an_error() {
    assert!(T5Tokenizer::from_bytes(b"{not json", 8).is_err());
    let dir = CaseDir::new("t5-tokenizer-missing");
    assert!(T5Tokenizer::from_file(&dir.0.join("none.json"), 8).is_err());
}

#[test]
fn contexts_are_cached_per_prompt() {
    let cfg = T5Config::tiny();
    let (_dir, tok) = tiny_tokenizer(cfg.text_len);
    let enc = T5Encoder::load(&cfg, &WeightStore::random(41, DType::F32)).expect("tiny");
    let (ids, valid) = tok.encode("a cat").expect("encode");
    let direct = enc.encode(&ids, valid).expect("encode");
    let mut text = TextConditioner::new(tok, enc).expect("conditioner");
    let a = text.context("a cat").expect("first");
    let b = text.context("the mat").expect("second");
    let c = text.context("a cat").expect("cached");
    assert_eq!(text.encodes, 2);
    assert_eq!(a.to_vec_f32(), direct.to_vec_f32());
    assert_eq!(a.to_vec_f32(), c.to_vec_f32());
    assert_ne!(a.to_vec_f32(), b.to_vec_f32());
    assert_eq!(a.shape(), &[cfg.text_len, cfg.dim]);
}

#[test]
fn the_builtin_tokenizer_spells_prompts_out_in_characters() {
    let tok = T5Tokenizer::builtin(12).expect("builtin");
    let (ids, valid) = tok.encode("  Cab 9 ").expect("encode");
    // ▁ 3, then a..z from 4, digits after z; upper case folds to lower; </s> ends it.
    assert_eq!(&ids[..valid], &[3, 6, 4, 5, 3, 4 + 26 + 9, 1]);
    assert!(ids[valid..].iter().all(|&i| i == 0));
    assert_eq!(tok.decode(&ids).expect("decode"), "cab 9");
    // A character outside the pieces is <unk>.
    let (ids, valid) = tok.encode("é").expect("encode");
    assert_eq!(&ids[..valid], &[3, 2, 1]);
    assert!(pipeline::text::BUILTIN_PIECES.len() + 4 <= T5Config::tiny().vocab);
}

#[test]
fn the_context_cache_is_bounded_and_counts_hits() {
    let cfg = T5Config::tiny();
    let tok = T5Tokenizer::builtin(cfg.text_len).expect("builtin");
    let enc = T5Encoder::load(&cfg, &WeightStore::random(7, DType::F32)).expect("tiny");
    let mut text = TextConditioner::new(tok, enc).expect("conditioner");
    text.set_capacity(2);
    let a = text.context("a").expect("a").to_vec_f32();
    text.context("b").expect("b");
    assert_eq!(text.context("a").expect("a").to_vec_f32(), a);
    assert_eq!((text.encodes, text.hits), (2, 1));
    // "c" pushes out the least recently used, "b"; "a" stays.
    text.context("c").expect("c");
    assert!(text.is_cached("a") && text.is_cached("c") && !text.is_cached("b"));
    text.context("b").expect("b again");
    assert_eq!((text.encodes, text.hits), (4, 1));
}
