//! Weights by checkpoint name: memory-mapped safetensors (one file, or shards with an
//! `*.index.json`), or random from a seed. The model asks for each tensor by its full official
//! name and shape through [`Vb`], so the Rust tree mirrors the checkpoint tree.
//!
//! Loading converts each tensor straight from the mapped file into the run dtype: the only
//! resident copy is the converted one (the mapping is page cache the kernel can drop).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use kernels::{CpuStorage, DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::rng::NormalRng;
use crate::{Error, Result};

/// A checkpoint's bytes: a mapped file, or bytes built into the binary.
enum Bytes {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(b) => b,
        }
    }
}

struct MappedFile {
    path: PathBuf,
    mmap: Bytes,
    /// Byte offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
}

enum Source {
    SafeTensors {
        files: Vec<MappedFile>,
        index: HashMap<String, (usize, TensorInfo)>,
    },
    Random {
        seed: u64,
        /// Tensors already drawn (on the host), shared with other stores: see
        /// [`WeightStore::random_shared`].
        drawn: Option<RandomDraws>,
    },
}

/// Random tensors drawn once, on the host, for every store that shares them: a multi-card bench
/// draws lingbot-14b's weights (about a minute of host time) once instead of once per card.
/// Keyed by name, shape and dtype.
pub type RandomDraws = Arc<Mutex<HashMap<(String, Vec<usize>, DType), Tensor>>>;

/// Where a model's weights come from, and which of them the model has used.
pub struct WeightStore {
    source: Source,
    run_dtype: DType,
    device: Device,
    /// Keys the model asked for, with the shape and dtype it asked for.
    used: Mutex<BTreeMap<String, (Vec<usize>, DType)>>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WeightStore({}, {})",
            self.describe(),
            self.run_dtype.name()
        )
    }
}

