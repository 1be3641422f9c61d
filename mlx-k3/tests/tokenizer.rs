//! The tiktoken tokenizer on long pre-tokens (issue 41, item 2): encoding one enormous pre-token (a word
//! repeated without spaces, a run of spaces or newlines) takes about linear time and never fails, and the
//! ids are tiktoken's for every input: Python tiktoken's on long pieces and seeded random strings
//! (tests/fixtures/tokenizer/k3_nano_long_ids.json, made by scripts/make_tokenizer_fixtures.py), a plain
//! quadratic BPE merge's on single long pieces, and `tiktoken-rs`'s own fancy-regex encoder's on random
//! text (which cannot split a run of a million spaces at all).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use mlx_k3::tokenizer::{Tokenizer, KIMI_PATTERN};

fn nano() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/k3-nano")
}

fn ranks() -> HashMap<Vec<u8>, u32> {
    let text = std::fs::read_to_string(nano().join("tiktoken.model")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (tok, rank) = l.split_once(' ').unwrap();
            (base64::engine::general_purpose::STANDARD.decode(tok).unwrap(), rank.trim().parse().unwrap())
        })
        .collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn long_pieces_and_random_strings_give_python_tiktokens_ids() {
    let (tok, _) = Tokenizer::load(&nano()).unwrap();
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/k3_nano_long_ids.json");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 70);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let want_ordinary = c.get("ordinary_ids").map(ids).unwrap_or_else(|| want.clone());
        let short: String = text.chars().take(40).collect();
        assert_eq!(tok.encode(text, true).unwrap(), want, "{short:?}... ({} bytes)", text.len());
        assert_eq!(tok.encode(text, false).unwrap(), want_ordinary, "{short:?}... as ordinary text");
    }
}

/// The textbook merge: while some adjacent pair of parts is a token, merge the pair of lowest rank
/// (the leftmost on a tie). Quadratic, and independent of tiktoken's code.
fn naive_bpe(piece: &[u8], ranks: &HashMap<Vec<u8>, u32>) -> Vec<u32> {
    let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
    loop {
        let best = (0..parts.len().saturating_sub(1))
            .filter_map(|i| ranks.get(&[parts[i].as_slice(), &parts[i + 1]].concat()).map(|&r| (r, i)))
            .min();
        let Some((_, i)) = best else { break };
        let right = parts.remove(i + 1);
        parts[i].extend(right);
    }
    parts.iter().map(|p| ranks[p]).collect()
}

#[test]
fn one_long_piece_merges_as_the_textbook_rule_does() {
    let (tok, _) = Tokenizer::load(&nano()).unwrap();
    let ranks = ranks();
    // Each text is a single pre-token of Kimi's pattern (a letter run; whitespace at the end of the text).
    for text in ["hello".repeat(200), "abcab".repeat(150), " ".repeat(1200), "\t \t".repeat(300), "é".repeat(400)] {
        assert_eq!(tok.encode(&text, false).unwrap(), naive_bpe(text.as_bytes(), &ranks), "{:?}...", &text[..10]);
    }
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[test]
fn ids_equal_tiktoken_rs_fancy_regex_encoder_on_random_text() {
    // tiktoken-rs split with fancy-regex, Kimi's pattern unchanged: the encoder this tokenizer replaces.
    let (tok, _) = Tokenizer::load(&nano()).unwrap();
    let reference = tiktoken_rs::CoreBPE::new(ranks().into_iter().collect(), Default::default(), KIMI_PATTERN).unwrap();
    let alphabet = [
        " ", " ", "  ", "   ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "a", "z", "B", "QQ", "é", "ß", "中", "文",
        "1", "42", "7", "!", ".", "-", "'", "'s", "'T", "'ll", "\u{3000}", "\u{a0}", "\u{2028}", "\u{85}", "e\u{301}",
        "\u{301}", "😀", "_", "#", "Ⅻ", "ǅ", "ʰ",
    ];
    let mut rng = Rng(7);
    for i in 0..3000 {
        let n = 1 + (rng.next() % 60) as usize;
        let text: String = (0..n).map(|_| alphabet[(rng.next() % alphabet.len() as u64) as usize]).collect();
        let want = reference.encode_ordinary(&text);
        assert_eq!(tok.encode(&text, false).unwrap(), want, "case {i}: {text:?}");
    }
}

/// Encodes `text` on another thread and fails if that takes longer than `limit` (the thread is left to
/// finish on its own), so a quadratic encoder fails this test in `limit`, not in minutes.
fn encode_within(text: String, limit: Duration) -> (Vec<u32>, Duration) {
    let (tx, rx) = mpsc::channel();
    let what = format!("{:?}... ({} bytes)", &text[..8], text.len());
    std::thread::spawn(move || {
        let (tok, _) = Tokenizer::load(&nano()).unwrap();
        let t = Instant::now();
        let r = tok.encode(&text, false).map(|ids| (tok.decode(&ids).unwrap() == text, ids));
        let _ = tx.send((r.map_err(|e| e.to_string()), t.elapsed()));
    });
    match rx.recv_timeout(limit) {
        Ok((Ok((round_trip, ids)), took)) => {
            assert!(round_trip, "{what}: the ids do not decode to the text");
            (ids, took)
        }
        Ok((Err(e), _)) => panic!("{what}: {e}"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: not encoded within {limit:?}"),
        Err(e) => panic!("{what}: the encoding thread died: {e}"),
    }
}

#[test]
fn a_megabyte_long_pre_token_encodes_in_seconds() {
    // Before: tiktoken-rs 0.11's quadratic merge took 11 s for 100 KB of one repeated word (about 1,100 s
    // for 1 MB), and fancy-regex stopped at a million spaces ("Max stack size exceeded"), which
    // tiktoken-rs turned into a panic. Now each takes about a second in a debug build.
    let limit = Duration::from_secs(30);
    for text in ["hello".repeat(200_000), " ".repeat(1_000_000), "\n".repeat(1_000_000), "7".repeat(1_000_000)] {
        let (ids, took) = encode_within(text, limit);
        println!("{} ids in {took:?}", ids.len());
    }
}

#[test]
fn eos_ids_that_are_not_token_ids_are_refused_naming_the_file() {
    // Issue 41, item 5: `eos_token_id` 2^40 became token 0 (`as u32`); -1 and "2" were dropped unseen.
    let dir = tempfile::tempdir().unwrap();
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(nano().join(f), dir.path().join(f)).unwrap();
    }
    let gen = dir.path().join("generation_config.json");
    for bad in ["1099511627776", "4294967296", "[2047, -1]", "\"2\"", "1.5", "[[1]]"] {
        std::fs::write(&gen, format!("{{\"eos_token_id\": {bad}}}")).unwrap();
        let e = Tokenizer::load(dir.path()).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("generation_config.json") && e.contains("eos_token_id"), "{bad}: {e}");
    }
    // tokenizer_config.json's eos_token "[EOS]" is id 2047 (added_tokens_decoder); the rest come from here.
    for (good, want) in [("null", vec![2047]), ("7", vec![7, 2047]), ("[4294967295, 7]", vec![7, 2047, 4294967295])] {
        std::fs::write(&gen, format!("{{\"eos_token_id\": {good}}}")).unwrap();
        let (_, cfg) = Tokenizer::load(dir.path()).unwrap();
        assert_eq!(cfg.eos_token_ids, want, "{good}");
    }
}
