//! A source checkpoint read one unit at a time: every shard is opened lazily (only headers are read),
//! names are sanitized once (release names, stacked experts, split `kv_b_proj`), and the tensors are then
//! grouped into units (each decoder layer, then the globals) and into modules. A unit's tensors are read
//! from disk only when the converter asks for them, and dropped after, so memory holds about one layer.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::classes::{layer_of, module_of, TensorClass};
use crate::codebook::{self, Codebook};
use crate::model::config::{ModelConfig, PathQuant};
use crate::model::loader::{infer_spec, read_media_tensors, read_weights, RawWeights};
use crate::model::KimiK3;
use crate::quant::{self, QuantMode, QuantSpec, Quantized};
use crate::tiered::{self, TieredExperts};
use crate::{Array, Dtype, Error, Result};

/// How a module is stored in the source.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceFormat {
    /// A float weight.
    Dense(Dtype),
    /// MLX-quantized.
    Mlx(QuantSpec),
    /// The ternary codebook.
    Codebook,
    /// A tiered expert stack (affine spec of its affine tier, if any).
    Tiered(Option<QuantSpec>),
}

/// One quantizable module of the source.
#[derive(Clone, Debug)]
pub struct Module {
    /// Module path (`model.layers.3.mlp.switch_mlp.up_proj`).
    pub path: String,
    /// Its class.
    pub class: TensorClass,
    /// The unquantized shape `[.., N, K]`.
    pub shape: Vec<i32>,
    /// How it is stored.
    pub format: SourceFormat,
    /// The source tensors that make it up.
    pub tensors: Vec<String>,
}

/// A unit of work: one decoder layer, or the globals.
#[derive(Clone, Debug)]
pub struct Unit {
    /// `layer 3` or `globals`.
    pub name: String,
    /// Layer index, None for the globals.
    pub layer: Option<usize>,
    /// Quantizable modules, by path.
    pub modules: Vec<Module>,
    /// Other tensors (norms, biases, convolutions, ...), by name.
    pub plain: Vec<String>,
}

/// A lazily opened source checkpoint.
pub struct Source {
    /// Its folder.
    pub dir: PathBuf,
    /// Its config.
    pub config: ModelConfig,
    raw: RawWeights,
    /// The unquantized shape of every tensor the model graph takes (from config.json alone).
    shapes: BTreeMap<String, Vec<i32>>,
    /// Units in order: layers, then globals.
    pub units: Vec<Unit>,
    /// The media encoder's tensors (`vision_tower.*`, `mm_projector.*`, ...) as one unit of plain tensors under
    /// their stored names, when the checkpoint has any: `convert` copies them through unchanged.
    pub media: Option<Unit>,
}

impl Source {
    /// Opens `dir` (headers only) and plans its units.
    pub fn open(dir: &Path) -> Result<Source> {
        let config = ModelConfig::load(dir)?;
        let raw = read_weights(dir, &config.text, None)?;
        let shapes = KimiK3::weight_shapes(&config.text)?;
        let cfg = &config.text;
        let n = cfg.num_hidden_layers;
        let mut modules: BTreeMap<String, (TensorClass, Vec<String>)> = BTreeMap::new();
        let mut plain: Vec<String> = Vec::new();
        for name in raw.tensors.keys() {
            match module_of(name, cfg) {
                Some((path, class)) => modules.entry(path).or_insert_with(|| (class, Vec::new())).1.push(name.clone()),
                None => plain.push(name.clone()),
            }
        }
        let mut units: Vec<Unit> = (0..n)
            .map(|i| Unit { name: format!("layer {i}"), layer: Some(i), modules: Vec::new(), plain: Vec::new() })
            .collect();
        units.push(Unit { name: "globals".into(), layer: None, modules: Vec::new(), plain: Vec::new() });
        let unit_of = |name: &str| layer_of(name).filter(|&i| i < n).unwrap_or(n);
        let mut raw = raw;
        let mut media = Vec::new();
        for (name, (a, file)) in read_media_tensors(dir)? {
            raw.tensors.insert(name.clone(), a);
            raw.files.insert(name.clone(), file);
            media.push(name);
        }
        let media = (!media.is_empty()).then(|| Unit {
            name: "media encoder".into(),
            layer: None,
            modules: Vec::new(),
            plain: media,
        });
        let mut src = Source { dir: dir.to_path_buf(), config, raw, shapes, units: Vec::new(), media };
        for (path, (class, tensors)) in modules {
            let (shape, format) = src.describe(&path, &tensors)?;
            units[unit_of(&path)].modules.push(Module { path, class, shape, format, tensors });
        }
        for name in plain {
            units[unit_of(&name)].plain.push(name);
        }
        src.units = units;
        Ok(src)
    }

