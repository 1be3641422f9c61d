//! Kimi's tiktoken tokenizer: `tiktoken.model` holds one `base64(token bytes) rank` per line; the special
//! tokens follow the regular ones (ids `n .. n + 258`: 256 reserved plus 2), named by `added_tokens_decoder`
//! in `tokenizer_config.json`, the unnamed ones `<|reserved_token_{id}|>`. Text is pre-split with Kimi's
//! pattern ([`KIMI_PATTERN`]), which keeps runs of Han characters apart from other letters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use base64::Engine as _;
use serde_json::Value;
use tiktoken_rs::CoreBPE;

use crate::{Error, Result};

/// Kimi's pre-tokenization regex (tiktoken `pat_str` of Moonshot's `tokenization_kimi.py`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The split pattern of the merge-only encoder: one piece, whatever the text.
const WHOLE_PIECE: &str = r"(?s:.+)";

/// The two last alternatives of tiktoken-style patterns (Kimi's, cl100k's, o200k's): a run of whitespace
/// that leaves its last character to the next pre-token when one follows, else the whole run.
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Cuts text into pre-tokens as tiktoken's fancy-regex split does, in linear time.
///
/// tiktoken runs the pattern with fancy-regex, a backtracking engine: `\s+(?!\S)` pushes a backtrack
/// entry per character, so a run of a million spaces exceeds its stack and the split fails. Patterns made
/// of regular alternatives followed by [`WHITESPACE_TAIL`] run instead on the `regex` crate (finite
/// automata: linear time, no stack), with the tail as `(\s+)` and its look-ahead applied afterwards. That
/// gives the same pre-tokens: leftmost-first alternation picks the same alternative as backtracking, and
/// where the head fails at position i on whitespace, `\s+(?!\S)` backtracks from the whole run [i, r) to
/// [i, r - 1 char) when a non-space follows at r and the run has two characters or more, else takes
/// [i, r) (at the end of the text) or fails and leaves the one character to `\s+`; the post-step does
/// exactly that. Other patterns keep fancy-regex.
enum PreTokenizer {
    /// The `regex` crate; `tail`: the pattern ended with [`WHITESPACE_TAIL`], now capture group 1.
    Linear { re: regex::Regex, tail: bool },
    /// A pattern with look-around elsewhere.
    Backtracking(fancy_regex::Regex),
}

impl PreTokenizer {
    fn new(pattern: &str) -> Result<PreTokenizer> {
        let bad = |e: String| Error::invalid("tiktoken", format!("bad split pattern: {e}"));
        // The head must be a whole regex by itself, so that the tail was a top-level alternative.
        if let Some(head) = pattern.strip_suffix(WHITESPACE_TAIL).filter(|h| regex::Regex::new(h).is_ok()) {
            if let Ok(re) = regex::Regex::new(&format!(r"{head}|(\s+)")) {
                return Ok(PreTokenizer::Linear { re, tail: true });
            }
        }
        if let Ok(re) = regex::Regex::new(pattern) {
            return Ok(PreTokenizer::Linear { re, tail: false });
        }
        fancy_regex::Regex::new(pattern).map(PreTokenizer::Backtracking).map_err(|e| bad(e.to_string()))
    }

