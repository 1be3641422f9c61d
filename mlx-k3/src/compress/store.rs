//! Resumable, atomic output folders.
//!
//! Every file is written to a hidden temporary name in the destination folder, flushed to disk (`fsync`),
//! then renamed over its final name, and the folder is synced; so a file under its final name is always
//! complete. A journal (`.k3_journal.json`, rewritten the same way after each unit) records the finished
//! units with their size and SHA-256; a rerun with the same job fingerprint checks those files and skips
//! them, and a different fingerprint is refused. The last step writes `k3_manifest.json` and removes the
//! journal. Unit outputs depend only on their inputs, so an interrupted and resumed run leaves exactly the
//! bytes an uninterrupted one does.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{Array, Dtype, Error, Result};

/// The journal's file name.
pub const JOURNAL: &str = ".k3_journal.json";
/// The manifest's file name (written last).
pub const MANIFEST: &str = "k3_manifest.json";
const TMP_PREFIX: &str = ".k3_tmp.";

/// A tensor in host memory, ready to be written.
#[derive(Clone, Debug)]
pub struct HostTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

macro_rules! le_bytes {
    ($v:expr) => {
        $v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
    };
}

impl HostTensor {
    /// Copies an MLX array out (evaluating it).
    pub fn from_array(a: &Array) -> Result<HostTensor> {
        let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
        let data = match a.dtype() {
            Dtype::F32 => le_bytes!(a.to_vec::<f32>()?),
            Dtype::BF16 => le_bytes!(a.to_vec::<half::bf16>()?),
            Dtype::F16 => le_bytes!(a.to_vec::<half::f16>()?),
            Dtype::U8 => a.to_vec::<u8>()?,
            Dtype::U16 => le_bytes!(a.to_vec::<u16>()?),
            Dtype::U32 => le_bytes!(a.to_vec::<u32>()?),
            Dtype::I32 => le_bytes!(a.to_vec::<i32>()?),
            d => return Err(Error::invalid("store", format!("cannot write dtype {d}"))),
        };
        Ok(HostTensor { dtype: a.dtype(), shape, data })
    }

    /// f32 values stored as `dtype` (f32, bf16 or f16).
    pub fn floats(v: &[f32], shape: &[usize], dtype: Dtype) -> HostTensor {
        let data = match dtype {
            Dtype::BF16 => le_bytes!(v.iter().map(|x| half::bf16::from_f32(*x)).collect::<Vec<_>>()),
            Dtype::F16 => le_bytes!(v.iter().map(|x| half::f16::from_f32(*x)).collect::<Vec<_>>()),
            _ => le_bytes!(v),
        };
        let dtype = if matches!(dtype, Dtype::BF16 | Dtype::F16) { dtype } else { Dtype::F32 };
        HostTensor { dtype, shape: shape.to_vec(), data }
    }

    /// uint32 words.
    pub fn u32s(v: &[u32], shape: &[usize]) -> HostTensor {
        HostTensor { dtype: Dtype::U32, shape: shape.to_vec(), data: le_bytes!(v) }
    }

    /// Bytes of the tensor data.
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// The tensor as an MLX array.
    pub fn to_array(&self) -> Result<Array> {
        let shape: Vec<i32> = self.shape.iter().map(|&d| d as i32).collect();
        let d = &self.data;
        macro_rules! from {
            ($t:ty, $n:expr) => {
                Array::from_vec(
                    d.chunks_exact($n).map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or([0; $n]))).collect(),
                    &shape,
                )
            };
        }
        match self.dtype {
            Dtype::F32 => from!(f32, 4),
            Dtype::U32 => from!(u32, 4),
            Dtype::I32 => from!(i32, 4),
            Dtype::U16 => from!(u16, 2),
            Dtype::BF16 => Array::from_vec(
                d.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
                &shape,
            ),
            Dtype::F16 => Array::from_vec(
                d.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
                &shape,
            ),
            Dtype::U8 => Array::from_vec(d.clone(), &shape),
            other => Err(Error::invalid("store", format!("dtype {other} not supported"))),
        }
    }

    fn st_dtype(&self) -> Result<safetensors::Dtype> {
        Ok(match self.dtype {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::BF16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::U8 => safetensors::Dtype::U8,
            Dtype::U16 => safetensors::Dtype::U16,
            Dtype::U32 => safetensors::Dtype::U32,
            Dtype::I32 => safetensors::Dtype::I32,
            d => return Err(Error::invalid("store", format!("cannot write dtype {d}"))),
        })
    }
}