    fn fmt_err(&self, message: String) -> Error {
        Error::Format { path: self.dir.clone(), message }
    }

    fn get(&self, name: &str) -> Result<&Array> {
        self.raw.tensors.get(name).ok_or_else(|| self.fmt_err(format!("missing tensor '{name}'")))
    }

    /// Tensor `name` for a message: with the release name it was made from, if any.
    fn named(&self, name: &str) -> String {
        match self.raw.origins.get(name) {
            Some(o) => format!("'{name}' (from '{o}')"),
            None => format!("'{name}'"),
        }
    }

    /// An error about tensor `name`, reported against the file it came from.
    fn tensor_err(&self, name: &str, message: String) -> Error {
        let path = self.raw.files.get(name).filter(|p| !p.as_os_str().is_empty()).cloned();
        Error::Format { path: path.unwrap_or_else(|| self.dir.clone()), message }
    }

    /// Shape and format of a module from its tensors' headers (no data read).
    fn describe(&self, path: &str, tensors: &[String]) -> Result<(Vec<i32>, SourceFormat)> {
        let has = |s: &str| tensors.iter().any(|t| t == &format!("{path}.{s}"));
        let q = self.config.quantization.for_path(path);
        if has("tier") {
            let affine = match q {
                Some(PathQuant::Tiered { affine }) => affine,
                _ => None,
            };
            let e = self.get(&format!("{path}.tier"))?.dim(0)?;
            let (n, k) = if has("codebook.codes") {
                let c = self.get(&format!("{path}.codebook.codes"))?;
                (c.dim(1)?, c.dim(2)? * 8)
            } else if has("mxfp4.weight") {
                let c = self.get(&format!("{path}.mxfp4.weight"))?;
                (c.dim(1)?, c.dim(2)? * 8)
            } else {
                let c = self.get(&format!("{path}.affine.weight"))?;
                let spec =
                    affine.ok_or_else(|| self.fmt_err(format!("'{path}': tiered affine experts need a spec")))?;
                (c.dim(1)?, c.dim(2)? * 32 / spec.bits)
            };
            return Ok((vec![e, n, k], SourceFormat::Tiered(affine)));
        }
        if has("codes") {
            let c = self.get(&format!("{path}.codes"))?;
            let mut shape = c.shape();
            *shape.last_mut().unwrap_or(&mut 0) *= 8;
            return Ok((shape, SourceFormat::Codebook));
        }
        let (wname, sname) = (format!("{path}.weight"), format!("{path}.scales"));
        let w = self.get(&wname)?;
        // What the model graph takes here, from config.json: tells a packed tensor's input dimension.
        let expected = self.shapes.get(&wname);
        if !has("scales") {
            if !w.dtype().is_float() {
                return Err(self.fmt_err(format!("'{path}.weight' is {} without scales", w.dtype())));
            }
            if let Some(e) = expected.filter(|e| **e != w.shape()) {
                let msg = format!("{} has shape {:?}, but config.json makes it {e:?}", self.named(&wname), w.shape());
                return Err(self.tensor_err(&wname, msg));
            }
            return Ok((w.shape(), SourceFormat::Dense(w.dtype())));
        }
        let s = self.get(&sname)?;
        if w.ndim() == 0 || s.ndim() == 0 {
            let msg = format!("{} / {} must not be scalars", self.named(&wname), self.named(&sname));
            return Err(self.tensor_err(&wname, msg));
        }
        let (packed, groups) = (w.dim(-1)?, s.dim(-1)?);
        let in_dims = expected.and_then(|e| e.last().copied());
        let inferred = |k: i32| -> Result<QuantSpec> {
            let bad = |why: String| {
                let msg = format!(
                    "{} ({packed} packed words a row) and {} ({groups} scales a row) for the {k} inputs config.json \
                     gives '{path}': {why}",
                    self.named(&wname),
                    self.named(&sname),
                );
                self.tensor_err(&sname, msg)
            };
            let spec = infer_spec(path, k, packed, groups, s.dtype())
                .map_err(|_| bad(format!("no packing holds {k} inputs that way (corrupt or truncated?)")))?;
            if spec.mode == QuantMode::Affine
                && !(matches!(spec.bits, 1..=6 | 8) && matches!(spec.group_size, 32 | 64 | 128))
            {
                return Err(bad(format!(
                    "that is {} bits in groups of {}, which MLX's affine format does not have (corrupt or truncated?)",
                    spec.bits, spec.group_size
                )));
            }
            match self.config.quantization.declared_mismatch(spec, s.dtype()) {
                Some(why) => Err(bad(why)),
                None => Ok(spec),
            }
        };
        let spec = match (q, in_dims) {
            (Some(PathQuant::Quantized(spec)), _) => spec,
            // mlx-lm's `infer_quant_config`, with the input dimension from config.json: unambiguous.
            (_, Some(k)) if s.dtype() == Dtype::U8 => inferred(k)?,
            _ if s.dtype() == Dtype::U8 => {
                let mode = match packed.checked_div(groups) {
                    Some(4) if groups * 4 == packed => QuantMode::Mxfp4,
                    Some(8) if groups * 8 == packed => QuantMode::Mxfp8,
                    Some(2) if groups * 2 == packed => QuantMode::Nvfp4,
                    _ => {
                        return Err(self.fmt_err(format!(
                            "'{path}': cannot tell the mode of {packed} packed words per {groups} uint8 scales"
                        )))
                    }
                };
                QuantSpec::default_for(mode)
            }
            _ => match (self.config.quantization.default.filter(|d| d.mode == QuantMode::Affine), in_dims) {
                (Some(d), _) => d,
                // A release checkpoint's affine modules carry no record; config.json's dimensions tell.
                (None, Some(k)) => inferred(k)?,
                (None, None) => {
                    return Err(
                        self.fmt_err(format!("'{path}': quantized, but config.json gives no quantization for it"))
                    )
                }
            },
        };
        let k = packed * 32 / spec.bits;
        if k % spec.group_size != 0 || k / spec.group_size != groups {
            return Err(self.fmt_err(format!(
                "'{path}': {packed} packed words and {groups} scales do not fit {} bits in groups of {}",
                spec.bits, spec.group_size
            )));
        }
        let mut shape = w.shape();
        *shape.last_mut().unwrap_or(&mut 0) = k;
        if let Some(e) = expected.filter(|e| **e != shape) {
            let lead = &e[..e.len() - 1];
            let (name, found) = if w.shape()[..w.ndim() - 1] != *lead || k != e[e.len() - 1] {
                (&wname, w.shape())
            } else {
                (&sname, s.shape())
            };
            let msg = format!(
                "{} has shape {found:?}: as {} {}-bit in groups of {}, that is a {shape:?} weight, but config.json \
                 makes it {e:?}",
                self.named(name),
                spec.mode.name(),
                spec.bits,
                spec.group_size
            );
            return Err(self.tensor_err(name, msg));
        }
        if s.shape()[..s.ndim() - 1] != shape[..shape.len() - 1] {
            let msg = format!("{} has shape {:?} for a {shape:?} weight", self.named(&sname), s.shape());
            return Err(self.tensor_err(&sname, msg));
        }
        Ok((shape, SourceFormat::Mlx(spec)))
    }

