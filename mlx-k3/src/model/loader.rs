//! Reading a checkpoint's weights: safetensors shards (with or without `model.safetensors.index.json`),
//! validated before MLX sees them, opened lazily (bytes are read when evaluated), and translated from the
//! original release names to mlx-lm's names in one place ([`sanitize`], mirroring mlx-lm's
//! `Model.sanitize` / `LanguageModel.sanitize` for `kimi_k3`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::TextConfig;
use crate::io::Safetensors;
use crate::quant::{self, QuantMode, QuantSpec};
use crate::{ops, Array, Dtype, Error, Result};

/// The tensors of a checkpoint under mlx-lm's sanitized names (without the `language_model.` prefix), each
/// remembering the file it came from.
#[derive(Default)]
pub struct RawWeights {
    /// Tensors by sanitized name.
    pub tensors: BTreeMap<String, Array>,
    /// The file each original tensor came from (for error messages).
    pub files: BTreeMap<String, PathBuf>,
    /// Where the bytes of each tensor that is stored as-is (not made by a sanitize step) lie, so parts of
    /// it can be read without reading the rest.
    pub locs: BTreeMap<String, TensorLoc>,
    /// Expert stacks that sanitize built from a range of the per-expert tensors only (expert parallel):
    /// they already hold just that range of rows.
    pub presliced: BTreeMap<String, Range<usize>>,
    /// The original (release) name a sanitize step made a tensor from, for error messages
    /// (`model.layers.1.block_sparse_moe.experts.*.w2.weight_scale` for a stack of experts).
    pub origins: BTreeMap<String, String>,
}

/// Where one tensor's bytes lie in a safetensors file.
#[derive(Clone, Debug)]
pub struct TensorLoc {
    /// The file.
    pub path: PathBuf,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute file offset of the first byte.
    pub offset: u64,
}

impl TensorLoc {
    /// Reads rows `ranges` (along axis 0, concatenated) into a new array, touching no other byte.
    pub fn read_rows(&self, ranges: &[Range<usize>]) -> Result<Array> {
        use std::os::unix::fs::FileExt;
        let rows = *self.shape.first().unwrap_or(&1);
        let row_bytes = self.shape.iter().skip(1).product::<usize>() * self.dtype.size_of();
        let kept: usize = ranges.iter().map(|r| r.len()).sum();
        let mut buf = vec![0u8; kept * row_bytes];
        let f = fs::File::open(&self.path).map_err(|source| Error::Io { path: self.path.clone(), source })?;
        let mut at = 0;
        for r in ranges {
            if r.end > rows || r.start > r.end {
                return Err(Error::invalid("load", format!("rows {r:?} of a tensor with {rows} rows")));
            }
            let n = r.len() * row_bytes;
            f.read_exact_at(&mut buf[at..at + n], self.offset + (r.start * row_bytes) as u64)
                .map_err(|source| Error::Io { path: self.path.clone(), source })?;
            at += n;
        }
        let mut shape: Vec<i32> = self.shape.iter().map(|&d| d as i32).collect();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] = kept as i32;
        crate::io::array_from_bytes(&buf, &shape, self.dtype)
    }
}

/// How many values of one tensor are NaN and how many are infinite.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NonFinite {
    /// NaN values.
    pub nan: u64,
    /// +Inf and -Inf values.
    pub inf: u64,
}

impl NonFinite {
    /// Whether there is any.
    pub fn any(&self) -> bool {
        self.nan + self.inf > 0
    }

