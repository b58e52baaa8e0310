//! Weight loading: official-layout checkpoints (one file, shards with an index, bf16 storage)
//! must reproduce the model the weights came from exactly, and every way a checkpoint can be
//! wrong must fail with an error that says what and where.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kernels::{DType, Tensor};
use pipeline::camera::Controls;
use pipeline::weights::save_safetensors;
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

const SEED: u64 = 11;

/// A directory under the system temp dir, removed on drop (also when the test panics).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "worldline-loading-{}-{tag}-{n}",
            std::process::id()
        ));
        // A leftover from a crashed run with the same pid must not leak into this one.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The random tiny model and every tensor it loaded, by checkpoint name.
fn random_tiny() -> (WanModel, Vec<(String, Tensor)>) {
    let store = WeightStore::random(SEED, DType::F32);
    let model = WanModel::load(&ModelConfig::tiny(), &store).expect("random tiny model");
    let tensors = store.loaded_tensors().expect("loaded tensors");
    (model, tensors)
}

fn save(path: &Path, tensors: &[(String, Tensor)]) {
    let refs: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    save_safetensors(path, &refs).expect("save safetensors");
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|x| x.to_bits()).collect()
}

/// Both stores hold the same keys with the same shape, dtype and bits.
fn assert_same_tensors(what: &str, got: &[(String, Tensor)], want: &[(String, Tensor)]) {
    let got: BTreeMap<_, _> = got.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let want: BTreeMap<_, _> = want.iter().map(|(k, t)| (k.as_str(), t)).collect();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: key sets differ"
    );
    for (k, w) in &want {
        let g = got[k];
        assert_eq!(g.shape(), w.shape(), "{what}: shape of {k}");
        assert_eq!(g.dtype(), w.dtype(), "{what}: dtype of {k}");
        assert!(bits(g) == bits(w), "{what}: values of {k} differ");
    }
}

fn load(path: &Path, dtype: DType) -> (WanModel, Vec<(String, Tensor)>) {
    let store = WeightStore::open(path, dtype).expect("open checkpoint");
    assert!(!store.is_random());
    let model = WanModel::load(&ModelConfig::tiny(), &store).expect("load checkpoint");
    let tensors = store.loaded_tensors().expect("loaded tensors");
    (model, tensors)
}

/// Latents of a few chunks, as bits: window and sink small enough that chunk 2 evicts, so the
/// comparison covers every weight on the cached path.
fn engine_bits(model: WanModel) -> Vec<Vec<u32>> {
    let cfg = EngineConfig {
        height: 32,
        width: 32,
        chunk_frames: 2,
        window_frames: 5,
        sink_frames: 1,
        ..EngineConfig::tiny(3)
    };
    let mut engine = Engine::new(Arc::new(model), cfg).expect("engine");
    let controls = Controls {
        w: true,
        d: true,
        ..Default::default()
    };
    (0..3)
        .map(|_| {
            let c = engine.next_chunk(&ChunkInputs { controls }).expect("chunk");
            bits(&c.latents)
        })
        .collect()
}

#[test]
fn single_file_checkpoint_reproduces_the_model_bit_for_bit() {
    let (model, tensors) = random_tiny();
    let dir = TempDir::new("single");
    let path = dir.path("model.safetensors");
    save(&path, &tensors);

    let (loaded, loaded_tensors) = load(&path, DType::F32);
    assert_same_tensors("single file", &loaded_tensors, &tensors);
    // Same tensors do not prove the model put each one in the right place; a forward does.
    assert_eq!(engine_bits(loaded), engine_bits(model));
}