fn file_err(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::File {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

impl WeightStore {
    /// Random weights, the same for a given seed and key whatever the load order.
    pub fn random(seed: u64, run_dtype: DType) -> Self {
        WeightStore {
            source: Source::Random { seed, drawn: None },
            run_dtype,
            device: Device::Cpu,
            used: Default::default(),
        }
    }

    /// [`random`](Self::random), reusing the host copies in `drawn` and adding the ones it
    /// draws. The host keeps every tensor drawn while `drawn` lives.
    pub fn random_shared(seed: u64, run_dtype: DType, drawn: RandomDraws) -> Self {
        WeightStore {
            source: Source::Random {
                seed,
                drawn: Some(drawn),
            },
            run_dtype,
            device: Device::Cpu,
            used: Default::default(),
        }
    }

    /// Opens a `.safetensors` file, a `*.index.json` of shards, or a folder holding exactly one
    /// of either.
    pub fn open(path: &Path, run_dtype: DType) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| file_err(path, e))?;
        let files = if meta.is_dir() {
            return Self::open(&Self::find_in_dir(path)?, run_dtype);
        } else if path.to_string_lossy().ends_with(".index.json") {
            Self::shard_paths(path)?
        } else {
            vec![path.to_path_buf()]
        };
        let mut mapped = Vec::new();
        let mut index = HashMap::new();
        for (i, p) in files.iter().enumerate() {
            let f = std::fs::File::open(p).map_err(|e| file_err(p, e))?;
            // SAFETY: the mapping is read-only; a checkpoint modified on disk while loading
            // would give wrong values, not memory unsafety in our code beyond that.
            let mmap = unsafe { Mmap::map(&f) }.map_err(|e| file_err(p, e))?;
            let (n, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| file_err(p, format!("not a valid safetensors file: {e}")))?;
            for (name, info) in metadata.tensors() {
                if let Some((j, _)) = index.insert(name.clone(), (i, info.clone())) {
                    let other: &PathBuf = &files[j];
                    return Err(file_err(
                        p,
                        format!("key '{name}' also in {}", other.display()),
                    ));
                }
            }
            mapped.push(MappedFile {
                path: p.clone(),
                mmap: Bytes::Mapped(mmap),
                data_start: 8 + n,
            });
        }
        Ok(WeightStore {
            source: Source::SafeTensors {
                files: mapped,
                index,
            },
            run_dtype,
            device: Device::Cpu,
            used: Default::default(),
        })
    }

    /// A safetensors file built into the binary (`include_bytes!`), described as `name`.
    pub fn from_static(name: &str, bytes: &'static [u8], run_dtype: DType) -> Result<Self> {
        let path = PathBuf::from(name);
        let (n, metadata) = SafeTensors::read_metadata(bytes)
            .map_err(|e| file_err(&path, format!("not a valid safetensors file: {e}")))?;
        let index = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, (0, info.clone())))
            .collect();
        Ok(WeightStore {
            source: Source::SafeTensors {
                files: vec![MappedFile {
                    path,
                    mmap: Bytes::Static(bytes),
                    data_start: 8 + n,
                }],
                index,
            },
            run_dtype,
            device: Device::Cpu,
            used: Default::default(),
        })
    }

    fn find_in_dir(dir: &Path) -> Result<PathBuf> {
        let entries = std::fs::read_dir(dir).map_err(|e| file_err(dir, e))?;
        let mut index = Vec::new();
        let mut single = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".safetensors.index.json") {
                index.push(e.path());
            } else if name.ends_with(".safetensors") {
                single.push(e.path());
            }
        }
        match (index.len(), single.len()) {
            (1, _) => Ok(index.remove(0)),
            (0, 1) => Ok(single.remove(0)),
            _ => Err(file_err(
                dir,
                "expected one *.safetensors.index.json or exactly one *.safetensors file",
            )),
        }
    }

    fn shard_paths(index_path: &Path) -> Result<Vec<PathBuf>> {
        let text = std::fs::read_to_string(index_path).map_err(|e| file_err(index_path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| file_err(index_path, e))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| file_err(index_path, "no \"weight_map\" object"))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut names = BTreeSet::new();
        for (key, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| file_err(index_path, format!("file of '{key}' is not a string")))?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(file_err(
                    index_path,
                    format!("shard name '{file}' is not a plain file name"),
                ));
            }
            names.insert(file.to_string());
        }
        Ok(names.into_iter().map(|n| dir.join(n)).collect())
    }

    /// Loads tensors onto `device` (each is converted on the host, then copied once).
    pub fn on_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn is_random(&self) -> bool {
        matches!(self.source, Source::Random { .. })
    }

    pub fn run_dtype(&self) -> DType {
        self.run_dtype
    }

    /// "random (seed N)" or the loaded file(s), for logs and `/status`.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Random { seed, .. } => format!("random (seed {seed})"),
            Source::SafeTensors { files, .. } => {
                let first = files
                    .first()
                    .map(|f| f.path.display().to_string())
                    .unwrap_or_default();
                if files.len() == 1 {
                    first
                } else {
                    format!("{} shards ({first}, …)", files.len())
                }
            }
        }
    }

    /// The root of the name tree.
    pub fn root(&self) -> Vb<'_> {
        Vb {
            store: self,
            prefix: String::new(),
        }
    }

    /// Fails naming every stored key the model never asked for.
    pub fn check_all_used(&self) -> Result<()> {
        let Source::SafeTensors { index, .. } = &self.source else {
            return Ok(());
        };
        let used = self
            .used
            .lock()
            .map_err(|_| Error::Config("weight store poisoned".into()))?;
        let mut keys: Vec<String> = index
            .keys()
            .filter(|k| !used.contains_key(*k))
            .cloned()
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        keys.sort();
        Err(Error::UnexpectedKeys { keys })
    }

    /// The name and shape of every tensor the model has loaded, in name order.
    pub fn loaded_shapes(&self) -> Result<Vec<(String, Vec<usize>)>> {
        match self.used.lock() {
            Ok(u) => Ok(u.iter().map(|(k, (s, _))| (k.clone(), s.clone())).collect()),
            Err(_) => Err(Error::Config("weight store poisoned".into())),
        }
    }

    /// Every tensor the model has loaded, by checkpoint name, as loaded (read again from the
    /// source): what a checkpoint of this model holds. Used to export random or converted weights.
    pub fn loaded_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let used: Vec<(String, (Vec<usize>, DType))> = match self.used.lock() {
            Ok(u) => u.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => return Err(Error::Config("weight store poisoned".into())),
        };
        used.into_iter()
            .map(|(k, (shape, dtype))| Ok((k.clone(), self.load(&k, &shape, dtype)?)))
            .collect()
    }

    fn load(&self, key: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if let Ok(mut used) = self.used.lock() {
            used.insert(key.to_string(), (shape.to_vec(), dtype));
        }
        match &self.source {
            Source::Random { seed, drawn } => {
                let id = (key.to_string(), shape.to_vec(), dtype);
                let held = drawn
                    .as_ref()
                    .and_then(|d| d.lock().ok().and_then(|m| m.get(&id).cloned()));
                let host = match held {
                    Some(t) => t,
                    None => {
                        let t = random_tensor(*seed, key, shape, dtype)?;
                        if let Some(Ok(mut m)) = drawn.as_ref().map(|d| d.lock()) {
                            m.insert(id, t.clone());
                        }
                        t
                    }
                };
                Ok(host.to_device(self.device)?)
            }
            Source::SafeTensors { files, index } => {
                let Some((fi, info)) = index.get(key) else {
                    return Err(Error::MissingKey {
                        key: key.into(),
                        expected: shape.to_vec(),
                    });
                };
                if info.shape != shape {
                    return Err(Error::WrongShape {
                        key: key.into(),
                        expected: shape.to_vec(),
                        found: info.shape.clone(),
                    });
                }
                let file = &files[*fi];
                let (a, b) = info.data_offsets;
                let bytes = file
                    .mmap
                    .get(file.data_start + a..file.data_start + b)
                    .ok_or_else(|| bad(key, file, "data offsets past the end of the file"))?;
                let st = convert(bytes, info.dtype, dtype).map_err(|m| bad(key, file, m))?;
                Ok(Tensor::from_cpu_storage(st, shape)?.to_device(self.device)?)
            }
        }
    }
}

