//! Building compressed checkpoints and measuring them (cards 000, 002, 003; SPEC_NOTES §2.4-2.6, §6).
//!
//! - [`convert`]: re-encodes a checkpoint per a [`recipe`] (a format per tensor class: MLX affine with an
//!   MSE clip search, mxfp4/mxfp8/nvfp4, the ternary codebook, MXFP4 tiers), one decoder layer at a time;
//! - [`calibrate`]: runs text through a model and records the importance matrix (mean x² per input column,
//!   per expert for expert stacks) and routing statistics;
//! - [`tier`]: the protected-band selection (Hessian-weighted error × activation mass, waterfilled over
//!   depth) and re-tiering for a profile;
//! - [`prune`]: REAP expert pruning with retained routing mass;
//! - [`evalkl`]: perplexity and KL(teacher ‖ build) on identical windows, with a compact teacher cache.
//!
//! Every tool writes through [`store`]: atomic files, a journal of finished units, byte-identical results
//! after an interruption and rerun.

pub mod affine;
pub mod calib;
pub mod calibrate;
pub mod classes;
pub mod convert;
pub mod data;
pub mod evalkl;
pub mod prune;
pub mod recipe;
pub mod source;
pub mod store;
pub mod tier;

pub use calib::Calibration;
pub use classes::TensorClass;
pub use recipe::Recipe;
