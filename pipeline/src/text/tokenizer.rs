//! The umT5 tokenizer from the checkpoint's `tokenizer.json` (the `tokenizers` crate), as Wan's
//! `HuggingfaceTokenizer(seq_len=512, clean='whitespace')` calls it: whitespace runs collapsed and
//! the ends trimmed, special tokens added (`</s>`), truncated to `text_len`, padded with the pad id.
//! Not reproduced: upstream's `ftfy.fix_text` and HTML-unescape pre-cleaning (no-ops on plain
//! prompts).

use std::path::Path;

use crate::{Error, Result};

/// A `tokenizer.json` with Wan's sequence length.
pub struct T5Tokenizer {
    inner: tokenizers::Tokenizer,
    text_len: usize,
    pad_id: u32,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "T5Tokenizer(vocab {}, text_len {}, pad {})",
            self.inner.get_vocab_size(true),
            self.text_len,
            self.pad_id
        )
    }
}

fn tok_err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Error {
    Error::Input(format!("tokenizer: {what}: {e}"))
}

impl T5Tokenizer {
    pub fn from_file(path: &Path, text_len: usize) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::File {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Self::new(inner, text_len)
    }

    pub fn from_bytes(bytes: &[u8], text_len: usize) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| tok_err("parse", e))?;
        Self::new(inner, text_len)
    }

    fn new(mut inner: tokenizers::Tokenizer, text_len: usize) -> Result<Self> {
        if text_len == 0 {
            return Err(Error::Config("tokenizer text_len 0".into()));
        }
        // The file's own padding setting is replaced by ours; its pad id is kept.
        let pad_id = inner
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| inner.token_to_id("<pad>"))
            .unwrap_or(0);
        inner.with_padding(None);
        inner
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: text_len,
                ..Default::default()
            }))
            .map_err(|e| tok_err("truncation", e))?;
        Ok(T5Tokenizer {
            inner,
            text_len,
            pad_id,
        })
    }

    /// A tokenizer that needs no file, for the `tiny` text encoder on random weights: the umT5
    /// layout ([`builtin_json`]) over a vocabulary of single characters. It makes prompts reach
    /// the model as distinct ids; it is not umT5's vocabulary.
    pub fn builtin(text_len: usize) -> Result<Self> {
        Self::from_bytes(builtin_json().as_bytes(), text_len)
    }

    pub fn text_len(&self) -> usize {
        self.text_len
    }

    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// `text_len` ids (tokens, `</s>`, then padding) and the count before the padding.
    pub fn encode(&self, text: &str) -> Result<(Vec<u32>, usize)> {
        let clean = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let enc = self
            .inner
            .encode(clean.as_str(), true)
            .map_err(|e| tok_err("encode", e))?;
        let mut ids = enc.get_ids().to_vec();
        let valid = ids.len().min(self.text_len);
        ids.truncate(valid);
        ids.resize(self.text_len, self.pad_id);
        Ok((ids, valid))
    }

    /// Text of `ids`, special tokens (pad, `</s>`) skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| tok_err("decode", e))
    }
}

/// Pieces of [`T5Tokenizer::builtin`] after `<pad>` 0, `</s>` 1, `<unk>` 2 and `▁` 3: ids 4 on.
pub const BUILTIN_PIECES: &str = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-";

/// The `tokenizer.json` of [`T5Tokenizer::builtin`]: umT5's layout (a Unigram model, Metaspace
/// pre-tokenizer, `$A </s>` post-processor) with a lowercasing normalizer and one piece per
/// character of [`BUILTIN_PIECES`]; anything else is `<unk>`.
pub fn builtin_json() -> String {
    let special = |id: u32, content: &str| {
        serde_json::json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        })
    };
    let metaspace = serde_json::json!({
        "type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true
    });
    let mut vocab = vec![
        serde_json::json!(["<pad>", 0.0]),
        serde_json::json!(["</s>", 0.0]),
        serde_json::json!(["<unk>", 0.0]),
        serde_json::json!(["\u{2581}", -2.0]),
    ];
    vocab.extend(
        BUILTIN_PIECES
            .chars()
            .map(|c| serde_json::json!([c.to_string(), -3.0])),
    );
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": {"type": "Lowercase"},
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
