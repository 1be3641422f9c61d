//! Building compressed checkpoints and measuring them (docs/formats.md#iq1_s-quantizer, #importance-matrix, #reap-expert-pruning).
//!
//! - [`convert`]: re-encodes a checkpoint per a [`recipe`] (a format per tensor class: MLX affine with an
//!   MSE clip search, mxfp4/mxfp8/nvfp4, the ternary codebook, MXFP4 tiers), one decoder layer at a time;
//! - [`calibrate`]: runs text through a model and records the importance matrix (mean x² per input column,
//!   per expert for expert stacks) and routing statistics;
//! - [`calib_stats`]: the statistics file `calibrate` writes and the other tools read;
//! - [`promotion`]: which experts of a tiered stack are promoted to the protected (MXFP4) band (Hessian-weighted
//!   error × activation mass, waterfilled over depth), and re-tiering for a profile;
//! - [`prune`]: REAP expert pruning with retained routing mass;
//! - [`dwq`]: layer-wise distillation of a build's quantization parameters toward its teacher;
//! - [`evalkl`]: perplexity and KL(teacher ‖ build) on identical windows, with a compact teacher cache.
//!
//! Every tool writes through [`store`]: atomic files, a journal of finished units, byte-identical results
//! after an interruption and rerun.

pub mod affine;
pub mod calib_stats;
pub mod calibrate;
pub mod classes;
pub mod convert;
pub mod data;
pub mod dwq;
pub mod evalkl;
pub mod gguf_import;
pub mod gguf_tokenizer;
pub mod progress;
pub mod promotion;
pub mod prune;
pub mod recipe;
pub mod source;
pub mod store;

pub use calib_stats::Calibration;
pub use classes::TensorClass;
pub use progress::{Progress, Silent};
pub use recipe::Recipe;