#[test]
fn sharded_checkpoint_loads_by_index_and_by_folder() {
    let (_, tensors) = random_tiny();
    let dir = TempDir::new("shards");
    let names = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ];
    // Interleave keys so every shard holds parts of several blocks, as real shards do.
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); 3];
    let mut weight_map = serde_json::Map::new();
    for (i, (k, t)) in tensors.iter().enumerate() {
        shards[i % 3].push((k.clone(), t.clone()));
        weight_map.insert(k.clone(), names[i % 3].into());
    }
    for (name, shard) in names.iter().zip(&shards) {
        assert!(!shard.is_empty());
        save(&dir.path(name), shard);
    }
    let index = dir.path("model.safetensors.index.json");
    let json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(&index, json.to_string()).expect("write index");

    let store = WeightStore::open(&index, DType::F32).expect("open index");
    assert!(
        store.describe().starts_with("3 shards"),
        "{}",
        store.describe()
    );
    let (_, by_index) = load(&index, DType::F32);
    assert_same_tensors("index", &by_index, &tensors);
    let (_, by_folder) = load(&dir.0, DType::F32);
    assert_same_tensors("folder", &by_folder, &tensors);
}

#[test]
fn bf16_checkpoint_loads_into_f32_and_bf16_runs_as_the_rounded_values() {
    let (_, tensors) = random_tiny();
    let rounded: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.to_dtype(DType::BF16).expect("to bf16")))
        .collect();
    // Without a value that bf16 changes, the checks below could not tell rounding from none.
    let changed = tensors
        .iter()
        .zip(&rounded)
        .filter(|((_, a), (_, b))| bits(a) != bits(b))
        .count();
    assert!(changed > tensors.len() / 2, "{changed} tensors changed");

    let dir = TempDir::new("bf16");
    let path = dir.path("model.safetensors");
    save(&path, &rounded);

    let (_, f32_run) = load(&path, DType::F32);
    let as_f32: Vec<(String, Tensor)> = rounded
        .iter()
        .map(|(k, t)| (k.clone(), t.to_dtype(DType::F32).expect("to f32")))
        .collect();
    assert_same_tensors("bf16 file, f32 run", &f32_run, &as_f32);

    let (_, bf16_run) = load(&path, DType::BF16);
    // A bf16 run keeps matrices in bf16 but vectors, modulation tables and the time path in f32;
    // the random store in bf16 applies the same rule, so it gives the dtype each key must have.
    let reference = WeightStore::random(SEED, DType::BF16);
    WanModel::load(&ModelConfig::tiny(), &reference).expect("random bf16 model");
    let reference: BTreeMap<String, DType> = reference
        .loaded_tensors()
        .expect("loaded tensors")
        .into_iter()
        .map(|(k, t)| (k, t.dtype()))
        .collect();
    let want: BTreeMap<&str, &Tensor> = as_f32.iter().map(|(k, t)| (k.as_str(), t)).collect();
    assert_eq!(bf16_run.len(), want.len());
    for (k, t) in &bf16_run {
        assert_eq!(t.dtype(), reference[k], "{k}: dtype in a bf16 run");
        assert!(
            bits(t) == bits(want[k.as_str()]),
            "{k}: not the bf16-rounded original"
        );
    }
    let dtypes: Vec<DType> = [
        "blocks.0.self_attn.q.weight",
        "time_embedding.0.weight",
        "blocks.0.modulation",
        "blocks.0.self_attn.q.bias",
    ]
    .iter()
    .map(|k| reference[*k])
    .collect();
    assert_eq!(dtypes, [DType::BF16, DType::F32, DType::F32, DType::F32]);
}

/// Display string of the error from opening and loading `tensors` saved as one file.
fn load_error(tag: &str, tensors: &[(String, Tensor)]) -> String {
    let dir = TempDir::new(tag);
    let path = dir.path("model.safetensors");
    save(&path, tensors);
    let store = WeightStore::open(&path, DType::F32).expect("open");
    WanModel::load(&ModelConfig::tiny(), &store)
        .expect_err("loading must fail")
        .to_string()
}

