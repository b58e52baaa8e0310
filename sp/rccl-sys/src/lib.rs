//! The NCCL/RCCL C API, loaded at run time with `libloading`: `libnccl.so.2` for CUDA,
//! `librccl.so.1` for ROCm (RCCL exports NCCL's names and numbers). Nothing links either library,
//! so the workspace builds and runs where neither is installed; [`Nccl::load`] then fails with an
//! error naming what it looked for, never a panic.
//!
//! The types mirror `nccl.h` (NCCL 2.18 and later; RCCL of the same API level): enums are
//! newtypes over the C `int` so an unknown value from the library is never undefined behaviour.
//! Calls are the raw function pointers; [`Nccl::check`] turns a result into an [`Error`] with
//! the library's own message.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;

/// `ncclResult_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NcclResult(pub c_int);

impl NcclResult {
    pub const SUCCESS: Self = Self(0);
    pub const UNHANDLED_CUDA_ERROR: Self = Self(1);
    pub const SYSTEM_ERROR: Self = Self(2);
    pub const INTERNAL_ERROR: Self = Self(3);
    pub const INVALID_ARGUMENT: Self = Self(4);
    pub const INVALID_USAGE: Self = Self(5);
    pub const REMOTE_ERROR: Self = Self(6);
    pub const IN_PROGRESS: Self = Self(7);
    pub const TIMEOUT: Self = Self(8);

    /// The enumerator's name in `nccl.h`.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            8 => "ncclTimeout",
            _ => "unknown ncclResult_t",
        }
    }
}

/// `ncclDataType_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataType(pub c_int);

impl DataType {
    pub const INT8: Self = Self(0);
    pub const UINT8: Self = Self(1);
    pub const INT32: Self = Self(2);
    pub const UINT32: Self = Self(3);
    pub const INT64: Self = Self(4);
    pub const UINT64: Self = Self(5);
    pub const FLOAT16: Self = Self(6);
    pub const FLOAT32: Self = Self(7);
    pub const FLOAT64: Self = Self(8);
    pub const BFLOAT16: Self = Self(9);
    /// NCCL ≥ 2.24 only; RCCL numbers its fp8 types differently: avoid across libraries.
    pub const FLOAT8_E4M3: Self = Self(10);
    pub const FLOAT8_E5M2: Self = Self(11);

    /// Bytes of one element.
    pub fn size_in_bytes(self) -> Option<usize> {
        Some(match self.0 {
            0 | 1 | 10 | 11 => 1,
            6 | 9 => 2,
            2 | 3 | 7 => 4,
            4 | 5 | 8 => 8,
            _ => return None,
        })
    }
}

/// `ncclRedOp_t` (the built-in operators).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RedOp(pub c_int);

impl RedOp {
    pub const SUM: Self = Self(0);
    pub const PROD: Self = Self(1);
    pub const MAX: Self = Self(2);
    pub const MIN: Self = Self(3);
    pub const AVG: Self = Self(4);
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: made by one rank, handed to all, passed by value to the init call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl Default for UniqueId {
    fn default() -> Self {
        UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        }
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The id holds a socket address: not worth printing, and nothing secret either.
        write!(f, "UniqueId(..)")
    }
}

/// `ncclComm_t`: an opaque handle.
pub type Comm = *mut c_void;

/// `cudaStream_t` / `hipStream_t` (the driver API's `CUstream` is the same handle).
pub type Stream = *mut c_void;

/// The oldest NCCL API level this crate is written against.
pub const MIN_VERSION: Version = Version {
    major: 2,
    minor: 18,
    patch: 0,
};

/// A library version, decoded from `ncclGetVersion`'s code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    /// Decodes `NCCL_VERSION_CODE`: `X*1000 + Y*100 + Z` up to 2.8, `X*10000 + Y*100 + Z`
    /// from 2.9 on.
    pub fn from_code(code: c_int) -> Option<Version> {
        let code = u32::try_from(code).ok()?;
        let (major, rest) = if code >= 10000 {
            (code / 10000, code % 10000)
        } else {
            (code / 1000, code % 1000)
        };
        Some(Version {
            major,
            minor: rest / 100,
            patch: rest % 100,
        })
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Which vendor library to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// NVIDIA's NCCL, for CUDA devices.
    Nccl,
    /// AMD's RCCL, for ROCm devices.
    Rccl,
}

impl Flavor {
    /// File names tried in order (the loader's search path applies).
    pub fn candidates(self) -> &'static [&'static str] {
        match self {
            Flavor::Nccl => &["libnccl.so.2", "libnccl.so"],
            Flavor::Rccl => &["librccl.so.1", "librccl.so"],
        }
    }
}

