//! NumPy `.npy` files (format 1.0, C order, little endian), written as a stream: the header
//! first, then the data in order.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Element types we write, by NumPy `descr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NpyType {
    U8,
    F32,
    F64,
}

impl NpyType {
    pub fn descr(self) -> &'static str {
        match self {
            NpyType::U8 => "|u1",
            NpyType::F32 => "<f4",
            NpyType::F64 => "<f8",
        }
    }

    pub fn size(self) -> usize {
        match self {
            NpyType::U8 => 1,
            NpyType::F32 => 4,
            NpyType::F64 => 8,
        }
    }

    /// The NumPy dtype name (`uint8`, `float32`, `float64`).
    pub fn numpy_name(self) -> &'static str {
        match self {
            NpyType::U8 => "uint8",
            NpyType::F32 => "float32",
            NpyType::F64 => "float64",
        }
    }
}

/// The header of an array of `ty` and `shape`, padded so the data starts at a multiple of 64.
pub fn header(ty: NpyType, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        ty.descr()
    );
    // magic (6) + version (2) + length (2) + dict + '\n'
    let total = (10 + dict.len() + 1).div_ceil(64) * 64;
    dict.push_str(&" ".repeat(total - 10 - dict.len() - 1));
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// An `.npy` file being written; [`finish`](Self::finish) checks that exactly the promised
/// number of elements arrived.
#[derive(Debug)]
pub struct NpyWriter {
    out: BufWriter<File>,
    ty: NpyType,
    expected: usize,
    written: usize,
    path: PathBuf,
}

fn file_error(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::File {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

impl NpyWriter {
    pub fn create(path: &Path, ty: NpyType, shape: &[usize]) -> Result<Self> {
        let io = |e: std::io::Error| file_error(path, e);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        out.write_all(&header(ty, shape)).map_err(io)?;
        Ok(NpyWriter {
            out,
            ty,
            expected: shape.iter().product::<usize>() * ty.size(),
            written: 0,
            path: path.to_path_buf(),
        })
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.written += bytes.len();
        if self.written > self.expected {
            return Err(file_error(&self.path, "more data than its shape holds"));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| file_error(&self.path, e))
    }

    pub fn write_u8(&mut self, v: &[u8]) -> Result<()> {
        self.check(NpyType::U8)?;
        self.put(v)
    }

    pub fn write_f32(&mut self, v: &[f32]) -> Result<()> {
        self.check(NpyType::F32)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(&bytes)
    }

    pub fn write_f64(&mut self, v: &[f64]) -> Result<()> {
        self.check(NpyType::F64)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(&bytes)
    }

    fn check(&self, ty: NpyType) -> Result<()> {
        if ty != self.ty {
            return Err(file_error(
                &self.path,
                format!("writing {} into a {} array", ty.descr(), self.ty.descr()),
            ));
        }
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        if self.written != self.expected {
            return Err(file_error(
                &self.path,
                format!("{} of {} data bytes written", self.written, self.expected),
            ));
        }
        self.out.flush().map_err(|e| file_error(&self.path, e))
    }
}

/// Reads an `.npy` header: `(descr, shape, data offset)`. For tests and tools; accepts what
/// [`header`] writes (and NumPy's own 1.0 headers).
pub fn read_header(bytes: &[u8]) -> Result<(String, Vec<usize>, usize)> {
    let bad = |m: &str| Error::Input(format!("not an .npy file: {m}"));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("no magic"));
    }
    let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let dict = std::str::from_utf8(bytes.get(10..10 + len).ok_or_else(|| bad("short header"))?)
        .map_err(|_| bad("header is not UTF-8"))?;
    let field = |key: &str| -> Result<&str> {
        let at = dict.find(key).ok_or_else(|| bad(key))? + key.len();
        Ok(dict[at..].trim_start_matches([':', ' ', '\'']))
    };
    let descr = field("'descr'")?;
    let descr = descr[..descr.find('\'').ok_or_else(|| bad("descr"))?].to_string();
    let shape = field("'shape'")?;
    let shape = &shape[1..shape.find(')').ok_or_else(|| bad("shape"))?];
    let shape = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad("shape")))
        .collect::<Result<Vec<_>>>()?;
    Ok((descr, shape, 10 + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_aligned_and_read_back() {
        for shape in [vec![3], vec![2, 45, 128, 128, 3], vec![0, 1]] {
            let h = header(NpyType::F32, &shape);
            assert_eq!(h.len() % 64, 0);
            assert_eq!(*h.last().expect("byte"), b'\n');
            let (descr, s, off) = read_header(&h).expect("parse");
            assert_eq!((descr.as_str(), s, off), ("<f4", shape, h.len()));
        }
        assert!(read_header(b"\x93NUMPX\x01\x00\x00\x00").is_err());
    }
}
