//! The weight store layers are built from: takes tensors by name, checks their shapes against the config,
//! works out each layer's quantization as mlx-lm does (a per-path entry in `config.json`, else inferred
//! from the packed shapes when `.scales` is present), casts floating weights to the activation dtype, and
//! at the end reports any tensor nobody used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::config::{PathQuant, QuantizationConfig};
use super::loader::{infer_spec, RawWeights};
use crate::quant::{QuantSpec, Quantized};
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
    /// Bytes it occupies (codes, scales and biases for quantized weights).
    pub bytes: u64,
    /// The quantization, or None for floating-point tensors.
    pub spec: Option<QuantSpec>,
    /// Element dtype (uint32 for packed codes).
    pub dtype: Dtype,
}

/// Hands out a checkpoint's tensors to the layers that need them.
pub struct WeightStore {
    tensors: BTreeMap<String, Array>,
    files: BTreeMap<String, PathBuf>,
    quant: QuantizationConfig,
    dtype: Dtype,
    dir: PathBuf,
    records: Vec<TensorRecord>,
    pending: Vec<Array>,
}

/// A weight that is either dense or quantized.
#[derive(Clone, Debug)]
pub enum MaybeQuantized {
    /// Floating-point weight in the activation dtype.
    Dense(Array),
    /// Packed weight with its spec.
    Quantized(Quantized, QuantSpec),
}

impl WeightStore {
    /// A store over sanitized tensors; floating weights are cast to `dtype` as they are taken.
    pub fn new(raw: RawWeights, quant: QuantizationConfig, dtype: Dtype, dir: &Path) -> WeightStore {
        WeightStore {
            tensors: raw.tensors,
            files: raw.files,
            quant,
            dtype,
            dir: dir.to_path_buf(),
            records: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// The activation dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn where_(&self, name: &str) -> String {
        match self.files.get(name) {
            Some(f) => format!("'{name}' (from {})", f.display()),
            None => format!("'{name}'"),
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
        let a = self.tensors.get(name).cloned().ok_or_else(|| self.missing(name))?;
        self.check_shape(name, &a, shape)?;
        self.tensors.remove(name);
        Ok(a)
    }

    /// Takes a floating-point tensor of `shape`, cast to the activation dtype (or kept f32 for the few
    /// tensors mlx-lm keeps in f32).
    pub fn take(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let (a, stored) = self.take_float(name, shape)?;
        let params = a.size() as u64;
        self.records.push(TensorRecord {
            path: name.to_string(),
            params,
            bytes: stored.1,
            spec: None,
            dtype: stored.0,
        });
        self.pending.push(a.clone());
        Ok(a)
    }

    /// A float tensor cast to the activation dtype, with its dtype and bytes as stored in the checkpoint.
    fn take_float(&mut self, name: &str, shape: &[i32]) -> Result<(Array, (Dtype, u64))> {
        let a = self.take_raw(name, shape)?;
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
            let (w, stored) = self.take_float(&wname, shape)?;
            self.records.push(TensorRecord {
                path: path.to_string(),
                params: w.size() as u64,
                bytes: stored.1,
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
            _ => infer_spec(path, in_dims, w.dim(-1)?, s.dim(-1)?, s.dtype())?,
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
        let weight = self.take_raw(&wname, &wshape)?;
        if weight.dtype() != Dtype::U32 {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has dtype {}, expected uint32 codes", self.where_(&wname), weight.dtype()),
            });
        }
        let bname = format!("{path}.biases");
        let stored_extra;
        let (scales, biases) = if spec.mode.has_biases() {
            let (scales, s_stored) = self.take_float(&sname, &sshape)?;
            let (biases, b_stored) = self.take_float(&bname, &sshape)?;
            stored_extra = s_stored.1 + b_stored.1;
            (scales, Some(biases))
        } else {
            let scales = self.take_raw(&sname, &sshape)?;
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
            params: shape.iter().map(|&d| d as u64).product(),
            bytes: weight.nbytes() as u64 + stored_extra,
            spec: Some(spec),
            dtype: Dtype::U32,
        });
        self.pending.extend([weight.clone(), scales.clone()]);
        self.pending.extend(biases.iter().cloned());
        Ok(MaybeQuantized::Quantized(Quantized { weight, scales, biases }, spec))
    }

    /// Evaluates the tensors handed out since the last call (reads them from disk and runs any sanitize
    /// transform), so their sources can be freed before the next layer is read.
    pub fn materialize(&mut self) -> Result<()> {
        let refs: Vec<&Array> = self.pending.iter().collect();
        crate::eval(&refs)?;
        self.pending.clear();
        Ok(())
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
        Err(Error::Format {
            path: self.dir,
            message: format!(
                "{} tensor(s) do not belong to this model (config and weights disagree): {names:?}{}",
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
