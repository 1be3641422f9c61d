//! Optimizers for training a few named parameters (quantization scales and biases, norms) against a loss.
//!
//! [`Adam`] keeps, for each parameter, a float32 master copy and the two moment estimates, and updates the
//! master copy; the parameter in its own dtype (float16 codebook scales, bfloat16 biases) is the master copy
//! cast at the end of each step. Updates of 1e-6 relative size, far below a float16 ulp, therefore
//! accumulate instead of rounding away.
//!
//! ```no_run
//! use mlx_k3::{optim::Adam, transforms, Array};
//! let w = Array::from_slice(&[1.0f32, -2.0], &[2])?;
//! let mut opt = Adam::new(0.1)?;
//! opt.add("w", &w)?;
//! for _ in 0..10 {
//!     let w = opt.param("w")?;
//!     let g = transforms::grad(|a: &[Array]| Ok(vec![a[0].square()?.sum_all(false)?]), &[w], &[0])?;
//!     opt.update(&[("w", &g[0])])?;
//! }
//! # Ok::<(), mlx_k3::Error>(())
//! ```

use std::collections::BTreeMap;

use crate::{ops, Array, Dtype, Error, Result};

/// One trained parameter: its float32 master copy, its moments and the dtype it is used in.
struct Slot {
    master: Array,
    m: Array,
    v: Array,
    dtype: Dtype,
    shape: Vec<i32>,
}

/// Adam with bias correction (Kingma & Ba, 2015), on float32 master copies of named parameters.
///
/// For a step t = 1, 2, ... and gradient g (cast to float32):
/// `m = β1·m + (1 − β1)·g`, `v = β2·v + (1 − β2)·g²`,
/// `w = w − lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)`.
/// This is `mlx.optimizers.Adam(lr, betas, eps, bias_correction=True)` evaluated in float32 (MLX's default
/// is without bias correction; the correction matters for the short per-block runs DWQ makes). The step
/// counter is shared by all parameters, as in MLX: it advances once per [`Adam::update`].
pub struct Adam {
    learning_rate: f64,
    betas: (f64, f64),
    eps: f64,
    step: u64,
    slots: BTreeMap<String, Slot>,
}

