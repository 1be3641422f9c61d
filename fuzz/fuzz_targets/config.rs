//! `config.json` parsing and validation (`ModelConfig::parse`): any text is a config or an error naming the
//! file; a config that passes holds what the model builder relies on (checked here by walking its layers the
//! way loading does).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mlx_k3::model::config::{ModelConfig, MAX_LAYERS};
use mlx_k3::Error;
use mlx_k3_fuzz::{allocation_budget, LargestAlloc};

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc::new();

fuzz_target!(|data: &[u8]| {
    ALLOC.reset();
    check(data);
    let (largest, budget) = (ALLOC.largest(), allocation_budget(data.len()));
    assert!(largest <= budget, "{largest} bytes allocated at once for a {}-byte input", data.len());
});

fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("/fuzz/config.json");
    match ModelConfig::parse(text, path) {
        Err(Error::Format { path: p, message }) => {
            assert_eq!(p, path, "the error names the file");
            assert!(!message.is_empty());
        }
        Err(e) => panic!("a config error that does not name the file: {e}"),
        Ok(cfg) => {
            let t = &cfg.text;
            assert!((1..=MAX_LAYERS).contains(&t.num_hidden_layers));
            assert!(t.hidden_size > 0 && t.vocab_size > 0);
            assert!(t.hidden_size <= i32::MAX as usize && t.vocab_size <= i32::MAX as usize);
            let mut mla_layers = 0;
            for i in 0..t.num_hidden_layers {
                if !t.is_kda(i) {
                    mla_layers += 1;
                }
                let _ = t.is_moe(i);
            }
            if mla_layers > 0 {
                let m = t.mla().expect("validate() promised the MLA dimensions");
                assert!(m.heads > 0 && m.kv_lora_rank > 0 && m.qk_nope > 0 && m.v_head > 0);
            }
            if t.num_experts.unwrap_or(0) > 0 {
                assert!((1..=t.num_experts.unwrap()).contains(&t.num_experts_per_token));
            }
            assert!(t.situ_beta().is_finite() || t.activation_situ_beta.is_none());
        }
    }
}