/// Serializes tensors to safetensors bytes (header sorted, one metadata key `format: mlx`, as mlx-lm writes).
pub fn safetensors_bytes(tensors: &[(String, HostTensor)]) -> Result<Vec<u8>> {
    safetensors_bytes_with(tensors, ("format", "mlx"))
}

/// [`safetensors_bytes`] with one given metadata entry (one entry only: the header stays deterministic).
pub fn safetensors_bytes_with(tensors: &[(String, HostTensor)], meta: (&str, &str)) -> Result<Vec<u8>> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let v = safetensors::tensor::TensorView::new(t.st_dtype()?, t.shape.clone(), &t.data)
            .map_err(|e| Error::invalid("store", format!("tensor '{name}': {e}")))?;
        views.push((name.clone(), v));
    }
    let meta = std::collections::HashMap::from([(meta.0.to_string(), meta.1.to_string())]);
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::invalid("store", e.to_string()))
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn io<T>(path: &Path, r: std::io::Result<T>) -> Result<T> {
    r.map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// Writes `bytes` to `dir/name` atomically: temporary file, fsync, rename, fsync of the folder.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!("{TMP_PREFIX}{name}"));
    let dst = dir.join(name);
    {
        let mut f = io(&tmp, fs::File::create(&tmp))?;
        io(&tmp, f.write_all(bytes))?;
        io(&tmp, f.sync_all())?;
    }
    io(&dst, fs::rename(&tmp, &dst))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<()> {
    // Directories cannot be opened for syncing on every platform; where they can, this makes the rename durable.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// What was written for one unit.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UnitRecord {
    /// File name in the output folder.
    pub file: String,
    /// Its size.
    pub bytes: u64,
    /// Its SHA-256.
    pub sha256: String,
    /// Tensor names (with shapes) it holds.
    pub tensors: Vec<String>,
    /// The unit's report (errors, formats), deterministic.
    pub report: Value,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Journal {
    fingerprint: String,
    units: BTreeMap<usize, UnitRecord>,
}

/// How an output folder was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Nothing there yet.
    Fresh,
    /// A previous run of the same job finished this many units.
    Resumed(usize),
    /// The same job already completed here.
    Complete,
}

/// An output folder being written.
pub struct Output {
    dir: PathBuf,
    journal: Journal,
}

impl Output {
    /// Opens (or creates) `dir` for a job with `fingerprint`. With `overwrite`, anything there is removed
    /// first; otherwise only a folder that is empty or holds this same job (partial or complete) is accepted.
    pub fn open(dir: &Path, fingerprint: &str, overwrite: bool) -> Result<(Output, Resume)> {
        let fmt = |message: String| Error::Format { path: dir.to_path_buf(), message };
        let fresh = || Journal { fingerprint: fingerprint.to_string(), units: BTreeMap::new() };
        if dir.exists() && overwrite {
            io(dir, fs::remove_dir_all(dir))?;
        }
        if !dir.exists() {
            io(dir, fs::create_dir_all(dir))?;
            return Ok((Output { dir: dir.to_path_buf(), journal: fresh() }, Resume::Fresh));
        }
        let entries: Vec<String> = io(dir, fs::read_dir(dir))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        for e in entries.iter().filter(|e| e.starts_with(TMP_PREFIX)) {
            let p = dir.join(e);
            io(&p, fs::remove_file(&p))?;
        }
        let read_fp = |name: &str| -> Result<Option<Value>> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            let text = io(&p, fs::read_to_string(&p))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::Format { path: p.clone(), message: format!("not valid JSON: {e}") })?;
            Ok(Some(v))
        };
        let mismatch = |found: &str| {
            fmt(format!(
                "holds the output of another job (fingerprint {found}, this job {fingerprint}): different \
                 source, recipe, calibration or options; remove it or pass --overwrite"
            ))
        };
        let journal = read_fp(JOURNAL)?;
        if let Some(m) = read_fp(MANIFEST)? {
            let found = m.get("fingerprint").and_then(Value::as_str).unwrap_or("?");
            if found != fingerprint {
                return Err(mismatch(found));
            }
            if journal.is_none() {
                return Ok((Output { dir: dir.to_path_buf(), journal: fresh() }, Resume::Complete));
            }
        }
        match journal {
            Some(j) => {
                let j: Journal = serde_json::from_value(j)
                    .map_err(|e| Error::Format { path: dir.join(JOURNAL), message: format!("corrupt journal: {e}") })?;
                if j.fingerprint != fingerprint {
                    return Err(mismatch(&j.fingerprint));
                }
                let mut out = Output { dir: dir.to_path_buf(), journal: fresh() };
                for (unit, rec) in j.units {
                    // A unit counts only when its file is there with the recorded size and hash.
                    let p = dir.join(&rec.file);
                    let ok = fs::metadata(&p).is_ok_and(|m| m.len() == rec.bytes)
                        && fs::read(&p).is_ok_and(|b| sha256_hex(&b) == rec.sha256);
                    if ok {
                        out.journal.units.insert(unit, rec);
                    }
                }
                let n = out.journal.units.len();
                Ok((out, Resume::Resumed(n)))
            }
            None if entries.iter().all(|e| e.starts_with(TMP_PREFIX)) => {
                Ok((Output { dir: dir.to_path_buf(), journal: fresh() }, Resume::Fresh))
            }
            None => {
                Err(fmt("is not empty and holds no mlx-k3 output; choose another folder or pass --overwrite".into()))
            }
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The record of a finished unit.
    pub fn done(&self, unit: usize) -> Option<&UnitRecord> {
        self.journal.units.get(&unit)
    }

    /// Every finished unit.
    pub fn records(&self) -> &BTreeMap<usize, UnitRecord> {
        &self.journal.units
    }

    /// Writes one unit's tensors as `file` and records it in the journal.
    pub fn write_unit(
        &mut self,
        unit: usize,
        file: &str,
        tensors: &[(String, HostTensor)],
        report: Value,
    ) -> Result<&UnitRecord> {
        let bytes = safetensors_bytes(tensors)?;
        write_atomic(&self.dir, file, &bytes)?;
        let mut names: Vec<String> =
            tensors.iter().map(|(n, t)| format!("{n} {} {:?}", t.dtype.name(), t.shape)).collect();
        names.sort();
        let rec = UnitRecord {
            file: file.to_string(),
            bytes: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
            tensors: names,
            report,
        };
        self.journal.units.insert(unit, rec);
        let j = serde_json::to_vec_pretty(&self.journal).map_err(|e| Error::invalid("store", e.to_string()))?;
        write_atomic(&self.dir, JOURNAL, &j)?;
        Ok(&self.journal.units[&unit])
    }

    /// Writes a small file atomically.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_atomic(&self.dir, name, bytes)
    }

    /// Writes the manifest (last) and removes the journal.
    pub fn finish(self, manifest: &Value) -> Result<()> {
        let mut text = serde_json::to_string_pretty(manifest).map_err(|e| Error::invalid("store", e.to_string()))?;
        text.push('\n');
        write_atomic(&self.dir, MANIFEST, text.as_bytes())?;
        let j = self.dir.join(JOURNAL);
        if j.exists() {
            io(&j, fs::remove_file(&j))?;
        }
        sync_dir(&self.dir)
    }
}