    /// Counts the NaN and Inf values in little-endian `bytes` of `dtype`; None for non-float dtypes
    /// (a trailing partial value is ignored).
    pub fn count(bytes: &[u8], dtype: Dtype) -> Option<NonFinite> {
        // (exponent mask, mantissa mask) of each float format: all exponent bits set is Inf (mantissa 0)
        // or NaN.
        fn tally<const N: usize>(bytes: &[u8], exp: u64, man: u64) -> NonFinite {
            let mut c = NonFinite::default();
            for v in bytes.chunks_exact(N) {
                let mut b = [0u8; 8];
                b[..N].copy_from_slice(v);
                let bits = u64::from_le_bytes(b);
                if bits & exp == exp {
                    if bits & man == 0 {
                        c.inf += 1;
                    } else {
                        c.nan += 1;
                    }
                }
            }
            c
        }
        Some(match dtype {
            Dtype::F16 => tally::<2>(bytes, 0x7c00, 0x03ff),
            Dtype::BF16 => tally::<2>(bytes, 0x7f80, 0x007f),
            Dtype::F32 => tally::<4>(bytes, 0x7f80_0000, 0x007f_ffff),
            Dtype::F64 => tally::<8>(bytes, 0x7ff0_0000_0000_0000, 0x000f_ffff_ffff_ffff),
            _ => return None,
        })
    }
}

impl TensorLoc {
    /// Counts NaN and Inf values by reading the tensor's bytes from its file in 8 MiB pieces (memory stays
    /// bounded whatever the tensor's size); None for non-float dtypes.
    pub fn count_non_finite(&self) -> Result<Option<NonFinite>> {
        use std::os::unix::fs::FileExt;
        if NonFinite::count(&[], self.dtype).is_none() {
            return Ok(None);
        }
        let total = self.shape.iter().product::<usize>() as u64 * self.dtype.size_of() as u64;
        let f = fs::File::open(&self.path).map_err(|source| Error::Io { path: self.path.clone(), source })?;
        // 8 MiB: a whole number of values of every float dtype.
        let piece = 8 << 20;
        let mut buf = vec![0u8; piece.min(total as usize)];
        let mut counts = NonFinite::default();
        let mut done = 0u64;
        while done < total {
            let n = ((total - done) as usize).min(buf.len());
            f.read_exact_at(&mut buf[..n], self.offset + done)
                .map_err(|source| Error::Io { path: self.path.clone(), source })?;
            let c = NonFinite::count(&buf[..n], self.dtype).unwrap_or_default();
            counts.nan += c.nan;
            counts.inf += c.inf;
            done += n as u64;
        }
        Ok(Some(counts))
    }
}

/// Scans every float tensor in the `model*.safetensors` files of `dir` for NaN and Inf (reads all tensor
/// data, one piece at a time); `progress(done, total)` counts tensors. Returns each file, tensor and counts
/// that have any, in file and name order, and how many float tensors were scanned.
pub fn scan_non_finite(
    dir: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<(PathBuf, String, NonFinite)>, usize)> {
    let mut all = Vec::new();
    for path in weight_files(dir)? {
        all.extend(validate_safetensors(&path)?.into_iter().map(|(name, loc)| (path.clone(), name, loc)));
    }
    let mut bad = Vec::new();
    let mut scanned = 0;
    for (i, (path, name, loc)) in all.iter().enumerate() {
        progress(i, all.len());
        if let Some(c) = loc.count_non_finite()? {
            scanned += 1;
            if c.any() {
                bad.push((path.clone(), name.clone(), c));
            }
        }
    }
    progress(all.len(), all.len());
    Ok((bad, scanned))
}

/// The `model*.safetensors` files of `dir` (as mlx-lm globs them), checked against the index when present.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = fs::read_dir(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = fs::read_to_string(&index).map_err(|source| Error::Io { path: index.clone(), source })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Format { path: index.clone(), message: format!("not valid JSON: {e}") })?;
        let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| Error::Format {
            path: index.clone(),
            message: "weight_map: missing or not an object".into(),
        })?;
        let named: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        for f in named {
            if !dir.join(f).exists() {
                return Err(Error::Format {
                    path: index.clone(),
                    message: format!("lists shard '{f}', which is missing"),
                });
            }
        }
    }
    if files.is_empty() {
        return Err(Error::Format { path: dir.to_path_buf(), message: "no model*.safetensors files".into() });
    }
    Ok(files)
}

