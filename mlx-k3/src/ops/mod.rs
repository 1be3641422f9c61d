//! Ops on [`Array`](crate::Array): methods for the common ones, free functions where an op has several
//! array inputs of equal standing (`concatenate`, `where_`, ...).
//!
//! Every op is lazy and returns `Result`: MLX's shape and dtype checks run when the graph is built, so a
//! mismatch is an [`Error::Mlx`](crate::Error::Mlx) carrying MLX's message, never a panic or an abort.

mod creation;
mod elementwise;
mod linalg;
mod reduce;
pub(crate) mod shape;

pub use creation::{arange, eye, full, ones, zeros};
pub use elementwise::{where_, Operand};
pub use linalg::{addmm, gather_mm};
pub use shape::{concatenate, stack};