/// A deterministic fingerprint of a job description (SHA-256 of its canonical JSON).
pub fn fingerprint(job: &Value) -> String {
    sha256_hex(serde_json::to_string(job).unwrap_or_default().as_bytes())[..16].to_string()
}

/// Identifies a source checkpoint without reading its tensor data: config.json and each shard's name,
/// size and header hash.
pub fn source_identity(dir: &Path) -> Result<Value> {
    let cfg_path = dir.join("config.json");
    let cfg = io(&cfg_path, fs::read(&cfg_path))?;
    let mut shards = Vec::new();
    for f in crate::model::loader::weight_files(dir)? {
        let mut file = io(&f, fs::File::open(&f))?;
        let size = io(&f, file.metadata())?.len();
        let mut len = [0u8; 8];
        io(&f, std::io::Read::read_exact(&mut file, &mut len))?;
        let n = u64::from_le_bytes(len).min(size.saturating_sub(8)) as usize;
        let mut header = vec![0u8; n];
        io(&f, std::io::Read::read_exact(&mut file, &mut header))?;
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        shards.push(serde_json::json!({"file": name, "bytes": size, "header_sha256": sha256_hex(&header)}));
    }
    Ok(serde_json::json!({"config_sha256": sha256_hex(&cfg), "shards": shards}))
}