    /// A plain tensor (lazy).
    pub fn plain(&self, name: &str) -> Result<Array> {
        self.get(name).cloned()
    }

    /// A module's raw tensors by suffix (lazy), e.g. for pass-through copies.
    pub fn module_tensors(&self, m: &Module) -> Result<Vec<(String, Array)>> {
        m.tensors
            .iter()
            .map(|t| {
                let suffix = t.strip_prefix(&m.path).and_then(|s| s.strip_prefix('.')).unwrap_or(t);
                Ok((suffix.to_string(), self.get(t)?.clone()))
            })
            .collect()
    }

    /// A module's weight as f32 `shape` (dequantized when stored quantized).
    pub fn dense(&self, m: &Module) -> Result<Array> {
        let g = |s: &str| self.get(&format!("{}.{s}", m.path)).cloned();
        match &m.format {
            SourceFormat::Dense(_) => g("weight")?.astype(Dtype::F32),
            SourceFormat::Mlx(spec) => self.dequantize_mlx(m, *spec, &g),
            SourceFormat::Codebook => {
                codebook::dequantize_reference(&Codebook { codes: g("codes")?, qh: g("qh")?, scales: g("scales")? })
            }
            SourceFormat::Tiered(affine) => {
                let has = |s: &str| m.tensors.iter().any(|t| t == &format!("{}.{s}", m.path));
                let t = TieredExperts {
                    tier: g("tier")?,
                    slot: g("slot")?,
                    codebook: if has("codebook.codes") {
                        Some(Codebook {
                            codes: g("codebook.codes")?,
                            qh: g("codebook.qh")?,
                            scales: g("codebook.scales")?,
                        })
                    } else {
                        None
                    },
                    mxfp4: if has("mxfp4.weight") {
                        Some(Quantized { weight: g("mxfp4.weight")?, scales: g("mxfp4.scales")?, biases: None })
                    } else {
                        None
                    },
                    affine: match (has("affine.weight"), affine) {
                        (true, Some(spec)) => Some((
                            Quantized {
                                weight: g("affine.weight")?,
                                scales: g("affine.scales")?,
                                biases: Some(g("affine.biases")?),
                            },
                            *spec,
                        )),
                        _ => None,
                    },
                };
                tiered::dequantize_tiered(&t)
            }
        }
    }