#[test]
fn missing_wrong_shaped_and_extra_keys_fail_naming_the_key() {
    let (_, tensors) = random_tiny();

    let missing: Vec<_> = tensors
        .iter()
        .filter(|(k, _)| k != "blocks.1.ffn.0.weight")
        .cloned()
        .collect();
    let msg = load_error("missing", &missing);
    assert!(
        msg.contains("'blocks.1.ffn.0.weight'") && msg.contains("missing"),
        "{msg}"
    );
    assert!(msg.contains("[256, 128]"), "expected shape: {msg}");

    // Transposed: the element count matches, so only the shape check can catch it.
    let mut wrong = tensors.clone();
    let head = wrong
        .iter_mut()
        .find(|(k, _)| k == "head.head.weight")
        .expect("head.head.weight");
    assert_eq!(head.1.shape(), [64, 128]);
    head.1 = head.1.reshape(&[128, 64]).expect("reshape");
    let msg = load_error("wrong-shape", &wrong);
    assert!(msg.contains("'head.head.weight'"), "{msg}");
    assert!(
        msg.contains("has shape [128, 64], expected [64, 128]"),
        "found and expected shapes: {msg}"
    );

    // A diffusers-style name next to the official ones: silently ignoring it would hide a
    // checkpoint of the wrong layout.
    let mut extra = tensors.clone();
    extra.push((
        "blocks.0.norm2.weight".into(),
        Tensor::zeros(&[128], DType::F32).expect("zeros"),
    ));
    let msg = load_error("extra", &extra);
    assert!(
        msg.contains("1 unexpected key(s)") && msg.contains("blocks.0.norm2.weight"),
        "{msg}"
    );
}

#[test]
fn corrupt_or_absent_files_fail_naming_the_path() {
    let (_, tensors) = random_tiny();
    let dir = TempDir::new("corrupt");
    let path = dir.path("model.safetensors");
    save(&path, &tensors);
    let bytes = std::fs::read(&path).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;

    let open_err = |p: &Path| {
        WeightStore::open(p, DType::F32)
            .and_then(|s| WanModel::load(&ModelConfig::tiny(), &s))
            .expect_err("must fail")
            .to_string()
    };
    // Cut inside the data (a download that stopped) and inside the header.
    for (tag, keep) in [("data", bytes.len() - 100), ("header", 8 + header_len / 2)] {
        let cut = dir.path(&format!("cut-{tag}.safetensors"));
        std::fs::write(&cut, &bytes[..keep]).expect("write");
        let msg = open_err(&cut);
        assert!(
            msg.contains(&cut.display().to_string()),
            "{tag}: path missing from: {msg}"
        );
        assert!(msg.contains("not a valid safetensors file"), "{tag}: {msg}");
    }

    let absent = dir.path("absent.safetensors");
    let msg = open_err(&absent);
    assert!(msg.contains(&absent.display().to_string()), "{msg}");

    // A folder with two candidate files is ambiguous, not "whichever comes first".
    let msg = open_err(&dir.0);
    assert!(
        msg.contains(&dir.0.display().to_string()) && msg.contains("exactly one"),
        "{msg}"
    );
}