impl std::fmt::Debug for Adam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adam")
            .field("learning_rate", &self.learning_rate)
            .field("betas", &self.betas)
            .field("eps", &self.eps)
            .field("step", &self.step)
            .field("params", &self.slots.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Adam {
    /// Adam with learning rate `learning_rate`, β = (0.9, 0.999) and ε = 1e-8 (MLX's defaults).
    pub fn new(learning_rate: f64) -> Result<Adam> {
        Adam::with_options(learning_rate, (0.9, 0.999), 1e-8)
    }

    /// Adam with every hyper-parameter given: a finite learning rate >= 0, each β in [0, 1), a finite ε >= 0.
    pub fn with_options(learning_rate: f64, betas: (f64, f64), eps: f64) -> Result<Adam> {
        let mut a = Adam { learning_rate: 0.0, betas, eps, step: 0, slots: BTreeMap::new() };
        a.set_learning_rate(learning_rate)?;
        for (i, b) in [betas.0, betas.1].into_iter().enumerate() {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::invalid("Adam", format!("beta{} must be in [0, 1), got {b}", i + 1)));
            }
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::invalid("Adam", format!("eps must be finite and >= 0, got {eps}")));
        }
        Ok(a)
    }

    /// Changes the learning rate for the following steps (a schedule, or a rollback's smaller step).
    pub fn set_learning_rate(&mut self, learning_rate: f64) -> Result<()> {
        if !(learning_rate.is_finite() && learning_rate >= 0.0) {
            return Err(Error::invalid(
                "Adam",
                format!("the learning rate must be finite and >= 0, got {learning_rate}"),
            ));
        }
        self.learning_rate = learning_rate;
        Ok(())
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    /// Steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Starts training `value` under `name`: a float32 master copy of it and zero moments. The parameter
    /// must be floating point; a name may be added once.
    pub fn add(&mut self, name: &str, value: &Array) -> Result<()> {
        if self.slots.contains_key(name) {
            return Err(Error::invalid("Adam", format!("parameter `{name}` was already added")));
        }
        let dtype = value.dtype();
        if !dtype.is_float() {
            return Err(Error::invalid(
                "Adam",
                format!("parameter `{name}` has dtype {dtype}; only floating-point parameters train"),
            ));
        }
        let shape = value.shape();
        // A copy, so that the master never aliases the caller's array.
        let master = value.astype(Dtype::F32)?.copy()?;
        let m = ops::zeros(&shape, Dtype::F32)?;
        let v = ops::zeros(&shape, Dtype::F32)?;
        crate::eval(&[&master, &m, &v])?;
        self.slots.insert(name.to_string(), Slot { master, m, v, dtype, shape });
        Ok(())
    }

    /// The names of the trained parameters, sorted.
    pub fn names(&self) -> Vec<String> {
        self.slots.keys().cloned().collect()
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots.get(name).ok_or_else(|| Error::invalid("Adam", format!("no parameter named `{name}`")))
    }

    /// The float32 master copy of a parameter.
    pub fn master(&self, name: &str) -> Result<&Array> {
        Ok(&self.slot(name)?.master)
    }

    /// The first and second moment estimates of a parameter (float32, not bias-corrected).
    pub fn moments(&self, name: &str) -> Result<(&Array, &Array)> {
        let s = self.slot(name)?;
        Ok((&s.m, &s.v))
    }

    /// A parameter in the dtype it was added with (the master copy, cast).
    pub fn param(&self, name: &str) -> Result<Array> {
        let s = self.slot(name)?;
        s.master.astype(s.dtype)
    }

    /// Every parameter, by name, in its own dtype.
    pub fn params(&self) -> Result<Vec<(String, Array)>> {
        self.slots.iter().map(|(k, s)| Ok((k.clone(), s.master.astype(s.dtype)?))).collect()
    }

    /// Puts back a state saved from [`Adam::master`], [`Adam::moments`] and [`Adam::step`] (a resumed run):
    /// the master copy and both moments of parameter `name` (float32, shaped like it). With the same step
    /// count (see [`Adam::set_step`]) the following updates are those of the run that saved it.
    pub fn restore(&mut self, name: &str, master: &Array, m: &Array, v: &Array) -> Result<()> {
        let s = self.slot(name)?;
        for (what, a) in [("master copy", master), ("first moment", m), ("second moment", v)] {
            if a.shape() != s.shape || a.dtype() != Dtype::F32 {
                return Err(Error::invalid(
                    "Adam",
                    format!(
                        "the saved {what} of `{name}` is {} {:?}, expected float32 {:?}",
                        a.dtype(),
                        a.shape(),
                        s.shape
                    ),
                ));
            }
        }
        let (master, m, v) = (master.copy()?, m.copy()?, v.copy()?);
        crate::eval(&[&master, &m, &v])?;
        let s = self.slots.get_mut(name).expect("checked above");
        s.master = master;
        s.m = m;
        s.v = v;
        Ok(())
    }

    /// Sets the step counter (the bias corrections of the next update use `step + 1`): a resumed run.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// One step: each gradient updates the parameter it names (shaped like it; any floating dtype, cast to
    /// float32). Parameters without a gradient in this step keep their value and moments. The new state is
    /// evaluated before returning, so the graph does not grow from step to step. On an error nothing changes.
    pub fn update(&mut self, grads: &[(&str, &Array)]) -> Result<()> {
        for (i, (name, g)) in grads.iter().enumerate() {
            let s = self.slot(name)?;
            if g.shape() != s.shape {
                return Err(Error::invalid(
                    "Adam",
                    format!("the gradient of `{name}` has shape {:?}, the parameter {:?}", g.shape(), s.shape),
                ));
            }
            if !g.dtype().is_float() {
                return Err(Error::invalid("Adam", format!("the gradient of `{name}` has dtype {}", g.dtype())));
            }
            if grads[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::invalid("Adam", format!("two gradients for `{name}` in one step")));
            }
        }
        let t = self.step + 1;
        let (b1, b2) = self.betas;
        // The scalars are formed in f64 on the host and enter the f32 graph rounded once (as MLX's Python
        // floats do): 1 − β, and the bias corrections c1 = lr / (1 − β1^t), c2 = 1 / sqrt(1 − β2^t).
        let c1 = self.learning_rate / (1.0 - b1.powf(t as f64));
        let c2 = 1.0 / (1.0 - b2.powf(t as f64)).sqrt();
        let mut next = Vec::with_capacity(grads.len());
        for (name, g) in grads {
            let s = self.slot(name)?;
            let g = g.astype(Dtype::F32)?;
            let m = s.m.multiply(b1)?.add(&g.multiply(1.0 - b1)?)?;
            let v = s.v.multiply(b2)?.add(&g.square()?.multiply(1.0 - b2)?)?;
            let denom = v.sqrt()?.multiply(c2)?.add(self.eps)?;
            let master = s.master.subtract(&m.multiply(c1)?.divide(&denom)?)?;
            next.push((name.to_string(), master, m, v));
        }
        let all: Vec<&Array> = next.iter().flat_map(|(_, w, m, v)| [w, m, v]).collect();
        crate::eval(&all)?;
        for (name, master, m, v) in next {
            let s = self.slots.get_mut(&name).expect("checked above");
            s.master = master;
            s.m = m;
            s.v = v;
        }
        self.step = t;
        Ok(())
    }
}