    /// An MLX-quantized module (or the part of it `g` returns, by suffix) dequantized to f32, its MX scales
    /// checked first.
    fn dequantize_mlx(&self, m: &Module, spec: QuantSpec, g: &dyn Fn(&str) -> Result<Array>) -> Result<Array> {
        let scales = g("scales")?;
        self.check_e8m0(m, spec, &scales)?;
        let q = Quantized {
            weight: g("weight")?,
            scales,
            biases: if spec.mode.has_biases() { Some(g("biases")?) } else { None },
        };
        quant::dequantize(&q, spec, None, Some(Dtype::F32))
    }

    /// Refuses MX scales (`part`: all or part of the module's) holding E8M0 0xFF, which is NaN: no encoder
    /// writes it for finite weights. The error names the tensor and the byte's place in the whole tensor.
    fn check_e8m0(&self, m: &Module, spec: QuantSpec, part: &Array) -> Result<()> {
        if !matches!(spec.mode, QuantMode::Mxfp4 | QuantMode::Mxfp8) || part.max_all(false)?.item::<u8>()? != 0xFF {
            return Ok(());
        }
        let name = format!("{}.scales", m.path);
        let whole = self.get(&name)?;
        let at = whole.to_vec::<u8>()?.iter().position(|&b| b == 0xFF).unwrap_or(0);
        let msg = format!(
            "{} holds the E8M0 byte 0xFF (NaN) at element {at} of {:?}: a corrupt scale tensor",
            self.named(&name),
            whole.shape()
        );
        Err(self.tensor_err(&name, msg))
    }

    /// Rows `r` (axis 0: experts of a stack, rows of a matrix), and within them `sub` of axis 1 when given,
    /// of a module's weight as f32. Dense and MLX-quantized sources are sliced before they are decoded, so
    /// only the part is ever widened to f32; other formats are decoded whole, then sliced.
    pub fn dense_part(&self, m: &Module, r: Range<i32>, sub: Option<Range<i32>>) -> Result<Array> {
        let cut = |a: &Array| -> Result<Array> {
            let a = a.slice_axis(0, r.start, r.end)?;
            match &sub {
                Some(s) => a.slice_axis(1, s.start, s.end),
                None => Ok(a),
            }
        };
        let g = |s: &str| self.get(&format!("{}.{s}", m.path)).and_then(&cut);
        match &m.format {
            SourceFormat::Dense(_) => g("weight")?.astype(Dtype::F32),
            SourceFormat::Mlx(spec) => self.dequantize_mlx(m, *spec, &g),
            _ => cut(&self.dense(m)?),
        }
    }

    /// Forgets a unit's tensors once written, so their memory can be freed.
    pub fn release(&mut self, unit: &Unit) {
        for m in &unit.modules {
            for t in &m.tensors {
                self.raw.tensors.remove(t);
            }
        }
        for t in &unit.plain {
            self.raw.tensors.remove(t);
        }
    }
}