fn bad(key: &str, file: &MappedFile, msg: impl Into<String>) -> Error {
    Error::BadTensor {
        key: key.into(),
        path: file.path.clone(),
        msg: msg.into(),
    }
}

/// Converts little-endian stored elements to the run dtype in one pass.
fn convert(bytes: &[u8], from: StDtype, to: DType) -> std::result::Result<CpuStorage, String> {
    let size = match from {
        StDtype::F32 => 4,
        StDtype::BF16 | StDtype::F16 => 2,
        other => {
            return Err(format!(
                "stored dtype {other:?} (expected F32, BF16 or F16)"
            ))
        }
    };
    if !bytes.len().is_multiple_of(size) {
        return Err(format!(
            "{} bytes is not a whole number of {from:?} values",
            bytes.len()
        ));
    }
    let f32s = || -> Vec<f32> {
        match from {
            StDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    };
    Ok(match (from, to) {
        (StDtype::BF16, DType::BF16) => CpuStorage::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        (StDtype::F16, DType::F16) => CpuStorage::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        (StDtype::F32, DType::BF16) => CpuStorage::BF16(
            bytes
                .chunks_exact(4)
                .map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        ),
        (_, DType::F8E4M3) => return Err("fp8 weights are quantized after loading".into()),
        (_, to) => CpuStorage::from_f32(f32s(), to).map_err(|e| e.to_string())?,
    })
}

/// Random init by role: matrices `N(0,1)/sqrt(fan_in)`, norm gains (vectors, and the VAE's
/// `*.gamma` of any shape) `1 + 0.1·N`, modulation tables
/// `N(0,1)/sqrt(dim)`, biases `0.05·N`. Scales keep activations of order one through many layers.
fn random_tensor(seed: u64, key: &str, shape: &[usize], dtype: DType) -> kernels::Result<Tensor> {
    use rayon::prelude::*;
    let n: usize = shape.iter().product();
    let mut data = NormalRng::normals_par(NormalRng::for_name(seed, key).state(), n);
    let last = shape.last().copied().unwrap_or(1).max(1) as f32;
    // `offset + v · mul / div` reproduces each role's formula exactly (×1 and /1 are exact).
    let (mul, div, offset) = if key.ends_with("modulation") {
        (1.0, last.sqrt(), 0.0)
    } else if key.ends_with(".gamma") {
        // The VAE's norm gains, stored `[c, 1, 1, 1]`: gains, not matrices.
        (0.1, 1.0, 1.0)
    } else if shape.len() >= 2 {
        let fan_in = (n / shape[0].max(1)).max(1) as f32;
        (1.0, fan_in.sqrt(), 0.0)
    } else if key.ends_with(".bias") {
        (0.05, 1.0, 0.0)
    } else {
        (0.1, 1.0, 1.0)
    };
    data.par_iter_mut()
        .for_each(|v| *v = offset + *v * mul / div);
    Tensor::from_f32(data, shape, dtype)
}

/// A path in the weight tree: `vb.pp("blocks").pp(3).get(&[dim], "norm3.weight")` reads
/// `blocks.3.norm3.weight`.
#[derive(Clone, Debug)]
pub struct Vb<'a> {
    store: &'a WeightStore,
    prefix: String,
}

impl<'a> Vb<'a> {
    /// One level down.
    pub fn pp(&self, name: impl std::fmt::Display) -> Vb<'a> {
        Vb {
            store: self.store,
            prefix: join(&self.prefix, &name.to_string()),
        }
    }

    /// A tensor in the run dtype (matrices) or f32 (vectors and modulation tables: they are
    /// small and feed the f32 modulation path).
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        let dtype = if shape.len() >= 2 && !name.ends_with("modulation") {
            self.store.run_dtype
        } else {
            DType::F32
        };
        self.store.load(&join(&self.prefix, name), shape, dtype)
    }

    /// A tensor kept in f32 whatever the run dtype.
    pub fn get_f32(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.store
            .load(&join(&self.prefix, name), shape, DType::F32)
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Writes tensors as an f32 (or their own dtype for bf16/f16) safetensors file under the given
/// names: for tests, tools and exported checkpoints.
pub fn save_safetensors(path: &Path, tensors: &[(String, &Tensor)]) -> Result<()> {
    struct V {
        dtype: StDtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    }
    impl safetensors::View for V {
        fn dtype(&self) -> StDtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.bytes)
        }
        fn data_len(&self) -> usize {
            self.bytes.len()
        }
    }
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dtype, bytes) = match t.storage() {
            kernels::Storage::Cpu(CpuStorage::BF16(v)) => (
                StDtype::BF16,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            kernels::Storage::Cpu(CpuStorage::F16(v)) => (
                StDtype::F16,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            _ => (
                StDtype::F32,
                t.to_vec_f32()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            ),
        };
        views.push((
            name.clone(),
            V {
                dtype,
                shape: t.shape().to_vec(),
                bytes,
            },
        ));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|e| file_err(path, e))
}