    /// Calls `f` on each pre-token of `text`, in order.
    fn split<'t>(&self, text: &'t str, f: &mut dyn FnMut(&'t str)) -> Result<()> {
        match self {
            PreTokenizer::Linear { re, tail } => {
                let group = re.captures_len() - 1;
                let mut locs = re.capture_locations();
                let mut at = 0;
                while let Some(m) = re.find_at(text, at) {
                    let (start, mut end) = (m.start(), m.end());
                    // The look-ahead of `\s+(?!\S)`: with a non-space after the run, give back the last
                    // character if the run has two or more. Only whitespace matches are candidates, and
                    // only those from the tail alternative (the capture says which).
                    if *tail && end < text.len() && !text[end..].starts_with(char::is_whitespace) {
                        let piece = &text[start..end];
                        let mut chars = piece.char_indices();
                        let last = chars.next_back().map_or(0, |(i, _)| i);
                        if last > 0 && piece.starts_with(char::is_whitespace) {
                            re.captures_read_at(&mut locs, text, start);
                            if locs.get(group) == Some((start, end)) {
                                end = start + last;
                            }
                        }
                    }
                    f(&text[start..end]);
                    at = end;
                }
                Ok(())
            }
            PreTokenizer::Backtracking(re) => {
                for m in re.find_iter(text) {
                    let m = m.map_err(|e| {
                        Error::invalid("tokenizer", format!("the split pattern failed on the text: {e}"))
                    })?;
                    f(m.as_str());
                }
                Ok(())
            }
        }
    }
}

/// Special-token slots after the regular vocabulary (Kimi's `num_reserved_special_tokens + 2`).
pub const NUM_SPECIAL: u32 = 258;

/// A tiktoken-format tokenizer.
pub struct TiktokenTokenizer {
    /// Byte-pair merging only: its split pattern takes a whole pre-token as one piece.
    bpe: CoreBPE,
    /// Token ids by bytes: a pre-token that is a whole token skips the merge call (as tiktoken does).
    ranks: rustc_hash::FxHashMap<Vec<u8>, u32>,
    pre: PreTokenizer,
    /// Special-token texts, for encoding with special tokens allowed.
    special_matcher: Option<aho_corasick::AhoCorasick>,
    decoder: Vec<Vec<u8>>,
    special: BTreeMap<String, u32>,
    special_by_id: HashMap<u32, String>,
    n_base: u32,
}

