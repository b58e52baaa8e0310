//! G1: one forward of the official Wan2.1 DiT (see tests/data/golden/README.md). Our DiT, built
//! with G1's config and loading its weights by the official names, must reproduce the output and
//! every intermediate within 1e-5 of that tensor's largest magnitude, in f32 on the CPU.

use std::collections::HashMap;
use std::path::PathBuf;

use kernels::{DType, Tensor};
use pipeline::model::Attn;
use pipeline::{ModelConfig, WanModel, WeightStore};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/golden")
        .join(name)
}

/// The f32 tensors of a safetensors file (other dtypes skipped).
fn read_f32(path: &PathBuf) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("golden file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    st.tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == safetensors::Dtype::F32)
        .map(|(k, v)| {
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (k, (v.shape().to_vec(), vals))
        })
        .collect()
}

fn g1_config() -> ModelConfig {
    let text = std::fs::read_to_string(data("g1_config.json")).expect("g1_config.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let m = &json["model_config"];
    let u = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
    ModelConfig {
        name: "g1".into(),
        dim: u("dim"),
        ffn_dim: u("ffn_dim"),
        num_heads: u("num_heads"),
        num_layers: u("num_layers"),
        in_dim: u("in_dim"),
        out_dim: u("out_dim"),
        text_dim: u("text_dim"),
        text_len: u("text_len"),
        freq_dim: u("freq_dim"),
        eps: m["eps"].as_f64().expect("eps") as f32,
        patch: [1, 2, 2],
        control_dim: None,
    }
}

#[test]
fn g1_forward_matches_the_official_wan21_code() {
    let cfg = g1_config();
    let store =
        WeightStore::open(&data("g1_weights.safetensors"), DType::F32).expect("open weights");
    let model = WanModel::load(&cfg, &store).expect("every G1 key used, shapes as expected");
    let io = read_f32(&data("g1_io.safetensors"));
    let tensor = |k: &str| {
        let (shape, v) = &io[k];
        Tensor::from_vec(v.clone(), shape).expect("tensor")
    };

    let mut got: HashMap<String, Vec<f32>> = HashMap::new();
    let mut record = |name: &str, t: &Tensor| {
        got.insert(name.to_string(), t.to_vec_f32());
    };
    let text = model
        .encode_text(&tensor("context"), Some(&mut record))
        .expect("text");
    let out = model
        .forward(
            &tensor("x"),
            500.0,
            0,
            &text,
            None,
            Attn::Full,
            Some(&mut record),
        )
        .expect("forward")
        .expect("output");
    got.insert("out".into(), out.to_vec_f32());

    // Our patch embedding is token-major [L, dim]; upstream's is [1, dim, F, H, W].
    let pe = &got["patch_embedding"];
    let (l, dim) = (pe.len() / cfg.dim, cfg.dim);
    let mut pe_t = vec![0f32; pe.len()];
    for i in 0..l {
        for d in 0..dim {
            pe_t[d * l + i] = pe[i * dim + d];
        }
    }
    got.insert("patch_embedding".into(), pe_t);

    let pairs = [
        ("dbg.patch_embedding", "patch_embedding"),
        ("dbg.text_embedding", "text_embedding"),
        ("dbg.time_embedding", "time_embedding"),
        ("dbg.time_projection", "time_projection"),
        ("dbg.block0", "block0"),
        ("dbg.block1", "block1"),
        ("dbg.head", "head"),
        ("out", "out"),
    ];
    let mut report = Vec::new();
    for (golden, ours) in pairs {
        let (_, want) = &io[golden];
        let have = &got[ours];
        assert_eq!(want.len(), have.len(), "{ours}: element count");
        let amax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = want
            .iter()
            .zip(have)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            have.iter().all(|v| v.is_finite()),
            "{ours}: non-finite values"
        );
        report.push(format!(
            "{ours}: max |diff| {err:.3e} of max |ref| {amax:.3e}"
        ));
        assert!(
            err <= 1e-5 * amax,
            "{ours} differs from {golden}: {}",
            report.join("\n")
        );
    }
    println!("{}", report.join("\n"));
}
