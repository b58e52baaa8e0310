use std::path::PathBuf;

/// Errors of model building, weight loading and the chunk engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kernel(#[from] kernels::Error),

    #[error("weights: key '{key}' is missing (expected shape {expected:?})")]
    MissingKey { key: String, expected: Vec<usize> },

    #[error("weights: key '{key}' has shape {found:?}, expected {expected:?}")]
    WrongShape {
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("weights: {} unexpected key(s) the model does not use: {}", .keys.len(), .keys.join(", "))]
    UnexpectedKeys { keys: Vec<String> },

    #[error("weights: key '{key}' in {path}: {msg}")]
    BadTensor {
        key: String,
        path: PathBuf,
        msg: String,
    },

    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },

    #[error("sequence parallel: {0}")]
    Parallel(#[from] sp::Error),

    #[error("config: {0}")]
    Config(String),

    #[error("input: {0}")]
    Input(String),
}

pub type Result<T> = std::result::Result<T, Error>;
