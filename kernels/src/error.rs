use crate::DType;

/// Errors of the tensor layer. Each names the op and the shapes or dtypes it was given, so a
/// failure deep inside a model forward still says what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {msg}")]
    Shape { op: &'static str, msg: String },

    #[error("{op}: dtype {got:?} is not supported here ({msg})")]
    DType {
        op: &'static str,
        got: DType,
        msg: &'static str,
    },

    #[error("{op}: tensors live on different devices ({a} and {b})")]
    DeviceMismatch {
        op: &'static str,
        a: String,
        b: String,
    },

    #[error("device {device}: {msg}")]
    Device { device: String, msg: String },

    #[error("{op}: {msg}")]
    Invalid { op: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn shape_err(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape {
        op,
        msg: msg.into(),
    }
}