/// Environment variable naming the library file to load instead of the flavor's defaults.
pub const LIBRARY_ENV: &str = "WORLDLINE_NCCL_LIBRARY";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot load the collectives library (tried {tried}): {reason}")]
    NotFound { tried: String, reason: String },

    #[error("{library}: no symbol {symbol}: {reason}")]
    Symbol {
        library: String,
        symbol: &'static str,
        reason: String,
    },

    #[error("{library} is version {found}; this build needs {min} or later")]
    TooOld {
        library: String,
        found: String,
        min: Version,
    },

    #[error("{call}: {name} ({code}): {message}")]
    Call {
        call: &'static str,
        code: c_int,
        name: &'static str,
        message: String,
    },
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRankFn = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult;
type CommFn = unsafe extern "C" fn(Comm) -> NcclResult;
type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, DataType, c_int, Comm, Stream) -> NcclResult;
type RecvFn = unsafe extern "C" fn(*mut c_void, usize, DataType, c_int, Comm, Stream) -> NcclResult;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, DataType, Comm, Stream) -> NcclResult;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    c_int,
    Comm,
    Stream,
) -> NcclResult;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    RedOp,
    Comm,
    Stream,
) -> NcclResult;
type CommGetAsyncErrorFn = unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult;

/// The loaded library and its entry points. The function pointers stay valid as long as this
/// value lives (it owns the library handle); every call is `unsafe` with the contract of
/// `nccl.h`.
pub struct Nccl {
    /// The file that was loaded.
    pub library: String,
    pub version: Version,
    pub get_version: GetVersionFn,
    pub get_unique_id: GetUniqueIdFn,
    pub comm_init_rank: CommInitRankFn,
    pub comm_destroy: CommFn,
    pub comm_abort: CommFn,
    pub get_error_string: GetErrorStringFn,
    pub group_start: GroupFn,
    pub group_end: GroupFn,
    pub send: SendFn,
    pub recv: RecvFn,
    pub all_gather: AllGatherFn,
    pub broadcast: BroadcastFn,
    pub all_reduce: AllReduceFn,
    pub comm_get_async_error: CommGetAsyncErrorFn,
    // Last, so the pointers above are never held past the library's unloading.
    _lib: libloading::Library,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nccl({} {})", self.library, self.version)
    }
}

