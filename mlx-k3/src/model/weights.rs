//! The weight store layers are built from: takes tensors by name, checks their shapes against the config,
//! works out each layer's quantization as mlx-lm does (a per-path entry in `config.json`, else inferred
//! from the packed shapes when `.scales` is present), casts floating weights to the activation dtype, and
//! at the end reports any tensor nobody used.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::config::{PathQuant, QuantizationConfig};
use super::loader::{infer_spec, RawWeights, TensorLoc};
use super::shard::Part;
use crate::codebook::{self, Codebook};
use crate::quant::{QuantMode, QuantSpec, Quantized};
use crate::tiered::TieredExperts;
use crate::{Array, Dtype, Error, Result};

/// Tensors kept in f32 whatever the activation dtype (mlx-lm's `cast_predicate`).
fn keeps_f32(name: &str) -> bool {
    name.contains("e_score_correction_bias") || name.ends_with("A_log") || name.ends_with("dt_bias")
}

/// What one loaded weight is: its module path, parameters (unquantized element count), bytes as stored
/// in memory, and quantization.
#[derive(Clone, Debug)]
pub struct TensorRecord {
    /// Module path (`model.layers.3.mlp.switch_mlp.up_proj`) or tensor name for plain tensors.
    pub path: String,
    /// Parameters it represents.
    pub params: u64,
    /// Bytes it occupies in memory (codes, scales and biases for quantized weights; for codebook weights the
    /// layout they were loaded in, see [`crate::codebook::load_layout`]).
    pub bytes: u64,
    /// Bytes the checkpoint stores for it (equal to `bytes` except for codebook weights in the ternary layout).
    pub stored_bytes: u64,
    /// The quantization, or None for floating-point tensors.
    pub spec: Option<QuantSpec>,
    /// Element dtype (uint32 for packed codes).
    pub dtype: Dtype,
}

/// Hands out a checkpoint's tensors to the layers that need them.
pub struct WeightStore {
    tensors: BTreeMap<String, Array>,
    files: BTreeMap<String, PathBuf>,
    locs: BTreeMap<String, TensorLoc>,
    presliced: BTreeMap<String, Range<usize>>,
    /// Read row parts of stored tensors straight from their files (off for lazy loading, which reads
    /// nothing).
    direct_reads: bool,
    quant: QuantizationConfig,
    dtype: Dtype,
    dir: PathBuf,
    records: Vec<TensorRecord>,
    pending: Vec<Array>,
    /// When set, missing tensors are made up (random, seeded) and remembered: builds random checkpoints.
    fabricate: Option<Fabricator>,
}

/// Makes up plausible random tensors by name for [`WeightStore::fabricating`] (or, for
/// [`WeightStore::probing`], unevaluated zeros that only tell their shapes).
struct Fabricator {
    key: Array,
    counter: u64,
    made: BTreeMap<String, Array>,
    shapes_only: bool,
}

impl Fabricator {
    fn make(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        if self.shapes_only {
            // Never evaluated: MLX allocates nothing for it, so even a full-size model costs only graph nodes.
            let a = crate::ops::zeros(shape, Dtype::F32)?;
            self.made.insert(name.to_string(), a.clone());
            return Ok(a);
        }
        self.counter += 1;
        let key = crate::random::split(&crate::random::key(self.counter)?.add(&self.key)?, 2)?
            .slice_axis(0, 0, 1)?
            .squeeze(&[0])?;
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let a = if name.ends_with("A_log") {
            crate::random::uniform(1.0, 16.0, shape, Dtype::F32, Some(&key))?.log()?
        } else if name.ends_with("dt_bias") {
            crate::ops::zeros(shape, Dtype::F32)?
        } else if name.contains("e_score_correction_bias") {
            crate::random::normal(shape, Dtype::F32, 0.0, 0.05, Some(&key))?
        } else if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            crate::random::normal(shape, Dtype::F32, 1.0, 0.05, Some(&key))?
        } else if name.ends_with("conv.weight") {
            crate::random::normal(shape, Dtype::F32, 0.0, 0.3, Some(&key))?
        } else {
            crate::random::normal(shape, Dtype::F32, 0.0, 1.0 / fan_in.sqrt(), Some(&key))?
        };
        a.eval()?;
        self.made.insert(name.to_string(), a.clone());
        Ok(a)
    }
}

