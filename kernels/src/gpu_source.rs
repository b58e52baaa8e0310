//! The GPU kernel sources (`kernels/gpu/*.cu`): one source per module for every vendor, turned
//! into a compilable unit by prepending the vendor header and the shared helpers. No include
//! paths are needed, so NVRTC, hipRTC and clang all see the same text.

/// Which toolchain a unit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vendor {
    Cuda,
    Hip,
}

const CUDA_H: &str = include_str!("../gpu/vendor/cuda.h");
const HIP_H: &str = include_str!("../gpu/vendor/hip.h");
const COMMON: &str = include_str!("../gpu/common.cuh");

/// Every kernel module: name and source.
pub const MODULES: [(&str, &str); 8] = [
    ("elementwise", include_str!("../gpu/elementwise.cu")),
    ("norm", include_str!("../gpu/norm.cu")),
    ("rope", include_str!("../gpu/rope.cu")),
    // The fp8 attention and VSA's TMA fine kernels share the dense kernels' softmax step and
    // rescale (and the fp8 one the split combine).
    (
        "attention",
        concat!(
            include_str!("../gpu/attention.cu"),
            "\n",
            include_str!("../gpu/attention_fp8.cu"),
            "\n",
            include_str!("../gpu/attention_vsa.cu")
        ),
    ),
    ("layout", include_str!("../gpu/layout.cu")),
    ("fp8", include_str!("../gpu/fp8.cu")),
    ("conv", include_str!("../gpu/conv.cu")),
    ("vsa", include_str!("../gpu/vsa.cu")),
];

/// The full compilation unit of `module` for `vendor`.
pub fn unit(vendor: Vendor, module: &str) -> Option<String> {
    let (_, src) = MODULES.iter().find(|(m, _)| *m == module)?;
    let header = match vendor {
        Vendor::Cuda => CUDA_H,
        Vendor::Hip => HIP_H,
    };
    Some(format!("{header}\n{COMMON}\n// ---- {module}.cu\n{src}"))
}
