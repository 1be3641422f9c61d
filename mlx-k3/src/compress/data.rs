//! Evaluation and calibration data: token ids from a safetensors file (tensor `tokens`, any integer
//! dtype, flattened) or UTF-8 text encoded with the model's tokenizer, cut into identical windows.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::io::Safetensors;
use crate::tokenizer::Tokenizer;
use crate::{Dtype, Error, Result};

/// Token ids of a data file.
pub fn load_tokens(path: &Path, model_dir: &Path) -> Result<Vec<u32>> {
    let fmt = |m: String| Error::Format { path: path.to_path_buf(), message: m };
    if path.extension().is_some_and(|e| e == "safetensors") {
        crate::model::loader::validate_safetensors(path)?;
        let st = Safetensors::load(path)?;
        let t = st.get("tokens").map_err(|_| fmt("no tensor named 'tokens' (int32 token ids)".into()))?;
        if !t.dtype().is_integer() {
            return Err(fmt(format!("'tokens' has dtype {}, expected integer token ids", t.dtype())));
        }
        let v = t.reshape(&[-1])?.astype(Dtype::I64)?.to_vec::<i64>()?;
        if let Some(bad) = v.iter().find(|&&x| x < 0 || x > u32::MAX as i64) {
            return Err(fmt(format!("'tokens' holds {bad}, which is not a token id")));
        }
        return Ok(v.into_iter().map(|x| x as u32).collect());
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let (tok, _) = Tokenizer::load(model_dir)?;
    tok.encode(&text, false)
}

/// `count` non-overlapping windows of `ctx` tokens, starting at window `skip`.
pub fn windows(tokens: &[u32], ctx: usize, count: usize, skip: usize, path: &Path) -> Result<Vec<Vec<u32>>> {
    let fmt = |m: String| Error::Format { path: path.to_path_buf(), message: m };
    if ctx < 2 {
        return Err(Error::invalid("data", format!("--ctx {ctx}: a window needs at least 2 tokens")));
    }
    if count == 0 {
        return Err(Error::invalid("data", "--windows 0: at least one window is needed"));
    }
    if tokens.len() < ctx {
        return Err(fmt(format!("{} tokens are shorter than one window of {ctx} tokens (--ctx)", tokens.len())));
    }
    let have = tokens.len() / ctx;
    if skip + count > have {
        return Err(fmt(format!(
            "holds {have} windows of {ctx} tokens; --skip {skip} --windows {count} needs {}",
            skip + count
        )));
    }
    Ok((skip..skip + count).map(|i| tokens[i * ctx..(i + 1) * ctx].to_vec()).collect())
}

/// SHA-256 (hex, 16 digits) of the windows' token ids: identifies the evaluation set.
pub fn windows_id(windows: &[Vec<u32>]) -> String {
    let mut h = Sha256::new();
    for w in windows {
        h.update((w.len() as u64).to_le_bytes());
        for t in w {
            h.update(t.to_le_bytes());
        }
    }
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}