/// A weight that is either dense or quantized.
#[derive(Clone, Debug)]
pub enum MaybeQuantized {
    /// Floating-point weight in the activation dtype.
    Dense(Array),
    /// Packed weight with its spec.
    Quantized(Quantized, QuantSpec),
    /// The project's ternary codebook format.
    Codebook(Codebook),
    /// A mixed-format expert stack.
    Tiered(Box<TieredExperts>),
}

impl WeightStore {
    /// A store over sanitized tensors; floating weights are cast to `dtype` as they are taken.
    pub fn new(raw: RawWeights, quant: QuantizationConfig, dtype: Dtype, dir: &Path) -> WeightStore {
        WeightStore {
            tensors: raw.tensors,
            files: raw.files,
            locs: raw.locs,
            presliced: raw.presliced,
            direct_reads: true,
            quant,
            dtype,
            dir: dir.to_path_buf(),
            records: Vec::new(),
            pending: Vec::new(),
            fabricate: None,
        }
    }

    /// A store that makes up every tensor it is asked for (f32, seeded): building a model from it and then
    /// [`WeightStore::fabricated`] gives a random checkpoint that loads like a real one.
    pub fn fabricating(seed: u64, dtype: Dtype) -> Result<WeightStore> {
        let raw = RawWeights::default();
        let mut ws = WeightStore::new(raw, QuantizationConfig::default(), dtype, Path::new("<random>"));
        ws.fabricate =
            Some(Fabricator { key: crate::random::key(seed)?, counter: 0, made: BTreeMap::new(), shapes_only: false });
        Ok(ws)
    }

    /// A store that hands out unevaluated zeros for every tensor it is asked for: building a model from it
    /// and reading [`WeightStore::fabricated`]'s shapes tells what the model graph takes, reading and
    /// allocating nothing (the shapes must not be evaluated).
    pub fn probing() -> Result<WeightStore> {
        let mut ws =
            WeightStore::new(RawWeights::default(), QuantizationConfig::default(), Dtype::F32, Path::new("<probe>"));
        ws.fabricate =
            Some(Fabricator { key: crate::random::key(0)?, counter: 0, made: BTreeMap::new(), shapes_only: true });
        Ok(ws)
    }

    /// The tensors a fabricating store made up, by name.
    pub fn fabricated(&self) -> Option<&BTreeMap<String, Array>> {
        self.fabricate.as_ref().map(|f| &f.made)
    }

    /// The activation dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether parts of tensors are read from their files at once (the default) or sliced lazily (for lazy
    /// loading and planning, which must read no tensor data).
    pub fn set_direct_reads(&mut self, on: bool) {
        self.direct_reads = on;
    }

    fn where_(&self, name: &str) -> String {
        match self.files.get(name) {
            Some(f) => format!("'{name}' (from {})", f.display()),
            None => format!("'{name}'"),
        }
    }

    /// The unquantized column multiple that a split of weight `path` (of `in_dims` inputs) along its inputs
    /// must keep to: the quantization group, 256 for the codebook, 1 for a float weight.
    pub fn split_alignment(&self, path: &str, in_dims: usize) -> usize {
        if self.has(&format!("{path}.codes")) {
            return 256;
        }
        match self.tensors.get(&format!("{path}.scales")).and_then(|s| s.dim(-1).ok()) {
            Some(groups) if groups > 0 => in_dims / groups as usize,
            _ => 1,
        }
    }

    /// Drops every remaining tensor whose name starts with `prefix`, unread (weights another rank holds).
    pub fn discard_prefix(&mut self, prefix: &str) {
        let names: Vec<String> = self.tensors.keys().filter(|k| k.starts_with(prefix)).cloned().collect();
        for n in names {
            self.tensors.remove(&n);
            self.locs.remove(&n);
        }
    }

    /// Whether tensor `name` is present (and not yet taken).
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn missing(&self, name: &str) -> Error {
        Error::Format { path: self.dir.clone(), message: format!("missing tensor '{name}'") }
    }

