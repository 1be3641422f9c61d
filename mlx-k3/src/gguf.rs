//! A small GGUF reader: header, metadata and tensor directory, and raw tensor bytes, enough to import IQ1_S
//! tensors into the codebook format without re-quantizing. Every read is bounds-checked: a truncated or
//! corrupt file is an error naming the file (and the tensor), never a panic.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::codebook::{from_iq1s_blocks, CodebookHost, IQ1S_BLOCK_BYTES, SUPER_BLOCK};
use crate::{Error, Result};

/// GGML type id of IQ1_S.
pub const GGML_TYPE_IQ1_S: u32 = 19;
/// GGML type id of F32.
pub const GGML_TYPE_F32: u32 = 0;
/// GGML type id of F16.
pub const GGML_TYPE_F16: u32 = 1;
/// GGML type id of Q4_0 (blocks of 32: an f16 scale, 16 bytes of 4-bit codes, value `d * (q - 8)`).
pub const GGML_TYPE_Q4_0: u32 = 2;
/// GGML type id of Q8_0 (blocks of 32: an f16 scale, 32 signed bytes, value `d * q`).
pub const GGML_TYPE_Q8_0: u32 = 8;
/// GGML type id of BF16.
pub const GGML_TYPE_BF16: u32 = 30;
/// GGML type id of Q2_K (super-blocks of 256: sixteen 16-value sub-blocks with 4-bit scales and mins).
pub const GGML_TYPE_Q2_K: u32 = 10;
/// GGML type id of Q3_K (super-blocks of 256: sixteen 16-value sub-blocks with 6-bit signed scales, 3-bit codes).
pub const GGML_TYPE_Q3_K: u32 = 11;
/// GGML type id of Q4_K (super-blocks of 256: eight 32-value sub-blocks with 6-bit scales and mins).
pub const GGML_TYPE_Q4_K: u32 = 12;
/// GGML type id of Q5_K (as Q4_K, with a fifth code bit).
pub const GGML_TYPE_Q5_K: u32 = 13;
/// GGML type id of Q6_K (super-blocks of 256: sixteen 16-value sub-blocks with 8-bit scales, 6-bit codes).
pub const GGML_TYPE_Q6_K: u32 = 14;

/// The name llama.cpp gives GGML type `t` (`"type 42"` for ids this reader does not know).
pub fn ggml_type_name(t: u32) -> String {
    let known = [
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (6, "Q5_0"),
        (7, "Q5_1"),
        (8, "Q8_0"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (12, "Q4_K"),
        (13, "Q5_K"),
        (14, "Q6_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (30, "BF16"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    known.iter().find(|(id, _)| *id == t).map_or_else(|| format!("type {t}"), |(_, n)| (*n).to_string())
}

/// `(values per block, bytes per block)` of the GGML types [`GgufFile::tensor_bytes`] reads.
pub fn block_layout(t: u32) -> Option<(usize, usize)> {
    match t {
        GGML_TYPE_F32 => Some((1, 4)),
        GGML_TYPE_F16 | GGML_TYPE_BF16 => Some((1, 2)),
        GGML_TYPE_Q4_0 => Some((32, 18)),
        GGML_TYPE_Q8_0 => Some((32, 34)),
        GGML_TYPE_IQ1_S => Some((SUPER_BLOCK, IQ1S_BLOCK_BYTES)),
        GGML_TYPE_Q2_K => Some((256, 84)),
        GGML_TYPE_Q3_K => Some((256, 110)),
        GGML_TYPE_Q4_K => Some((256, 144)),
        GGML_TYPE_Q5_K => Some((256, 176)),
        GGML_TYPE_Q6_K => Some((256, 210)),
        _ => None,
    }
}

/// One tensor's directory entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// GGUF dims (innermost first).
    pub dims: Vec<u64>,
    /// GGML type id.
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// An opened GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    /// Format version.
    pub version: u32,
    /// Scalar and string metadata rendered as text (arrays summarized).
    pub metadata: BTreeMap<String, String>,
    /// Array metadata under `tokenizer.ggml.` (tokens, merges, token types, ...), each element rendered as
    /// text; other arrays are only summarized in `metadata`.
    pub arrays: BTreeMap<String, Vec<String>>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    data_start: u64,
    size: u64,
    /// The file's bytes when parsed from memory ([`GgufFile::from_bytes`]); else tensors are read from `path`.
    bytes: Option<Vec<u8>>,
}

struct Cursor<'a, R: Read> {
    r: R,
    pos: u64,
    /// The file's length: no field may claim more bytes than remain.
    size: u64,
    path: &'a Path,
    /// Whether to keep the elements of the next top-level array (the tokenizer's), and those kept.
    keep: bool,
    arr: Option<Vec<String>>,
}

impl<R: Read> Cursor<'_, R> {
    fn err(&self, m: impl std::fmt::Display) -> Error {
        Error::Format { path: self.path.to_path_buf(), message: m.to_string() }
    }
    fn bytes(&mut self, n: u64) -> Result<Vec<u8>> {
        if n > 1 << 30 {
            return Err(self.err(format!("corrupt: a field claims {n} bytes")));
        }
        // Checked before the buffer is allocated: a 40-byte file claiming a 1 GiB string costs nothing.
        let left = self.size.saturating_sub(self.pos);
        if n > left {
            return Err(self.err(format!("truncated: a field claims {n} bytes, {left} remain in the file")));
        }
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).map_err(|_| self.err("truncated"))?;
        self.pos += n;
        Ok(b)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|_| self.err("truncated"))?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        String::from_utf8(self.bytes(n)?).map_err(|_| self.err("corrupt: a string is not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<String> {
        Ok(match ty {
            0 => self.array::<1>()?[0].to_string(),
            1 => (self.array::<1>()?[0] as i8).to_string(),
            2 => u16::from_le_bytes(self.array()?).to_string(),
            3 => i16::from_le_bytes(self.array()?).to_string(),
            4 => self.u32()?.to_string(),
            5 => (self.u32()? as i32).to_string(),
            6 => f32::from_bits(self.u32()?).to_string(),
            7 => (self.array::<1>()?[0] != 0).to_string(),
            8 => self.string()?,
            9 => {
                if depth > 2 {
                    return Err(self.err("corrupt: nested arrays"));
                }
                let ety = self.u32()?;
                let n = self.u64()?;
                if n > 1 << 26 {
                    return Err(self.err(format!("corrupt: an array claims {n} entries")));
                }
                // Only the tokenizer's arrays are kept (as text, a few times their size in the file); the
                // others are read past.
                let keep = depth == 0 && self.keep;
                let mut items = Vec::new();
                for _ in 0..n {
                    let v = self.value(ety, depth + 1)?;
                    if keep {
                        items.push(v);
                    }
                }
                if keep {
                    self.arr = Some(items);
                }
                format!("[{n} values]")
            }
            10 => self.u64()?.to_string(),
            11 => (self.u64()? as i64).to_string(),
            12 => f64::from_bits(self.u64()?).to_string(),
            other => return Err(self.err(format!("corrupt: unknown metadata type {other}"))),
        })
    }
}