/// The checkpoint keys and shapes of a Wan/LingBot model, written from MODELS.md §3
/// independently of the loader.
fn expected_keys(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let (d, f) = (cfg.dim, cfg.ffn_dim);
    let [pt, ph, pw] = cfg.patch;
    let mut m = BTreeMap::new();
    let mut lin = |name: String, i: usize, o: usize| {
        m.insert(format!("{name}.weight"), vec![o, i]);
        m.insert(format!("{name}.bias"), vec![o]);
    };
    lin("text_embedding.0".into(), cfg.text_dim, d);
    lin("text_embedding.2".into(), d, d);
    lin("time_embedding.0".into(), cfg.freq_dim, d);
    lin("time_embedding.2".into(), d, d);
    lin("time_projection.1".into(), d, 6 * d);
    lin("head.head".into(), d, pt * ph * pw * cfg.out_dim);
    for n in 0..cfg.num_layers {
        let b = format!("blocks.{n}");
        for attn in ["self_attn", "cross_attn"] {
            for p in ["q", "k", "v", "o"] {
                lin(format!("{b}.{attn}.{p}"), d, d);
            }
        }
        lin(format!("{b}.ffn.0"), d, f);
        lin(format!("{b}.ffn.2"), f, d);
        if cfg.control_dim.is_some() {
            for l in [
                "cam_injector_layer1",
                "cam_injector_layer2",
                "cam_scale_layer",
                "cam_shift_layer",
            ] {
                lin(format!("{b}.{l}"), d, d);
            }
        }
    }
    if let Some(c) = cfg.control_dim {
        lin(
            "patch_embedding_wancamctrl".into(),
            c * 64 * pt * ph * pw,
            d,
        );
        lin("c2ws_hidden_states_layer1".into(), d, d);
        lin("c2ws_hidden_states_layer2".into(), d, d);
    }
    m.insert(
        "patch_embedding.weight".into(),
        vec![d, cfg.in_dim, pt, ph, pw],
    );
    m.insert("patch_embedding.bias".into(), vec![d]);
    m.insert("head.modulation".into(), vec![1, 2, d]);
    for n in 0..cfg.num_layers {
        let b = format!("blocks.{n}");
        m.insert(format!("{b}.modulation"), vec![1, 6, d]);
        for attn in ["self_attn", "cross_attn"] {
            m.insert(format!("{b}.{attn}.norm_q.weight"), vec![d]);
            m.insert(format!("{b}.{attn}.norm_k.weight"), vec![d]);
        }
        m.insert(format!("{b}.norm3.weight"), vec![d]);
        m.insert(format!("{b}.norm3.bias"), vec![d]);
    }
    m
}

fn requested_keys(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let store = WeightStore::random(1, DType::F32);
    WanModel::load(cfg, &store).expect("small model");
    store
        .loaded_tensors()
        .expect("loaded tensors")
        .into_iter()
        .map(|(k, t)| (k, t.shape().to_vec()))
        .collect()
}

#[test]
fn loader_asks_for_the_official_keys_and_shapes() {
    // Odd, distinct sizes so a swapped dimension (dim for ffn_dim, text_dim for dim, …) shows.
    let act = ModelConfig {
        name: "odd-act".into(),
        dim: 96,
        ffn_dim: 160,
        num_heads: 3,
        num_layers: 3,
        text_dim: 40,
        text_len: 8,
        freq_dim: 32,
        control_dim: Some(7),
        ..ModelConfig::tiny()
    };
    let t2v = ModelConfig {
        name: "odd-t2v".into(),
        in_dim: 16,
        control_dim: None,
        ..act.clone()
    };
    for cfg in [ModelConfig::tiny(), act, t2v] {
        assert_eq!(requested_keys(&cfg), expected_keys(&cfg), "{}", cfg.name);
    }
}

