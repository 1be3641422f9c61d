//! Request fields shared by the endpoints (limits, sampling, stop strings, thinking effort), checked and turned
//! into the engine's [`GenerateOptions`]. Each bad value is a 400 that names its field.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use super::error::ApiError;
use mlx_k3::chat::ThinkingEffort;
use mlx_k3::generate::{GenerateOptions, SamplerConfig, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// The sampling fields of a request, as sent.
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    /// `speculative`: false opts out of speculative decoding (when the server has a draft model).
    pub speculative: Option<bool>,
}

impl Sampling {
    /// Engine options; `default_max_tokens` applies when the request gives none (the engine also stops at
    /// the context length).
    pub fn options(&self, default_max_tokens: usize) -> Result<GenerateOptions, ApiError> {
        let max_tokens = self.max_tokens.unwrap_or(default_max_tokens);
        if max_tokens == 0 {
            return Err(ApiError::bad_param("max_tokens", "max_tokens must be at least 1"));
        }
        // OpenAI's defaults: temperature 1, top_p 1 (off).
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad_param(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::bad_param("top_p", format!("top_p must be in [0, 1], got {top_p}")));
        }
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::bad_param("min_p", format!("min_p must be in [0, 1], got {min_p}")));
        }
        if let Some(p) = self.presence_penalty.filter(|p| !(-2.0..=2.0).contains(p)) {
            return Err(ApiError::bad_param(
                "presence_penalty",
                format!("presence_penalty must be in [-2, 2], got {p}"),
            ));
        }
        if let Some(p) = self.repetition_penalty.filter(|p| !(*p > 0.0 && p.is_finite())) {
            return Err(ApiError::bad_param("repetition_penalty", format!("repetition_penalty must be > 0, got {p}")));
        }
        let stop_strings = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop_strings.iter().any(String::is_empty) {
            return Err(ApiError::bad_param("stop", "stop strings must not be empty"));
        }
        // Generation's own limits, checked here so that such a request is refused before it is queued.
        if stop_strings.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_param(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings, got {}", stop_strings.len()),
            ));
        }
        if let Some(long) = stop_strings.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(ApiError::bad_param(
                "stop",
                format!("stop strings must be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}", long.len()),
            ));
        }
        let mut logit_bias = Vec::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let id: u32 = k
                .parse()
                .map_err(|_| ApiError::bad_param("logit_bias", format!("logit_bias key '{k}' is not a token id")))?;
            if !(-100.0..=100.0).contains(v) {
                return Err(ApiError::bad_param(
                    "logit_bias",
                    format!("logit_bias values must be in [-100, 100], got {v}"),
                ));
            }
            logit_bias.push((id, *v));
        }
        logit_bias.sort_by_key(|(id, _)| *id);
        Ok(GenerateOptions {
            max_tokens,
            sampler: SamplerConfig {
                temperature,
                top_p: if top_p >= 1.0 { 0.0 } else { top_p },
                min_p,
                top_k: self.top_k.unwrap_or(0),
                repetition_penalty: self.repetition_penalty,
                presence_penalty: self.presence_penalty,
                logit_bias,
                seed: self.seed.unwrap_or_else(fresh_seed),
                ..SamplerConfig::default()
            },
            stop_strings,
            speculative: self.speculative.unwrap_or(true),
            ..GenerateOptions::default()
        })
    }
}

/// A seed for requests that give none, so that repeated sampled requests differ (OpenAI's behaviour).
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
}

/// Thinking effort from `thinking_effort` (off, low, high, max) or OpenAI's `reasoning_effort`
/// (none/minimal = off, low, medium = high, high, xhigh = max).
pub fn thinking_effort(thinking: Option<&str>, reasoning: Option<&str>) -> Result<ThinkingEffort, ApiError> {
    if let Some(t) = thinking {
        return ThinkingEffort::from_name(t).ok_or_else(|| {
            ApiError::bad_param("thinking_effort", format!("thinking_effort '{t}' is not off, low, high or max"))
        });
    }
    Ok(match reasoning {
        None => ThinkingEffort::default(),
        Some("none" | "minimal") => ThinkingEffort::Off,
        Some("low") => ThinkingEffort::Low,
        Some("medium" | "high") => ThinkingEffort::High,
        Some("xhigh" | "max") => ThinkingEffort::Max,
        Some(other) => {
            return Err(ApiError::bad_param(
                "reasoning_effort",
                format!("reasoning_effort '{other}' is not none, minimal, low, medium, high or xhigh"),
            ))
        }
    })
}

/// Seconds since the epoch (OpenAI's `created`).
pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A response id with `prefix` (`chatcmpl`, `cmpl`) and 96 random bits.
pub fn response_id(prefix: &str) -> String {
    format!("{prefix}-{}", random_hex::<12>())
}

/// `N` random bytes in hex, from `rand`'s thread generator (a CSPRNG seeded by the operating system).
pub fn random_hex<const N: usize>() -> String {
    let bytes: [u8; N] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A session id: at most 128 printable ASCII characters.
pub fn check_session(session: Option<String>) -> Result<Option<String>, ApiError> {
    match session {
        Some(s) if s.is_empty() || s.len() > 128 || !s.chars().all(|c| c.is_ascii_graphic()) => {
            Err(ApiError::bad_param("session", "session must be 1 to 128 printable ASCII characters without spaces"))
        }
        s => Ok(s),
    }
}
