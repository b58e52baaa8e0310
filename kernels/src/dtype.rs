/// Element types a tensor can be stored in. Math on the CPU reference is always f32 (f64 where
/// the upstream model uses it); these are storage formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// fp8 e4m3fn codes with an f32 scale per tensor or per row (see [`Fp8Scale`]).
    F8E4M3,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            "fp8" | "f8e4m3" => Ok(DType::F8E4M3),
            _ => Err(format!(
                "unknown dtype '{s}' (expected f32, bf16, f16 or fp8)"
            )),
        }
    }
}

/// How an fp8 tensor's codes map back to real values.
#[derive(Clone, Debug, PartialEq)]
pub enum Fp8Scale {
    /// One scale for the whole tensor.
    Tensor(f32),
    /// One scale per row, a row being the last dimension: per token for activations, per output
    /// channel for a `[out, in]` weight.
    Rows(Vec<f32>),
}

/// The granularity asked of a quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleKind {
    Tensorwise,
    Rowwise,
}
