//! `cargo run --release --example tokenize_long -- DIR [BYTES...]`: times the tokenizer of checkpoint DIR
//! on texts that are one long pre-token or run (a letter, a word repeated without spaces, spaces, digits,
//! punctuation, newlines) and on ordinary text, each BYTES long (default 100000 and 1000000). Encoding must
//! grow about linearly with the length (docs/correctness.md, "Tokenizer").

use std::path::PathBuf;
use std::time::Instant;

use mlx_k3::tokenizer::Tokenizer;

fn main() -> mlx_k3::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "models/k3-nano".into()));
    let mut sizes: Vec<usize> = args.map(|a| a.parse().expect("BYTES must be a number")).collect();
    if sizes.is_empty() {
        sizes = vec![100_000, 1_000_000];
    }
    let (tok, _) = Tokenizer::load(&dir)?;
    let kinds: [(&str, &str); 14] = [
        ("one letter", "a"),
        ("one word repeated", "hello"),
        ("capitals", "A"),
        ("spaces", " "),
        ("tabs", "\t"),
        ("spaces, newline", "      \n"),
        ("CR LF", "\r\n"),
        ("digits", "7"),
        ("punctuation", "!"),
        ("newlines", "\n"),
        ("Han", "\u{4e2d}"),
        ("marks", "e\u{301}"),
        ("apostrophes", "'s"),
        ("ordinary text", "The quick brown fox jumps over the lazy dog. "),
    ];
    for &n in &sizes {
        for (name, unit) in kinds {
            let text = unit.repeat(n.div_ceil(unit.len()));
            let t = Instant::now();
            match tok.encode(&text, false) {
                Ok(ids) => {
                    println!("{n:>9} bytes  {name:<18} {:>9.3} s  {:>8} ids", t.elapsed().as_secs_f64(), ids.len())
                }
                Err(e) => println!("{n:>9} bytes  {name:<18} {:>9.3} s  error: {e}", t.elapsed().as_secs_f64()),
            }
        }
    }
    Ok(())
}