/// The loader's message, with its cause (libloading keeps `dlerror`'s text in the source).
fn describe(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

/// Reads symbol `name` of `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's true C signature.
unsafe fn symbol<T: Copy>(
    lib: &libloading::Library,
    library: &str,
    name: &'static str,
) -> Result<T, Error> {
    // SAFETY: the caller guarantees `T` matches the symbol; the pointer is copied out and only
    // used while the `Nccl` that owns `lib` lives.
    let sym = unsafe { lib.get::<T>(name.as_bytes()) };
    sym.map(|s| *s).map_err(|e| Error::Symbol {
        library: library.to_string(),
        symbol: name,
        reason: describe(&e),
    })
}

impl Nccl {
    /// Loads `flavor`'s library (or the file named by [`LIBRARY_ENV`]) and checks its version.
    pub fn load(flavor: Flavor) -> Result<Nccl, Error> {
        match std::env::var(LIBRARY_ENV) {
            Ok(path) if !path.is_empty() => Self::load_from(&[path.as_str()]),
            _ => Self::load_from(flavor.candidates()),
        }
    }

    /// Loads the first of `names` that opens, and checks its version.
    pub fn load_from(names: &[&str]) -> Result<Nccl, Error> {
        let mut reasons = Vec::new();
        for name in names {
            // SAFETY: loading NCCL/RCCL runs their initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(*name) } {
                Ok(lib) => return Self::from_library(lib, name),
                Err(e) => reasons.push(describe(&e)),
            }
        }
        Err(Error::NotFound {
            tried: names.join(", "),
            reason: if reasons.is_empty() {
                "no file names given".into()
            } else {
                reasons.join("; ")
            },
        })
    }

    fn from_library(lib: libloading::Library, name: &str) -> Result<Nccl, Error> {
        // SAFETY (every `symbol` call below): the types are `nccl.h`'s prototypes.
        let get_version: GetVersionFn = unsafe { symbol(&lib, name, "ncclGetVersion") }?;
        let mut code: c_int = 0;
        // SAFETY: `code` is a valid out-pointer.
        let r = unsafe { get_version(&mut code) };
        if r != NcclResult::SUCCESS {
            return Err(Error::Call {
                call: "ncclGetVersion",
                code: r.0,
                name: r.name(),
                message: format!("{name} did not report its version"),
            });
        }
        let version = Version::from_code(code).ok_or_else(|| Error::TooOld {
            library: name.to_string(),
            found: format!("code {code}"),
            min: MIN_VERSION,
        })?;
        if version < MIN_VERSION {
            return Err(Error::TooOld {
                library: name.to_string(),
                found: version.to_string(),
                min: MIN_VERSION,
            });
        }
        // SAFETY: as above.
        unsafe {
            Ok(Nccl {
                library: name.to_string(),
                version,
                get_version,
                get_unique_id: symbol(&lib, name, "ncclGetUniqueId")?,
                comm_init_rank: symbol(&lib, name, "ncclCommInitRank")?,
                comm_destroy: symbol(&lib, name, "ncclCommDestroy")?,
                comm_abort: symbol(&lib, name, "ncclCommAbort")?,
                get_error_string: symbol(&lib, name, "ncclGetErrorString")?,
                group_start: symbol(&lib, name, "ncclGroupStart")?,
                group_end: symbol(&lib, name, "ncclGroupEnd")?,
                send: symbol(&lib, name, "ncclSend")?,
                recv: symbol(&lib, name, "ncclRecv")?,
                all_gather: symbol(&lib, name, "ncclAllGather")?,
                broadcast: symbol(&lib, name, "ncclBroadcast")?,
                all_reduce: symbol(&lib, name, "ncclAllReduce")?,
                comm_get_async_error: symbol(&lib, name, "ncclCommGetAsyncError")?,
                _lib: lib,
            })
        }
    }

    /// The library's message for `r`.
    pub fn error_string(&self, r: NcclResult) -> String {
        // SAFETY: ncclGetErrorString takes any value and returns a static string or null.
        let p = unsafe { (self.get_error_string)(r) };
        if p.is_null() {
            return r.name().to_string();
        }
        // SAFETY: non-null results point at NUL-terminated static strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `ncclSuccess`, the library's message otherwise.
    pub fn check(&self, call: &'static str, r: NcclResult) -> Result<(), Error> {
        if r == NcclResult::SUCCESS {
            return Ok(());
        }
        Err(Error::Call {
            call,
            code: r.0,
            name: r.name(),
            message: self.error_string(r),
        })
    }

    /// A fresh id for one communicator (`ncclGetUniqueId`).
    pub fn unique_id(&self) -> Result<UniqueId, Error> {
        let mut id = UniqueId::default();
        // SAFETY: `id` is a valid, writable ncclUniqueId.
        let r = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r)?;
        Ok(id)
    }

    /// The communicator's asynchronous error (`ncclSuccess` while healthy, `ncclInProgress`
    /// while a non-blocking operation runs).
    ///
    /// # Safety
    /// `comm` must be a live communicator of this library.
    pub unsafe fn async_error(&self, comm: Comm) -> Result<NcclResult, Error> {
        let mut state = NcclResult::SUCCESS;
        // SAFETY: the caller guarantees `comm`; `state` is a valid out-pointer.
        let r = unsafe { (self.comm_get_async_error)(comm, &mut state) };
        self.check("ncclCommGetAsyncError", r)?;
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_naming_it() {
        let err = Nccl::load_from(&["libworldline-no-such-nccl.so.9"])
            .expect_err("a library that does not exist loaded");
        let msg = err.to_string();
        assert!(msg.contains("libworldline-no-such-nccl.so.9"), "{msg}");
        assert!(matches!(err, Error::NotFound { .. }));
    }

    #[test]
    fn loading_either_flavor_never_panics() {
        // Whatever this machine has: a loaded library or an error that names the files.
        for flavor in [Flavor::Nccl, Flavor::Rccl] {
            match Nccl::load(flavor) {
                Ok(n) => println!("{flavor:?}: {n:?}"),
                Err(e) => {
                    let msg = e.to_string();
                    println!("{flavor:?}: {msg}");
                    assert!(!msg.is_empty());
                }
            }
        }
    }

    #[test]
    fn a_library_without_nccl_symbols_is_an_error() {
        // libc loads everywhere and has no ncclGetVersion.
        let err = Nccl::load_from(&["libc.so.6"]).expect_err("libc is not NCCL");
        let msg = err.to_string();
        assert!(msg.contains("ncclGetVersion"), "{msg}");
    }

    #[test]
    fn versions_decode_both_encodings() {
        let v = |c| Version::from_code(c).expect("version");
        assert_eq!(v(22803).to_string(), "2.28.3");
        assert_eq!(v(21800).to_string(), "2.18.0");
        assert_eq!(v(2804).to_string(), "2.8.4");
        assert!(v(21703) < MIN_VERSION);
        assert!(v(21800) >= MIN_VERSION);
        assert!(v(30000) > MIN_VERSION);
        assert_eq!(Version::from_code(-1), None);
    }

    #[test]
    fn abi_matches_nccl_h() {
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
        assert_eq!(std::mem::size_of::<NcclResult>(), 4);
        assert_eq!(std::mem::size_of::<DataType>(), 4);
        assert_eq!(std::mem::size_of::<RedOp>(), 4);
        assert_eq!(DataType::FLOAT32.0, 7);
        assert_eq!(DataType::BFLOAT16.0, 9);
        assert_eq!(DataType::FLOAT16.0, 6);
        assert_eq!(DataType::UINT8.0, 1);
        assert_eq!(RedOp::SUM.0, 0);
        assert_eq!(RedOp::AVG.0, 4);
        assert_eq!(NcclResult::IN_PROGRESS.0, 7);
        assert_eq!(NcclResult::REMOTE_ERROR.0, 6);
        assert_eq!(DataType::BFLOAT16.size_in_bytes(), Some(2));
    }
}