    fn check_shape(&self, name: &str, a: &Array, expected: &[i32]) -> Result<()> {
        let found = a.shape();
        if found != expected {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has shape {found:?}, expected {expected:?}", self.where_(name)),
            });
        }
        Ok(())
    }

    /// Takes a raw tensor (no cast), checking its shape.
    pub fn take_raw(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        self.take_raw_part(name, shape, &Part::Whole, 1, 1)
    }

    /// Takes `part` of a raw tensor of full `shape`. A stored tensor dimension of `d * num / den` holds `d`
    /// unquantized columns (packed codes, group scales), so column ranges must fall on those boundaries.
    /// Row parts of tensors stored as-is are read straight from the file: the rest is never read.
    fn take_raw_part(&mut self, name: &str, shape: &[i32], part: &Part, num: i32, den: i32) -> Result<Array> {
        if let Some(f) = self.fabricate.as_mut() {
            let a = f.make(name, shape)?;
            return self.cut_lazy(name, a, part, num, den);
        }
        if let Some(r) = self.presliced.get(name).cloned() {
            if *part != Part::rows(r.clone()) {
                return Err(Error::Format {
                    path: self.dir.clone(),
                    message: format!(
                        "tensor {} holds experts {r:?} only, but {part:?} was asked for",
                        self.where_(name)
                    ),
                });
            }
            let mut local = shape.to_vec();
            local[0] = r.len() as i32;
            let a = self.tensors.get(name).cloned().ok_or_else(|| self.missing(name))?;
            self.check_shape(name, &a, &local)?;
            self.tensors.remove(name);
            return Ok(a);
        }
        let a = self.tensors.get(name).cloned().ok_or_else(|| self.missing(name))?;
        self.check_shape(name, &a, shape)?;
        self.tensors.remove(name);
        let loc = self.locs.remove(name);
        match (part, loc) {
            (Part::Whole, _) => Ok(a),
            (Part::Rows(rs), Some(loc)) if self.direct_reads => {
                loc.read_rows(rs).map_err(|e| Error::Format { path: self.dir.clone(), message: format!("{name}: {e}") })
            }
            _ => self.cut_lazy(name, a, part, num, den),
        }
    }

    /// `part` of `a` as a lazy slice, copied so the whole tensor can be freed once it is evaluated.
    fn cut_lazy(&self, name: &str, a: Array, part: &Part, num: i32, den: i32) -> Result<Array> {
        match part {
            Part::Whole => Ok(a),
            Part::Rows(rs) => {
                let pieces: Vec<Array> =
                    rs.iter().map(|r| a.slice_axis(0, r.start as i32, r.end as i32)).collect::<Result<_>>()?;
                let refs: Vec<&Array> = pieces.iter().collect();
                crate::ops::concatenate(&refs, 0)?.contiguous()
            }
            Part::Cols(r) => {
                let (s, e) = (r.start as i32, r.end as i32);
                if (s * num) % den != 0 || (e * num) % den != 0 {
                    return Err(Error::Format {
                        path: self.dir.clone(),
                        message: format!(
                            "cannot split {} at input columns {r:?}: its packing needs multiples of {}",
                            self.where_(name),
                            den / gcd(num, den)
                        ),
                    });
                }
                a.slice_axis(-1, s * num / den, e * num / den)?.contiguous()
            }
        }
    }

    /// Takes a floating-point tensor of `shape`, cast to the activation dtype (or kept f32 for the few
    /// tensors mlx-lm keeps in f32).
    pub fn take(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        self.take_part(name, shape, &Part::Whole)
    }

    /// [`WeightStore::take`] of `part` of the tensor.
    pub fn take_part(&mut self, name: &str, shape: &[i32], part: &Part) -> Result<Array> {
        let (a, stored) = self.take_float(name, shape, part, 1, 1)?;
        let params = a.size() as u64;
        self.records.push(TensorRecord {
            path: name.to_string(),
            params,
            bytes: stored.1,
            stored_bytes: stored.1,
            spec: None,
            dtype: stored.0,
        });
        self.pending.push(a.clone());
        Ok(a)
    }

    /// A float tensor cast to the activation dtype, with its dtype and bytes as stored in the checkpoint.
    fn take_float(
        &mut self,
        name: &str,
        shape: &[i32],
        part: &Part,
        num: i32,
        den: i32,
    ) -> Result<(Array, (Dtype, u64))> {
        let a = self.take_raw_part(name, shape, part, num, den)?;
        let stored = (a.dtype(), a.nbytes() as u64);
        if !a.dtype().is_float() {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has dtype {}, expected a float type", self.where_(name), a.dtype()),
            });
        }
        let want = if keeps_f32(name) { Dtype::F32 } else { self.dtype };
        if a.dtype() == want {
            Ok((a, stored))
        } else {
            Ok((a.astype(want)?, stored))
        }
    }

    /// Takes `{path}.weight` (and `.scales`/`.biases` when quantized) of a weight whose unquantized shape is
    /// `[...batch, out, in]`.
    pub fn take_weight(&mut self, path: &str, shape: &[i32]) -> Result<MaybeQuantized> {
        self.take_weight_part(path, shape, &Part::Whole)
    }

    /// [`WeightStore::take_weight`] of `part` of the weight (rows of axis 0, or input columns).
    pub fn take_weight_part(&mut self, path: &str, shape: &[i32], part: &Part) -> Result<MaybeQuantized> {
        if self.has(&format!("{path}.tier")) {
            return self.take_tiered(path, shape, part);
        }
        if self.has(&format!("{path}.codes")) {
            return Ok(MaybeQuantized::Codebook(self.take_codebook(path, path, shape, true, part)?));
        }
        if let Some(PathQuant::Codebook | PathQuant::Tiered { .. }) = self.quant.for_path(path) {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("config.json gives '{path}' a k3 format but its tensors are missing"),
            });
        }
        let wname = format!("{path}.weight");
        let sname = format!("{path}.scales");
        let override_ = self.quant.for_path(path);
        if !self.has(&sname) {
            if let Some(PathQuant::Quantized(_)) = override_ {
                return Err(Error::Format {
                    path: self.dir.clone(),
                    message: format!("config.json quantizes '{path}' but the checkpoint has no '{sname}'"),
                });
            }
            let (w, stored) = self.take_float(&wname, shape, part, 1, 1)?;
            self.records.push(TensorRecord {
                path: path.to_string(),
                params: w.size() as u64,
                bytes: stored.1,
                stored_bytes: stored.1,
                spec: None,
                dtype: stored.0,
            });
            self.pending.push(w.clone());
            return Ok(MaybeQuantized::Dense(w));
        }
        if override_ == Some(PathQuant::Unquantized) {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("config.json leaves '{path}' unquantized but the checkpoint has '{sname}'"),
            });
        }
        let n = shape.len();
        let (batch, in_dims) = (&shape[..n - 1], shape[n - 1]);
        let w = self.tensors.get(&wname).cloned().ok_or_else(|| self.missing(&wname))?;
        let s = self.tensors.get(&sname).cloned().ok_or_else(|| self.missing(&sname))?;
        let spec = match override_ {
            Some(PathQuant::Quantized(spec)) => spec,
            _ => {
                let spec = infer_spec(path, in_dims, w.dim(-1)?, s.dim(-1)?, s.dtype())?;
                if let Some(why) = self.quant.declared_mismatch(spec, s.dtype()) {
                    return Err(Error::Format {
                        path: self.dir.clone(),
                        message: format!("'{path}': packed weight and uint8 scales for {in_dims} inputs: {why}"),
                    });
                }
                spec
            }
        };
        if in_dims % spec.group_size != 0 || (in_dims * spec.bits) % 32 != 0 {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!(
                    "'{path}': {in_dims} inputs do not fit group size {} / {} bits",
                    spec.group_size, spec.bits
                ),
            });
        }
        let mut wshape = batch.to_vec();
        wshape.push(in_dims * spec.bits / 32);
        let mut sshape = batch.to_vec();
        sshape.push(in_dims / spec.group_size);
        let weight = self.take_raw_part(&wname, &wshape, part, spec.bits, 32)?;
        if weight.dtype() != Dtype::U32 {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has dtype {}, expected uint32 codes", self.where_(&wname), weight.dtype()),
            });
        }
        let bname = format!("{path}.biases");
        let stored_extra;
        let (scales, biases) = if spec.mode.has_biases() {
            let (scales, s_stored) = self.take_float(&sname, &sshape, part, 1, spec.group_size)?;
            let (biases, b_stored) = self.take_float(&bname, &sshape, part, 1, spec.group_size)?;
            stored_extra = s_stored.1 + b_stored.1;
            (scales, Some(biases))
        } else {
            let scales = self.take_raw_part(&sname, &sshape, part, 1, spec.group_size)?;
            stored_extra = scales.nbytes() as u64;
            (scales, None)
        };
        if self.has(&format!("{path}.global_scale")) {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}.global_scale': nvfp4 global scales are not supported yet"),
            });
        }
        self.records.push(TensorRecord {
            path: path.to_string(),
            params: part.shape(shape).iter().map(|&d| d as u64).product(),
            bytes: weight.nbytes() as u64 + stored_extra,
            stored_bytes: weight.nbytes() as u64 + stored_extra,
            spec: Some(spec),
            dtype: Dtype::U32,
        });
        self.pending.extend([weight.clone(), scales.clone()]);
        self.pending.extend(biases.iter().cloned());
        Ok(MaybeQuantized::Quantized(Quantized { weight, scales, biases }, spec))
    }

    /// Takes a codebook matrix or stack stored as `{stem}.codes/qh/scales` for a weight of unquantized `shape`.
    fn take_codebook(&mut self, path: &str, stem: &str, shape: &[i32], record: bool, part: &Part) -> Result<Codebook> {
        let n = shape.len();
        let k = shape[n - 1];
        if k <= 0 || k % 32 != 0 {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}': the codebook format needs K % 32 == 0, K is {k}"),
            });
        }
        if k % 256 != 0 && matches!(part, Part::Cols(_)) {
            // Input-column splits cut at super-block boundaries; a row with a short last super-block has
            // only one place to cut (its end).
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}': cannot split a codebook matrix over its inputs when K ({k}) % 256 != 0"),
            });
        }
        let with = |last: i32| {
            let mut s = shape[..n - 1].to_vec();
            s.push(last);
            s
        };
        let cb = Codebook {
            codes: self.take_typed(&format!("{stem}.codes"), &with(k / 8), Dtype::U8, part, 1, 8)?,
            qh: self.take_typed(&format!("{stem}.qh"), &with(k / 32), Dtype::U16, part, 1, 32)?,
            scales: self.take_typed(
                &format!("{stem}.scales"),
                &with(codebook::super_blocks(k as usize) as i32),
                Dtype::F16,
                part,
                1,
                256,
            )?,
        };
        // The execution layout (the checkpoint stores the compact one): the ternary trits are built as this layer
        // is materialized, and the compact codes are then dropped.
        let cb = match codebook::load_layout()? {
            codebook::CodebookLayout::Ternary => cb.to_ternary()?,
            codebook::CodebookLayout::Compact => cb,
        };
        let bytes = cb.nbytes() as u64;
        if record {
            self.records.push(TensorRecord {
                path: path.to_string(),
                params: part.shape(shape).iter().map(|&d| d as u64).product(),
                bytes,
                stored_bytes: cb.stored_bytes() as u64,
                spec: None,
                dtype: Dtype::U8,
            });
        }
        self.pending.extend([cb.codes.clone(), cb.qh.clone(), cb.scales.clone()]);
        Ok(cb)
    }

    /// Takes a raw tensor of a given shape and dtype.
    fn take_typed(
        &mut self,
        name: &str,
        shape: &[i32],
        dtype: Dtype,
        part: &Part,
        num: i32,
        den: i32,
    ) -> Result<Array> {
        let a = self.take_raw_part(name, shape, part, num, den)?;
        if a.dtype() != dtype {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has dtype {}, expected {dtype}", self.where_(name), a.dtype()),
            });
        }
        Ok(a)
    }

    /// Takes a mixed-format expert stack (see [`crate::tiered`]) of unquantized shape `[E, N, K]`.
    fn take_tiered(&mut self, path: &str, shape: &[i32], part: &Part) -> Result<MaybeQuantized> {
        if shape.len() != 3 {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}': tiers are for expert stacks [E, N, K], this weight is {shape:?}"),
            });
        }
        let (e, n, k) = (shape[0], shape[1], shape[2]);
        let whole = Part::Whole;
        let mut tier = self.take_typed(&format!("{path}.tier"), &[e], Dtype::U8, &whole, 1, 1)?;
        let mut slot = self.take_typed(&format!("{path}.slot"), &[e], Dtype::U32, &whole, 1, 1)?;
        // A part of the experts: the tables are read (a few bytes per expert) to find which rows of each
        // tier's stack this part needs; those rows are taken and the slots renumbered.
        let mut sub = [Part::Whole, Part::Whole, Part::Whole];
        if let Part::Rows(rs) = part {
            let (t_all, s_all) = (tier.to_vec::<u8>()?, slot.to_vec::<u32>()?);
            let mut rows: [Vec<Range<usize>>; 3] = Default::default();
            let (mut t_loc, mut s_loc) = (Vec::new(), Vec::new());
            for ex in rs.iter().flat_map(|r| r.clone()) {
                let (t, sl) = (*t_all.get(ex).unwrap_or(&u8::MAX), *s_all.get(ex).unwrap_or(&0) as usize);
                let ti = t as usize;
                if ti > 2 {
                    return Err(Error::Format {
                        path: self.dir.clone(),
                        message: format!("'{path}.tier': expert {ex} has unknown tier {t}"),
                    });
                }
                t_loc.push(t);
                s_loc.push(rows[ti].iter().map(|r| r.len()).sum::<usize>() as u32);
                match rows[ti].last_mut() {
                    Some(r) if r.end == sl => r.end += 1,
                    _ => rows[ti].push(sl..sl + 1),
                }
            }
            let m = t_loc.len() as i32;
            tier = Array::from_slice(&t_loc, &[m])?;
            slot = Array::from_slice(&s_loc, &[m])?;
            for (i, r) in rows.into_iter().enumerate() {
                sub[i] = Part::Rows(r);
            }
        } else if !matches!(part, Part::Whole) {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}': a tiered expert stack can only be split by experts"),
            });
        }
        // A tier none of this part's experts use is dropped unread.
        for (i, (stem, leaves)) in [
            ("codebook", &["codes", "qh", "scales"][..]),
            ("mxfp4", &["weight", "scales"]),
            ("affine", &["weight", "scales", "biases"]),
        ]
        .into_iter()
        .enumerate()
        {
            if matches!(&sub[i], Part::Rows(r) if r.is_empty()) {
                for leaf in leaves {
                    let name = format!("{path}.{stem}.{leaf}");
                    self.tensors.remove(&name);
                    self.locs.remove(&name);
                }
            }
        }
        let count = |ws: &WeightStore, name: String| ws.tensors.get(&name).map(|a| a.dim(0)).transpose();
        let codebook = match count(self, format!("{path}.codebook.codes"))? {
            Some(ec) => Some(self.take_codebook(path, &format!("{path}.codebook"), &[ec, n, k], false, &sub[0])?),
            None => None,
        };
        let mxfp4 = match count(self, format!("{path}.mxfp4.weight"))? {
            Some(em) => {
                if k % 32 != 0 {
                    return Err(Error::Format {
                        path: self.dir.clone(),
                        message: format!("'{path}': K {k} % 32 != 0"),
                    });
                }
                let weight =
                    self.take_typed(&format!("{path}.mxfp4.weight"), &[em, n, k / 8], Dtype::U32, &sub[1], 1, 1)?;
                let scales =
                    self.take_typed(&format!("{path}.mxfp4.scales"), &[em, n, k / 32], Dtype::U8, &sub[1], 1, 1)?;
                self.pending.extend([weight.clone(), scales.clone()]);
                Some(Quantized { weight, scales, biases: None })
            }
            None => None,
        };
        let affine = match count(self, format!("{path}.affine.weight"))? {
            Some(ea) => {
                let w = self.tensors.get(&format!("{path}.affine.weight")).cloned();
                let sc = self.tensors.get(&format!("{path}.affine.scales")).cloned();
                let spec = match (self.quant.for_path(path), w, sc) {
                    (Some(PathQuant::Tiered { affine: Some(spec) }), _, _) => spec,
                    (_, Some(w), Some(sc)) => infer_spec(path, k, w.dim(-1)?, sc.dim(-1)?, sc.dtype())?,
                    _ => return Err(self.missing(&format!("{path}.affine.scales"))),
                };
                if spec.mode != QuantMode::Affine || k % spec.group_size != 0 {
                    return Err(Error::Format {
                        path: self.dir.clone(),
                        message: format!("'{path}': affine tier spec {spec:?} does not fit K = {k}"),
                    });
                }
                let wshape = [ea, n, k * spec.bits / 32];
                let sshape = [ea, n, k / spec.group_size];
                let weight = self.take_typed(&format!("{path}.affine.weight"), &wshape, Dtype::U32, &sub[2], 1, 1)?;
                let (scales, _) = self.take_float(&format!("{path}.affine.scales"), &sshape, &sub[2], 1, 1)?;
                let (biases, _) = self.take_float(&format!("{path}.affine.biases"), &sshape, &sub[2], 1, 1)?;
                self.pending.extend([weight.clone(), scales.clone(), biases.clone()]);
                Some((Quantized { weight, scales, biases: Some(biases) }, spec))
            }
            None => None,
        };
        let t = TieredExperts { tier, slot, codebook, mxfp4, affine };
        t.validate(path).map_err(|e| Error::Format { path: self.dir.clone(), message: e.to_string() })?;
        self.records.push(TensorRecord {
            path: path.to_string(),
            params: part.shape(shape).iter().map(|&d| d as u64).product(),
            bytes: t.nbytes() as u64,
            stored_bytes: (t.nbytes() - t.codebook.as_ref().map_or(0, |c| c.nbytes() - c.stored_bytes())) as u64,
            spec: None,
            dtype: Dtype::U8,
        });
        self.pending.extend([t.tier.clone(), t.slot.clone()]);
        Ok(MaybeQuantized::Tiered(Box::new(t)))
    }

    /// Evaluates the tensors handed out since the last call (reads them from disk and runs any sanitize
    /// transform), so their sources can be freed before the next layer is read.
    pub fn materialize(&mut self) -> Result<()> {
        let refs: Vec<&Array> = self.pending.iter().collect();
        crate::eval(&refs)?;
        self.pending.clear();
        Ok(())
    }

    /// Adds arrays derived from handed-out tensors (e.g. views of them) to the next [`WeightStore::materialize`],
    /// so they are evaluated with the layer instead of inside the first decode step.
    pub fn materialize_with(&mut self, derived: impl IntoIterator<Item = Array>) {
        self.pending.extend(derived);
    }

    /// Forgets the tensors handed out so far without evaluating them (lazy loading).
    pub fn keep_lazy(&mut self) {
        self.pending.clear();
    }

    /// The record of every weight handed out.
    pub fn records(&self) -> &[TensorRecord] {
        &self.records
    }

    /// Fails naming the tensors no layer took (mlx-lm's strict loading does the same); else returns the
    /// records of every weight.
    pub fn finish(self) -> Result<Vec<TensorRecord>> {
        if self.tensors.is_empty() {
            return Ok(self.records);
        }
        let names: Vec<&String> = self.tensors.keys().take(8).collect();
        // DeepSeek's original releases: fp8 weights with block scales, or compressed-tensors int4. mlx-lm
        // dequantizes or repacks them in its sanitize; mlx-k3 reads its output instead.
        let hint = match self.tensors.keys().find(|k| k.ends_with("weight_scale_inv") || k.ends_with("weight_shape")) {
            Some(k) => format!(
                "; '{k}' is part of an fp8 block-scaled or compressed-tensors int4 weight, which mlx-k3 does not \
                 read: convert the checkpoint with mlx_lm.convert first"
            ),
            None => String::new(),
        };
        Err(Error::Format {
            path: self.dir,
            message: format!(
                "{} tensor(s) do not belong to this model (config and weights disagree): {names:?}{}{hint}",
                self.tensors.len(),
                if self.tensors.len() > 8 { " ..." } else { "" }
            ),
        })
    }

    /// Every tensor still in the store (for `inspect`).
    pub fn remaining(&self) -> impl Iterator<Item = (&String, &Array)> {
        self.tensors.iter()
    }
}

fn gcd(a: i32, b: i32) -> i32 {
    if b == 0 {
        a.abs().max(1)
    } else {
        gcd(b, a % b)
    }
}