impl TiktokenTokenizer {
    /// Loads `tiktoken.model`, naming specials from `tokenizer_config` (read from `cfg_path`).
    pub fn load(path: &Path, tokenizer_config: &Value, cfg_path: &Path) -> Result<TiktokenTokenizer> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let fmt =
            |line: usize, m: String| Error::Format { path: path.to_path_buf(), message: format!("line {line}: {m}") };
        let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (tok, rank) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok)
                .map_err(|e| fmt(i + 1, format!("bad base64 token: {e}")))?;
            let rank: u32 = rank.parse().map_err(|_| fmt(i + 1, format!("bad rank '{rank}'")))?;
            if ranks.insert(bytes, rank).is_some() {
                return Err(fmt(i + 1, "duplicate token".into()));
            }
        }
        Self::from_ranks(ranks, tokenizer_config, KIMI_PATTERN).map_err(|e| match e {
            // Rank problems are the model file's; special-token names are the config's.
            Error::InvalidArgument { op: "tiktoken", message } => Error::Format { path: path.to_path_buf(), message },
            Error::InvalidArgument { message, .. } => Error::Format { path: cfg_path.to_path_buf(), message },
            other => other,
        })
    }

    /// Builds from mergeable ranks, a tokenizer config (for special-token names) and a split pattern.
    pub fn from_ranks(ranks: HashMap<Vec<u8>, u32>, tokenizer_config: &Value, pattern: &str) -> Result<Self> {
        let n_base = ranks.len() as u32;
        let mut decoder = vec![Vec::new(); n_base as usize];
        let mut seen = HashSet::new();
        for (bytes, &rank) in &ranks {
            if rank >= n_base || !seen.insert(rank) {
                return Err(Error::invalid(
                    "tiktoken",
                    format!("ranks must be 0..{n_base} without repeats; found {rank}"),
                ));
            }
            decoder[rank as usize] = bytes.clone();
        }
        for b in 0..=255u8 {
            if !ranks.contains_key(&vec![b]) {
                return Err(Error::invalid("tiktoken", format!("the single byte {b:#04x} has no token")));
            }
        }
        let mut names: HashMap<u32, String> = HashMap::new();
        if let Some(Value::Object(added)) = tokenizer_config.get("added_tokens_decoder") {
            for (id, v) in added {
                let id: u32 = id
                    .parse()
                    .map_err(|_| Error::invalid("tokenizer_config", format!("added_tokens_decoder: bad id '{id}'")))?;
                if let Some(c) = v.get("content").and_then(Value::as_str) {
                    names.insert(id, c.to_string());
                }
            }
        }
        let mut special = BTreeMap::new();
        for id in n_base..n_base + NUM_SPECIAL {
            let name = names.remove(&id).unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            special.insert(name, id);
        }
        if let Some((id, name)) = names.iter().find(|(id, _)| **id < n_base) {
            return Err(Error::invalid(
                "tokenizer_config",
                format!("added_tokens_decoder names id {id} ('{name}'), which is a regular token"),
            ));
        }
        let special_by_id = special.iter().map(|(k, v)| (*v, k.clone())).collect();
        let ranks: rustc_hash::FxHashMap<Vec<u8>, u32> = ranks.into_iter().collect();
        let pre = PreTokenizer::new(pattern)?;
        let bpe = CoreBPE::new(ranks.clone(), Default::default(), WHOLE_PIECE)
            .map_err(|e| Error::invalid("tiktoken", format!("cannot build the encoder: {e}")))?;
        let names: Vec<&str> = special.keys().map(String::as_str).filter(|s| !s.is_empty()).collect();
        let special_matcher = if names.is_empty() {
            None
        } else {
            Some(
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&names)
                    .map_err(|e| Error::invalid("tokenizer_config", format!("cannot match the special tokens: {e}")))?,
            )
        };
        Ok(TiktokenTokenizer { bpe, ranks, pre, special_matcher, decoder, special, special_by_id, n_base })
    }

    /// Encodes `text`; with `allow_special`, special-token strings become their ids (as Kimi's tokenizer
    /// does by default), else they are encoded as ordinary text. The ids are tiktoken's for every input
    /// (tests/k3_nano.rs and tests/tokenizer.rs compare them with Python tiktoken's and with the
    /// pre-tokens of tiktoken's own fancy-regex split); the time grows about linearly with the text,
    /// however long one pre-token is (docs/correctness.md, "Tokenizer").
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        if let Some(specials) = self.special_matcher.as_ref().filter(|_| allow_special) {
            for m in specials.find_iter(text) {
                self.encode_ordinary(&text[at..m.start()], &mut ids)?;
                ids.push(self.special[&text[m.start()..m.end()]]);
                at = m.end();
            }
        }
        self.encode_ordinary(&text[at..], &mut ids)?;
        Ok(ids)
    }

    fn encode_ordinary(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        // Each pre-token is merged on its own: `WHOLE_PIECE` hands it to tiktoken's merge unsplit, which
        // looks the piece up first and merges pieces of 100 bytes or more with upstream tiktoken's heap-based
        // `_byte_pair_merge_large` (O(n log n); the same merges in the same order as the quadratic scan).
        self.pre.split(text, &mut |piece| match self.ranks.get(piece.as_bytes()) {
            Some(&id) => ids.push(id),
            None => ids.extend(self.bpe.encode_ordinary(piece)),
        })
    }

    /// Bytes of token `id`.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id < self.n_base {
            self.decoder.get(id as usize).cloned()
        } else {
            self.special_by_id.get(&id).map(|s| s.as_bytes().to_vec())
        }
    }

    /// The id of a regular token's text or a special token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.special.get(token) {
            return Some(id);
        }
        let ids = self.encode(token, false).ok()?;
        (ids.len() == 1).then(|| ids[0])
    }

    /// Regular plus special ids.
    pub fn vocab_size(&self) -> usize {
        (self.n_base + NUM_SPECIAL) as usize
    }

    /// Special tokens by name.
    pub fn special_tokens(&self) -> &BTreeMap<String, u32> {
        &self.special
    }

    /// Whether `id` is special.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base
    }
}