#[test]
fn lingbot_presets_have_the_published_shapes() {
    for (name, dim, ffn, heads, layers, wan_params) in [
        ("lingbot-1.3b", 1536, 8960, 12, 30, 1.3e9..1.5e9),
        ("lingbot-14b", 5120, 13824, 40, 40, 13.5e9..14.5e9),
    ] {
        let cfg = ModelConfig::by_name(name).expect(name);
        cfg.validate().expect("valid");
        assert_eq!(cfg.name, name);
        assert_eq!(
            (cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_layers),
            (dim, ffn, heads, layers)
        );
        assert_eq!(cfg.head_dim(), 128);
        assert_eq!((cfg.in_dim, cfg.out_dim), (36, 16));
        assert!(cfg.is_i2v());
        assert_eq!((cfg.text_dim, cfg.text_len, cfg.freq_dim), (4096, 512, 256));
        assert_eq!(cfg.patch, [1, 2, 2]);
        assert_eq!(cfg.control_dim, Some(6));

        // The key table the tiny models' loader matches, at full size: the Wan part must come
        // to the published parameter count, the camera layers on top.
        let keys = expected_keys(&cfg);
        let count = |camera: bool| -> f64 {
            keys.iter()
                .filter(|(k, _)| k.contains("cam") == camera)
                .map(|(_, s)| s.iter().product::<usize>() as f64)
                .sum()
        };
        assert!(
            wan_params.contains(&count(false)),
            "{name}: {} Wan parameters",
            count(false)
        );
        assert!(count(true) > 0.0);
        assert_eq!(
            keys["patch_embedding_wancamctrl.weight"],
            vec![dim, 6 * 64 * 4]
        );

        // An empty checkpoint makes the real loader name the first tensor it wants and its
        // shape, without allocating the model.
        let dir = TempDir::new("preset");
        let path = dir.path("empty.safetensors");
        save(&path, &[]);
        let store = WeightStore::open(&path, DType::BF16).expect("open empty");
        let msg = WanModel::load(&cfg, &store)
            .expect_err("nothing to load")
            .to_string();
        assert!(
            msg.contains("'blocks.0.modulation'") && msg.contains(&format!("[1, 6, {dim}]")),
            "{name}: {msg}"
        );

        let act = ModelConfig::by_name(&format!("{name}-act")).expect("act");
        assert_eq!(act.control_dim, Some(7));
        assert_eq!(act.name, format!("{name}-act"));
        assert_eq!(
            ModelConfig {
                control_dim: Some(6),
                name: name.into(),
                ..act.clone()
            },
            cfg,
            "-act changes nothing but the control channels"
        );
        assert_eq!(
            expected_keys(&act)["patch_embedding_wancamctrl.weight"],
            vec![dim, 7 * 64 * 4]
        );
    }
    assert_eq!(
        ModelConfig::by_name("tiny-act")
            .expect("tiny-act")
            .control_dim,
        Some(7)
    );

    for bad in ["lingbot-7b", "LINGBOT-14B", "-act", "tiny-act-act", ""] {
        let msg = ModelConfig::by_name(bad)
            .expect_err("unknown preset")
            .to_string();
        assert!(msg.contains(&format!("'{bad}'")), "{msg}");
        for valid in ["tiny", "lingbot-1.3b", "lingbot-14b", "-act"] {
            assert!(msg.contains(valid), "{bad}: {valid} not listed in: {msg}");
        }
    }
}

#[test]
fn stores_sharing_random_draws_give_the_unshared_weights_and_draw_once() {
    let (_, want) = random_tiny();
    let draws = pipeline::RandomDraws::default();
    let first = WeightStore::random_shared(SEED, DType::F32, draws.clone());
    WanModel::load(&ModelConfig::tiny(), &first).expect("first load");
    let held = draws.lock().expect("draws").len();
    assert_eq!(held, want.len(), "every tensor drawn once is kept");
    // Poison one kept draw: a second store that draws again would not see it.
    let key = want[0].0.clone();
    {
        let mut d = draws.lock().expect("draws");
        let entry = d
            .iter_mut()
            .find(|((k, _, _), _)| *k == key)
            .expect("kept draw");
        let poisoned = vec![7.0f32; entry.1.elem_count()];
        *entry.1 = Tensor::from_f32(poisoned, entry.1.shape(), entry.1.dtype()).expect("poison");
    }
    let second = WeightStore::random_shared(SEED, DType::F32, draws.clone());
    WanModel::load(&ModelConfig::tiny(), &second).expect("second load");
    let got = second.loaded_tensors().expect("loaded tensors");
    assert_eq!(
        draws.lock().expect("draws").len(),
        held,
        "nothing new drawn"
    );
    let reused = got.iter().find(|(k, _)| *k == key).expect("reused key");
    assert!(
        reused.1.to_vec_f32().iter().all(|&v| v == 7.0),
        "the kept draw was reused"
    );
    // Every other tensor is the unshared store's, bit for bit.
    let rest = |v: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
        v.iter().filter(|(k, _)| *k != key).cloned().collect()
    };
    assert_same_tensors("shared draws", &rest(&got), &rest(&want));
}