/// Checks a safetensors file's header against its size before MLX maps it: a truncated or corrupt file
/// becomes an error naming the file (and the tensor), never a read past the end. Returns where each
/// tensor of a dtype MLX reads lies.
pub fn validate_safetensors(path: &Path) -> Result<BTreeMap<String, TensorLoc>> {
    let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
    let mut f = fs::File::open(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let size = f.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len();
    let mut start = vec![0u8; 8];
    f.read_exact(&mut start).map_err(|_| fmt(format!("truncated: {size} bytes, no header")))?;
    let n = u64::from_le_bytes([start[0], start[1], start[2], start[3], start[4], start[5], start[6], start[7]]);
    if n > size.saturating_sub(8) || n > MAX_HEADER_BYTES {
        return Err(fmt(format!("corrupt or truncated: header of {n} bytes in a file of {size}")));
    }
    start.resize(8 + n as usize, 0);
    f.read_exact(&mut start[8..]).map_err(|_| fmt("truncated inside the header".into()))?;
    parse_safetensors_header(&start, size, path)
}

/// The largest safetensors header read (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Parses and checks the start of a safetensors file: `bytes` holds its first bytes (the 8-byte header
/// length and at least the JSON header; the whole file will do), `file_size` is the file's length and
/// `path` only names it in errors. Returns where each tensor of a dtype MLX reads lies.
///
/// Checked, with errors naming the file and the tensor: the header length against the file, that the
/// header is a JSON object of tensors, each with a known dtype, a shape of whole numbers each at most
/// `i32::MAX` (MLX shapes are int32) and `data_offsets` of two whole numbers that span exactly the shape's
/// bytes (computed without overflow) inside the data, and that no two tensors share a byte. Usable without
/// a file or a model (e.g. by a fuzzer).
pub fn parse_safetensors_header(bytes: &[u8], file_size: u64, path: &Path) -> Result<BTreeMap<String, TensorLoc>> {
    let fmt = |message: String| Error::Format { path: path.to_path_buf(), message };
    let Some(len) = bytes.get(..8) else {
        return Err(fmt(format!("truncated: {file_size} bytes, no header")));
    };
    let n = u64::from_le_bytes([len[0], len[1], len[2], len[3], len[4], len[5], len[6], len[7]]);
    if n > file_size.saturating_sub(8) || n > MAX_HEADER_BYTES {
        return Err(fmt(format!("corrupt or truncated: header of {n} bytes in a file of {file_size}")));
    }
    let header = bytes.get(8..8 + n as usize).ok_or_else(|| fmt("truncated inside the header".into()))?;
    let v: Value = serde_json::from_slice(header).map_err(|e| fmt(format!("corrupt header: {e}")))?;
    let obj = v.as_object().ok_or_else(|| fmt("corrupt header: not a JSON object".into()))?;
    let data = file_size - 8 - n;
    let mut locs = BTreeMap::new();
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: String| fmt(format!("tensor '{name}': {m}"));
        let dtype = t.get("dtype").and_then(Value::as_str).unwrap_or("");
        let (item, dt): (u64, Option<Dtype>) = match dtype {
            "BOOL" => (1, Some(Dtype::Bool)),
            "U8" => (1, Some(Dtype::U8)),
            "I8" => (1, Some(Dtype::I8)),
            "F8_E4M3" | "F8_E5M2" => (1, None),
            "U16" => (2, Some(Dtype::U16)),
            "I16" => (2, Some(Dtype::I16)),
            "F16" => (2, Some(Dtype::F16)),
            "BF16" => (2, Some(Dtype::BF16)),
            "U32" => (4, Some(Dtype::U32)),
            "I32" => (4, Some(Dtype::I32)),
            "F32" => (4, Some(Dtype::F32)),
            "U64" => (8, Some(Dtype::U64)),
            "I64" => (8, Some(Dtype::I64)),
            "F64" => (8, Some(Dtype::F64)),
            "C64" => (8, None),
            other => return Err(bad(format!("unsupported dtype '{other}'"))),
        };
        let whole = |v: &Value| v.as_u64();
        let shape: Vec<u64> = match t.get("shape").and_then(Value::as_array) {
            Some(a) => {
                a.iter().map(whole).collect::<Option<_>>().ok_or_else(|| bad(format!("bad shape {}", t["shape"])))?
            }
            None => return Err(bad("no shape".into())),
        };
        if let Some(d) = shape.iter().find(|&&d| d > i32::MAX as u64) {
            return Err(bad(format!("dimension {d} of shape {shape:?} is larger than MLX's int32 shapes allow")));
        }
        let offs: Vec<u64> = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(whole).collect::<Option<Vec<u64>>>())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad("no data_offsets (two whole numbers)".into()))?;
        let want = shape.iter().try_fold(item, |acc, &d| acc.checked_mul(d));
        let Some(want) = want else {
            return Err(bad(format!("shape {shape:?} x {dtype} overflows 64 bits")));
        };
        if offs[1] < offs[0] || offs[1] - offs[0] != want {
            return Err(bad(format!("data_offsets {offs:?} do not hold {shape:?} x {dtype}")));
        }
        if offs[1] > data {
            return Err(fmt(format!(
                "truncated: tensor '{name}' ends at byte {} of the data, but the file holds {data} bytes of data",
                offs[1]
            )));
        }
        if want > 0 {
            spans.push((offs[0], offs[1], name));
        }
        if let Some(dtype) = dt {
            let shape = shape.iter().map(|&d| d as usize).collect();
            locs.insert(name.clone(), TensorLoc { path: path.to_path_buf(), dtype, shape, offset: 8 + n + offs[0] });
        }
    }
    // Two tensors over the same bytes would alias: one file's corruption read as two weights.
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(fmt(format!(
            "corrupt: tensors '{}' (bytes {}..{}) and '{}' (bytes {}..{}) overlap",
            w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
        )));
    }
    Ok(locs)
}

