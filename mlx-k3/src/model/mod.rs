//! The Kimi K3 model and the DeepSeek-V3 family (`deepseek_v3`, `kimi_k25`) on the same blocks: config,
//! checkpoint loading (mlx-lm and release names, mlx-lm's quantization records), the layers (each in its own
//! file) and caches. The graph matches mlx-lm's `kimi_k3.py` and `deepseek_v3.py`; the fixtures in
//! `tests/fixtures/k3` and `tests/fixtures/deepseek_v3` (made by `scripts/make_k3_fixtures.py` and
//! `scripts/make_deepseek_v3_fixtures.py` with mlx-lm) check that.

pub mod attn_res;
pub mod cache;
pub mod config;
pub mod deepseek_v3;
pub mod kda;
pub mod linear;
pub mod loader;
pub mod mla;
#[allow(clippy::module_inception)]
mod model;
pub mod moe;
pub mod probe;
pub mod shard;
pub mod weights;

pub use cache::{LayerCache, ModelCache};
pub use config::{ModelConfig, TextConfig};
pub use model::{KimiK3, LoadOptions};