/// The product of `dims` as a `usize`, or None when it overflows.
fn checked_product(dims: &[u64]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
}

impl GgufFile {
    /// Reads the header and directory of `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let f = std::fs::File::open(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let size = f.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len();
        Self::parse(std::io::BufReader::new(f), size, path)
    }

    /// Parses a whole GGUF file held in memory; `name` only names it in errors. Tensors are then read from
    /// these bytes. Every size and offset is checked: no input makes this (or a tensor read) panic,
    /// allocate more than the file holds, or loop longer than the file is long (usable by a fuzzer).
    pub fn from_bytes(bytes: Vec<u8>, name: impl AsRef<Path>) -> Result<GgufFile> {
        let size = bytes.len() as u64;
        let header = Self::parse(bytes.as_slice(), size, name.as_ref())?;
        Ok(GgufFile { bytes: Some(bytes), ..header })
    }

    fn parse(r: impl Read, size: u64, path: &Path) -> Result<GgufFile> {
        let mut c = Cursor { r, pos: 0, size, path, keep: false, arr: None };
        if c.bytes(4).map_err(|_| c.err("not a GGUF file (too short)"))? != b"GGUF" {
            return Err(c.err("not a GGUF file (bad magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        if n_tensors > 1 << 24 || n_kv > 1 << 24 {
            return Err(c.err("corrupt: implausible tensor or metadata count"));
        }
        let mut metadata = BTreeMap::new();
        let mut arrays = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            c.keep = key.starts_with("tokenizer.ggml.");
            let v = c.value(ty, 0)?;
            if let Some(a) = c.arr.take() {
                arrays.insert(key.clone(), a);
            }
            metadata.insert(key, v);
        }
        let mut tensors = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd > 8 {
                return Err(c.err(format!("tensor '{name}': {nd} dimensions")));
            }
            let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = c.u32()?;
            let offset = c.u64()?;
            if checked_product(&dims).is_none() {
                return Err(c.err(format!("tensor '{name}': dims {dims:?} overflow")));
            }
            if tensors.contains_key(&name) {
                return Err(c.err(format!("tensor '{name}' appears twice")));
            }
            tensors.insert(name.clone(), TensorInfo { name, dims, ggml_type, offset });
        }
        let align: u64 = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .parse()
                .ok()
                .filter(|a: &u64| a.is_power_of_two())
                .ok_or_else(|| c.err(format!("general.alignment: {v} is not a power of two")))?,
        };
        let data_start = c
            .pos
            .div_ceil(align)
            .checked_mul(align)
            .ok_or_else(|| c.err(format!("general.alignment: {align} overflows the data offset")))?;
        for t in tensors.values() {
            if data_start.checked_add(t.offset).is_none() {
                return Err(c.err(format!("tensor '{}': offset {} overflows", t.name, t.offset)));
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, arrays, tensors, data_start, size, bytes: None })
    }

    /// The raw bytes of tensor `name` (`nbytes` long), after checking that they lie inside the file.
    fn raw(&self, info: &TensorInfo, nbytes: u64) -> Result<Vec<u8>> {
        let start = self.data_start.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(nbytes));
        let (Some(start), Some(end)) = (start, end.filter(|&e| e <= self.size)) else {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!(
                    "truncated: tensor '{}' needs {nbytes} bytes from byte {} + {}, the file has {}",
                    info.name, self.data_start, info.offset, self.size
                ),
            });
        };
        if let Some(b) = &self.bytes {
            return Ok(b[start as usize..end as usize].to_vec());
        }
        let mut f = std::fs::File::open(&self.path).map_err(|source| Error::Io { path: self.path.clone(), source })?;
        f.seek(SeekFrom::Start(start)).map_err(|source| Error::Io { path: self.path.clone(), source })?;
        let mut b = vec![0u8; nbytes as usize];
        f.read_exact(&mut b).map_err(|source| Error::Io { path: self.path.clone(), source })?;
        Ok(b)
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::Format { path: self.path.clone(), message: format!("no tensor named '{name}'") })
    }

    fn too_large(&self, name: &str, dims: &[u64]) -> Error {
        Error::Format { path: self.path.clone(), message: format!("tensor '{name}': dims {dims:?} are too large") }
    }

    /// Imports IQ1_S tensor `name` (`[rows, K]`) into the planar codebook layout, bit for bit.
    pub fn iq1s_tensor(&self, name: &str) -> Result<CodebookHost> {
        let info = self.info(name)?;
        if info.ggml_type != GGML_TYPE_IQ1_S {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!("tensor '{name}' has GGML type {}, not IQ1_S ({GGML_TYPE_IQ1_S})", info.ggml_type),
            });
        }
        if info.dims.is_empty() || info.dims[0] % SUPER_BLOCK as u64 != 0 {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!("tensor '{name}': inner dimension {:?} is not a multiple of 256", info.dims.first()),
            });
        }
        // MLX shapes are int32; the byte count is checked against the file before anything is allocated.
        let (k, rows) = (checked_product(&info.dims[..1]), checked_product(&info.dims[1..]));
        let (Some(k), Some(rows)) = (k.filter(|&k| k <= i32::MAX as usize), rows.filter(|&r| r <= i32::MAX as usize))
        else {
            return Err(self.too_large(name, &info.dims));
        };
        let nbytes = rows.checked_mul(k / SUPER_BLOCK).and_then(|b| b.checked_mul(IQ1S_BLOCK_BYTES));
        let nbytes = nbytes.ok_or_else(|| self.too_large(name, &info.dims))?;
        from_iq1s_blocks(&self.raw(info, nbytes as u64)?, rows, k)
    }

    /// The raw bytes of tensor `name` in its GGML type (F32, F16, BF16, Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or
    /// IQ1_S; any other type
    /// is an error naming it), after checking that its inner dimension is whole blocks and that the bytes
    /// lie inside the file.
    pub fn tensor_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let info = self.info(name)?;
        let Some((block, block_bytes)) = block_layout(info.ggml_type) else {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!(
                    "tensor '{name}' has GGML type {} ({}), which is not supported",
                    ggml_type_name(info.ggml_type),
                    info.ggml_type
                ),
            });
        };
        let inner = info.dims.first().copied().unwrap_or(1);
        if inner % block as u64 != 0 {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!(
                    "tensor '{name}' ({}): inner dimension {inner} is not a multiple of {block}",
                    ggml_type_name(info.ggml_type)
                ),
            });
        }
        let n = checked_product(&info.dims).filter(|&n| n <= 1 << 40);
        let nbytes = n.and_then(|n| (n / block).checked_mul(block_bytes));
        let nbytes = nbytes.ok_or_else(|| self.too_large(name, &info.dims))?;
        self.raw(info, nbytes as u64)
    }

    /// An F32 tensor's values.
    pub fn f32_tensor(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        if info.ggml_type != GGML_TYPE_F32 {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!("tensor '{name}' has GGML type {}, not F32", info.ggml_type),
            });
        }
        let nbytes = checked_product(&info.dims).and_then(|n| n.checked_mul(4));
        let nbytes = nbytes.ok_or_else(|| self.too_large(name, &info.dims))?;
        let b = self.raw(info, nbytes as u64)?;
        Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}
