//! The Kimi K3 model and the DeepSeek-V3 family (`deepseek_v3`, `kimi_k25`, `deepseek_v32` with the DSA
//! indexer) on the same blocks: config, checkpoint loading (mlx-lm and release names, mlx-lm's quantization
//! records), the layers (each in its own file) and caches. The graph matches mlx-lm's `kimi_k3.py`,
//! `deepseek_v3.py` and `deepseek_v32.py`; the fixtures in `tests/fixtures/k3`, `tests/fixtures/deepseek_v3`
//! and `tests/fixtures/deepseek_v32` (made by the `scripts/make_*_fixtures.py` of the same names with
//! mlx-lm) check that.

pub mod attn_res;
pub mod cache;
pub mod config;
pub mod deepseek_v3;
pub mod indexer;
pub mod kda;
pub mod linear;
pub mod loader;
pub mod mla;
#[allow(clippy::module_inception)]
mod model;
pub mod moe;
pub mod mtp;
pub mod probe;
pub mod shard;
pub mod vision;
pub mod weights;

pub use cache::{LayerCache, ModelCache};
pub use config::{ModelConfig, TextConfig};
pub use model::{DecoderLayer, KimiK3, LayerState, LoadOptions};