/// Tensor-name prefixes of a multimodal checkpoint's media encoder (tower and projector): never part of the
/// text model.
pub const MEDIA_PREFIXES: [&str; 4] = ["vision_tower", "vision_model", "multi_modal_projector", "mm_projector"];
const SKIPPED_PREFIXES: [&str; 4] = MEDIA_PREFIXES;

/// Whether tensor `name` belongs to the media encoder (see [`MEDIA_PREFIXES`]).
pub fn is_media_tensor(name: &str) -> bool {
    MEDIA_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Whether any weight file of `dir` holds a media-encoder tensor (headers only).
pub fn has_media_tensors(dir: &Path) -> Result<bool> {
    for path in weight_files(dir)? {
        if validate_safetensors(&path)?.keys().any(|k| is_media_tensor(k)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The media encoder's tensors of `dir` (lazily opened), under their stored names, with the file each is in;
/// a name in two files is an error naming both.
pub fn read_media_tensors(dir: &Path) -> Result<BTreeMap<String, (Array, PathBuf)>> {
    let mut out: BTreeMap<String, (Array, PathBuf)> = BTreeMap::new();
    for path in weight_files(dir)? {
        validate_safetensors(&path)?;
        let st = Safetensors::load(&path)?;
        for key in st.keys().into_iter().filter(|k| is_media_tensor(k)) {
            if let Some((_, prev)) = out.get(&key) {
                return Err(Error::Format {
                    path: path.clone(),
                    message: format!("tensor '{key}' also appears in {}", prev.display()),
                });
            }
            let a = st.get(&key)?;
            out.insert(key, (a, path.clone()));
        }
    }
    Ok(out)
}

/// Opens every shard of `dir` lazily and returns the tensors under sanitized names. With `experts`, release
/// checkpoints' per-expert tensors are stacked for that range of experts only (the rest are never read).
pub fn read_weights(dir: &Path, cfg: &TextConfig, experts: Option<Range<usize>>) -> Result<RawWeights> {
    read_weights_where(dir, cfg, experts, &|_| true)
}

/// [`read_weights`] of the tensors whose name (without `language_model.`) satisfies `keep` only; the others
/// are never opened (the multi-token-prediction layer is read this way, apart from the model).
pub fn read_weights_where(
    dir: &Path,
    cfg: &TextConfig,
    experts: Option<Range<usize>>,
    keep: &dyn Fn(&str) -> bool,
) -> Result<RawWeights> {
    let mut tensors = BTreeMap::new();
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut locs = BTreeMap::new();
    for path in weight_files(dir)? {
        let file_locs = validate_safetensors(&path)?;
        let st = Safetensors::load(&path)?;
        for key in st.keys() {
            let name = key.strip_prefix("language_model.").unwrap_or(&key).to_string();
            if SKIPPED_PREFIXES.iter().any(|p| key.starts_with(p)) || !keep(&name) {
                continue;
            }
            if let Some(prev) = files.get(&name) {
                return Err(Error::Format {
                    path: path.clone(),
                    message: format!("tensor '{key}' also appears in {}", prev.display()),
                });
            }
            tensors.insert(name.clone(), st.get(&key)?);
            if let Some(l) = file_locs.get(&key) {
                locs.insert(name.clone(), l.clone());
            }
            files.insert(name, path.clone());
        }
    }
    let mut raw = RawWeights { tensors, files, locs, presliced: BTreeMap::new(), origins: BTreeMap::new() };
    sanitize(&mut raw, cfg, experts)?;
    Ok(raw)
}

impl RawWeights {
    fn take(&mut self, name: &str) -> Option<Array> {
        self.locs.remove(name);
        self.tensors.remove(name)
    }

    /// Inserts a tensor made by a sanitize step from `from`'s.
    fn put(&mut self, name: String, a: Array, from: &str) {
        let file = self.files.get(from).cloned().unwrap_or_default();
        self.files.insert(name.clone(), file);
        self.locs.remove(&name);
        if name != from {
            let origin = self.origins.get(from).cloned().unwrap_or_else(|| from.to_string());
            self.origins.insert(name.clone(), origin);
        }
        self.tensors.insert(name, a);
    }

    /// An error about original tensor `name`, naming its file.
    fn tensor_error(&self, name: &str, message: String) -> Error {
        let path = self.files.get(name).cloned().unwrap_or_default();
        Error::Format { path, message: format!("tensor '{name}' {message}") }
    }

    /// Moves a tensor to a new name; its bytes stay where they are.
    fn rename(&mut self, from: &str, to: String) {
        let loc = self.locs.remove(from);
        if let Some(a) = self.take(from) {
            self.put(to.clone(), a, from);
            if let Some(l) = loc {
                self.locs.insert(to, l);
            }
        }
    }

    /// Stacks `{prefix}.experts.{i}.{leaf}` for the experts in `range` (of `n`); the others are dropped
    /// unread.
    fn stack_experts(&mut self, prefix: &str, n: usize, range: &Range<usize>, leaf: &str) -> Result<Option<Array>> {
        if !self.tensors.contains_key(&format!("{prefix}.experts.0.{leaf}")) {
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(range.len());
        let mut first: Option<(String, Vec<i32>, Dtype)> = None;
        for i in 0..n {
            let key = format!("{prefix}.experts.{i}.{leaf}");
            let a = self.take(&key).ok_or_else(|| Error::invalid("load", format!("missing tensor '{key}'")))?;
            // Checked from the header, also for experts outside `range` (never read).
            let (shape, dtype) = (a.shape(), a.dtype());
            match &first {
                Some((k0, s0, d0)) if (&shape, dtype) != (s0, *d0) => {
                    return Err(self.tensor_error(
                        &key,
                        format!(
                            "is {dtype} {shape:?}, but '{k0}' is {d0} {s0:?}: the experts of a layer must all have \
                             one shape and dtype (corrupt or truncated?)"
                        ),
                    ));
                }
                Some(_) => {}
                None => first = Some((key.clone(), shape, dtype)),
            }
            if range.contains(&i) {
                parts.push(a);
            }
        }
        let refs: Vec<&Array> = parts.iter().collect();
        Ok(Some(ops::stack(&refs, 0)?))
    }
}

/// Checks a stack of compressed-tensors MXFP4 experts (`[E, out, in/2]` uint8 code pairs, `[E, out, groups]`
/// uint8 E8M0 scales) before its codes are viewed as MLX's uint32 words; errors name the release tensors.
fn check_mxfp4_pack(w: &RawWeights, packed: &Array, scales: &Array, from: &str, sfrom: &str) -> Result<()> {
    let all = |name: &str| name.replacen(".experts.0.", ".experts.*.", 1);
    for (a, name, what) in [(packed, from, "codes (two E2M1 a byte)"), (scales, sfrom, "scales (E8M0)")] {
        if a.dtype() != Dtype::U8 || a.ndim() != 3 {
            return Err(w.tensor_error(
                name,
                format!(
                    "is {} {:?} per expert: compressed-tensors MXFP4 {what} are 2-D uint8 ('{}')",
                    a.dtype(),
                    &a.shape()[1..],
                    all(name)
                ),
            ));
        }
    }
    let (rows, bytes) = (packed.dim(1)?, packed.dim(2)?);
    let (srows, groups) = (scales.dim(1)?, scales.dim(2)?);
    let inputs = 2 * bytes;
    if srows != rows || groups == 0 || bytes % 4 != 0 || inputs % groups != 0 {
        return Err(w.tensor_error(
            sfrom,
            format!(
                "is uint8 [{srows}, {groups}] per expert, which does not fit the codes '{}' (uint8 [{rows}, {bytes}]: \
                 {inputs} inputs of {rows} rows, in whole groups and uint32 words)",
                all(from)
            ),
        ));
    }
    Ok(())
}

/// Translates release names into mlx-lm's (a no-op on checkpoints `mlx_lm.convert` wrote).
pub fn sanitize(w: &mut RawWeights, cfg: &TextConfig, expert_range: Option<Range<usize>>) -> Result<()> {
    let n_layers = cfg.num_hidden_layers;
    let keys: Vec<String> = w.tensors.keys().cloned().collect();
    for k in &keys {
        let drop_layer = k
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i >= n_layers);
        if k.starts_with("model.mtp") || k.starts_with("mtp") || drop_layer {
            w.tensors.remove(k);
        }
    }
    if cfg.tie_word_embeddings {
        w.tensors.remove("lm_head.weight");
    }
    let keys: Vec<String> = w.tensors.keys().cloned().collect();
    for k in keys {
        for src in ["self_attention_res", "mlp_res", "output_attn_res"] {
            for (leaf, dst) in [("proj_weight", "proj.weight"), ("norm_weight", "norm.weight")] {
                if let Some(stem) = k.strip_suffix(&format!("{src}.{leaf}")) {
                    w.rename(&k, format!("{stem}{src}_{dst}"));
                }
            }
        }
    }

    let experts = cfg.num_experts.unwrap_or(0);
    let erange = expert_range.clone().unwrap_or(0..experts);
    if erange.end > experts {
        return Err(Error::invalid("load", format!("expert range {erange:?} of a model with {experts} experts")));
    }
    for i in 0..n_layers {
        let lp = format!("model.layers.{i}");
        if cfg.is_moe(i) {
            let src = format!("{lp}.block_sparse_moe");
            let dst = format!("{lp}.mlp");
            for (s, d) in [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")] {
                let stacked = |w: &mut RawWeights, name: String| {
                    if expert_range.is_some() {
                        w.presliced.insert(name, erange.clone());
                    }
                };
                if let Some(packed) = w.stack_experts(&src, experts, &erange, &format!("{s}.weight_packed"))? {
                    // compressed-tensors MXFP4: uint8 codes viewed as MLX's uint32 words, E8M0 scales.
                    let scales =
                        w.stack_experts(&src, experts, &erange, &format!("{s}.weight_scale"))?.ok_or_else(|| {
                            Error::invalid("load", format!("missing tensor '{src}.experts.0.{s}.weight_scale'"))
                        })?;
                    let from = format!("{src}.experts.0.{s}.weight_packed");
                    let sfrom = format!("{src}.experts.0.{s}.weight_scale");
                    check_mxfp4_pack(w, &packed, &scales, &from, &sfrom)?;
                    w.put(format!("{dst}.switch_mlp.{d}.weight"), packed.view(Dtype::U32)?, &from);
                    w.put(format!("{dst}.switch_mlp.{d}.scales"), scales, &sfrom);
                    for (leaf, name) in [("weight_packed", "weight"), ("weight_scale", "scales")] {
                        w.origins.insert(format!("{dst}.switch_mlp.{d}.{name}"), format!("{src}.experts.*.{s}.{leaf}"));
                    }
                    stacked(w, format!("{dst}.switch_mlp.{d}.weight"));
                    stacked(w, format!("{dst}.switch_mlp.{d}.scales"));
                } else {
                    for suffix in ["weight", "scales", "biases"] {
                        if let Some(a) = w.stack_experts(&src, experts, &erange, &format!("{s}.{suffix}"))? {
                            let from = format!("{src}.experts.0.{s}.{suffix}");
                            w.put(format!("{dst}.switch_mlp.{d}.{suffix}"), a, &from);
                            stacked(w, format!("{dst}.switch_mlp.{d}.{suffix}"));
                        }
                    }
                }
            }
            for name in [
                "shared_experts.gate_proj",
                "shared_experts.up_proj",
                "shared_experts.down_proj",
                "routed_expert_down_proj",
                "routed_expert_up_proj",
                "routed_expert_norm",
                "gate",
                "switch_mlp.gate_proj",
                "switch_mlp.up_proj",
                "switch_mlp.down_proj",
            ] {
                for suffix in ["weight", "scales", "biases"] {
                    w.rename(&format!("{src}.{name}.{suffix}"), format!("{dst}.{name}.{suffix}"));
                }
            }
            if cfg.family == super::config::Family::DeepseekV3 {
                // Hugging Face DeepSeek-V3 names: per-expert `mlp.experts.{e}.{gate,up,down}_proj`.
                for name in ["gate_proj", "down_proj", "up_proj"] {
                    for suffix in ["weight", "scales", "biases"] {
                        if let Some(a) = w.stack_experts(&dst, experts, &erange, &format!("{name}.{suffix}"))? {
                            let from = format!("{dst}.experts.0.{name}.{suffix}");
                            w.put(format!("{dst}.switch_mlp.{name}.{suffix}"), a, &from);
                            if expert_range.is_some() {
                                w.presliced.insert(format!("{dst}.switch_mlp.{name}.{suffix}"), erange.clone());
                            }
                        }
                    }
                }
            }
            for b in [
                format!("{src}.gate.e_score_correction_bias"),
                format!("{src}.e_score_correction_bias"),
                format!("{dst}.gate.e_score_correction_bias"),
            ] {
                w.rename(&b, format!("{dst}.e_score_correction_bias"));
            }
        }

        let ap = format!("{lp}.self_attn");
        if cfg.is_kda(i) {
            for (s, d) in [("q_conv1d", "q_conv"), ("k_conv1d", "k_conv"), ("v_conv1d", "v_conv")] {
                let key = format!("{ap}.{s}.weight");
                if let Some(a) = w.take(&key) {
                    let a = if a.ndim() == 3 { a.moveaxis(2, 1)? } else { a };
                    w.put(format!("{ap}.{d}.conv.weight"), a, &key);
                }
            }
            for name in ["dt_bias", "A_log"] {
                let key = format!("{ap}.{name}");
                if let Some(a) = w.tensors.get(&key) {
                    if a.ndim() > 1 {
                        let r = a.reshape(&[-1])?;
                        w.tensors.insert(key.clone(), r);
                    }
                }
            }
            let heads = cfg.linear_attn_config.as_ref().map(|c| c.num_heads).unwrap_or(0) as i32;
            let a_log = format!("{ap}.A_log");
            if let Some(a) = w.tensors.get(&a_log) {
                if a.dim(0)? > heads {
                    let t = a.slice_axis(0, 0, heads)?;
                    w.tensors.insert(a_log, t);
                }
            }
            if !w.tensors.contains_key(&format!("{ap}.qkv_proj.weight")) {
                for suffix in ["weight", "scales", "biases"] {
                    let parts: Vec<String> =
                        ["q", "k", "v"].iter().map(|p| format!("{ap}.{p}_proj.{suffix}")).collect();
                    if parts.iter().all(|p| w.tensors.contains_key(p)) {
                        let arrays: Vec<Array> = parts.iter().filter_map(|p| w.take(p)).collect();
                        let refs: Vec<&Array> = arrays.iter().collect();
                        w.put(format!("{ap}.qkv_proj.{suffix}"), ops::concatenate(&refs, 0)?, &parts[0]);
                    }
                }
            }
            let conv: Vec<String> = ["q", "k", "v"].iter().map(|p| format!("{ap}.{p}_conv.conv.weight")).collect();
            if !w.tensors.contains_key(&format!("{ap}.qkv_conv.conv.weight"))
                && conv.iter().all(|p| w.tensors.contains_key(p))
            {
                let arrays: Vec<Array> = conv.iter().filter_map(|p| w.take(p)).collect();
                let refs: Vec<&Array> = arrays.iter().collect();
                w.put(format!("{ap}.qkv_conv.conv.weight"), ops::concatenate(&refs, 0)?, &conv[0]);
            }
        }

        let kv_b = format!("{ap}.kv_b_proj.weight");
        if let Some(v) = w.take(&kv_b) {
            let m = cfg.mla()?;
            let scales = w.take(&format!("{ap}.kv_b_proj.scales"));
            let quantized = scales.is_some();
            let mut spec = None;
            let v = match scales {
                Some(scales) => {
                    let biases = w.take(&format!("{ap}.kv_b_proj.biases"));
                    let dims = m.kv_lora_rank as i32;
                    let bits = v.dim(-1)? * 32 / dims;
                    let group_size = dims / scales.dim(-1)?;
                    let s = QuantSpec::affine(group_size, bits);
                    spec = Some(s);
                    let q = quant::Quantized { weight: v, scales, biases };
                    quant::dequantize(&q, s, None, None)?
                }
                None => v,
            };
            let (h, dn) = (m.heads as i32, m.qk_nope as i32);
            let v = v.reshape(&[h, dn + m.v_head as i32, -1])?;
            let wk = v.slice_axis(1, 0, dn)?.swapaxes(-1, -2)?.contiguous()?;
            let wv = v.slice_axis(1, dn, dn + m.v_head as i32)?.contiguous()?;
            for (name, t) in [("embed_q", wk), ("unembed_out", wv)] {
                if let (true, Some(s)) = (quantized, spec) {
                    let q = quant::quantize(&t, s, None)?;
                    w.put(format!("{ap}.{name}.weight"), q.weight, &kv_b);
                    w.put(format!("{ap}.{name}.scales"), q.scales, &kv_b);
                    if let Some(b) = q.biases {
                        w.put(format!("{ap}.{name}.biases"), b, &kv_b);
                    }
                } else {
                    w.put(format!("{ap}.{name}.weight"), t, &kv_b);
                }
            }
        }
    }
    Ok(())
}

/// mlx-lm's `infer_quant_config`: group size, bits and mode recovered from a packed weight's shapes
/// (`in_dims` is the unquantized input dimension) and its scales' dtype.
pub fn infer_spec(
    path: &str,
    in_dims: i32,
    packed_last: i32,
    scales_last: i32,
    scales_dtype: Dtype,
) -> Result<QuantSpec> {
    if in_dims <= 0 || scales_last <= 0 || in_dims % scales_last != 0 || (packed_last * 32) % in_dims != 0 {
        return Err(Error::invalid(
            "load",
            format!(
                "{path}: packed shapes (.., {packed_last}) / scales (.., {scales_last}) do not fit {in_dims} inputs"
            ),
        ));
    }
    let group_size = in_dims / scales_last;
    let bits = packed_last * 32 / in_dims;
    if scales_dtype != Dtype::U8 {
        return Ok(QuantSpec::affine(group_size, bits));
    }
    let mode = match (bits, group_size) {
        (4, 16) => QuantMode::Nvfp4,
        (4, 32) => QuantMode::Mxfp4,
        (8, 32) => QuantMode::Mxfp8,
        _ => {
            return Err(Error::invalid(
                "load",
                format!("{path}: cannot infer the quantization mode of {bits} bits with group size {group_size}"),
            ))
        }
    };
    Ok(QuantSpec { group_size, bits, mode })
}
