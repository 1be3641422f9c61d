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

/// Hands out a checkpoint's tensors to the layers that need them.
pub struct WeightStore {
    tensors: BTreeMap<String, Array>,
    files: BTreeMap<String, PathBuf>,
    quant: QuantizationConfig,
    dtype: Dtype,
    dir: PathBuf,
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
        WeightStore { tensors: raw.tensors, files: raw.files, quant, dtype, dir: dir.to_path_buf() }
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
        let a = self.take_raw(name, shape)?;
        if !a.dtype().is_float() {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("tensor {} has dtype {}, expected a float type", self.where_(name), a.dtype()),
            });
        }
        let want = if keeps_f32(name) { Dtype::F32 } else { self.dtype };
        if a.dtype() == want {
            Ok(a)
        } else {
            a.astype(want)
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
            return Ok(MaybeQuantized::Dense(self.take(&wname, shape)?));
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
        let (scales, biases) = if spec.mode.has_biases() {
            let scales = self.take(&sname, &sshape)?;
            let biases = self.take(&bname, &sshape)?;
            (scales, Some(biases))
        } else {
            (self.take_raw(&sname, &sshape)?, None)
        };
        if self.has(&format!("{path}.global_scale")) {
            return Err(Error::Format {
                path: self.dir.clone(),
                message: format!("'{path}.global_scale': nvfp4 global scales are not supported yet"),
            });
        }
        Ok(MaybeQuantized::Quantized(Quantized { weight, scales, biases }, spec))
    }

    /// Fails naming the tensors no layer took (mlx-lm's strict loading does the same).
    pub fn finish(self) -> Result<()> {
        if self.tensors.is_empty() {
            return Ok(());
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
