//! Kimi K2 tool calls, read as mlx-lm 0.32.2's server reads them with its `tool_parsers/kimi_k2.py` (checked
//! against it on fixtures made by `scripts/make_k2_tool_fixtures.py`).
//!
//! A reply holds tool sections `<|tool_calls_section_begin|>...<|tool_calls_section_end|>` (a section left
//! open at the end runs to the end); the text outside them is the answer. A section holds calls
//! `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`; without any
//! `<|tool_call_begin|>...<|tool_call_end|>` pair the whole section is read as one call. The call id is
//! `functions.NAME:IDX` as written, the name what comes between the optional `functions.` and the last
//! `:digits` before the argument marker. `ARGS` (leading whitespace dropped) is read as JSON the way Python's
//! `json.loads` reads it, else as a Python literal the way `ast.literal_eval` reads it, else kept as a string;
//! the arguments are then written as Python's `json.dumps(..., ensure_ascii=False)` writes them. A section in
//! which any call lacks a name or argument marker yields no calls (mlx-lm drops the whole section).
//!
//! Where mlx-lm's server fails the request (a literal `json.dumps` cannot write: sets, bytes, complex
//! numbers, tuple keys) and for the literal forms this reader does not evaluate (`\N{...}` escapes,
//! `set()`, `...`, strings with lone surrogates, integers of more than 4,300 digits, nesting deeper than
//! 200), the arguments are kept as a string instead.

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

use super::pyjson::{python_float_repr, write_json_str};
use super::{FunctionCall, ToolCall};

/// Opens a tool section (mlx-lm's `tool_call_start` for `kimi_k2`).
pub const SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
/// Closes a tool section.
pub const SECTION_END: &str = "<|tool_calls_section_end|>";

struct Res {
    name: Regex,
    args: Regex,
    split: Regex,
}

fn res() -> &'static Res {
    static R: OnceLock<Res> = OnceLock::new();
    R.get_or_init(|| Res {
        // Leftmost-first semantics and Unicode `\s`/`\d`, as Python's `regex` module reads these patterns.
        name: Regex::new(r"(?s)^\s*((?:functions\.)?(.+?):\d+)\s*<\|tool_call_argument_begin\|>").unwrap(),
        args: Regex::new(r"(?s)<\|tool_call_argument_begin\|>\s*(.*)\s*").unwrap(),
        split: Regex::new(r"(?s)<\|tool_call_begin\|>(.*?)<\|tool_call_end\|>").unwrap(),
    })
}

/// A reply split as mlx-lm's server splits it for the `kimi_k2` parser: the text outside tool sections, and
/// the text of each section (an empty section left open at the end is not one).
pub fn split_sections(text: &str) -> (String, Vec<&str>) {
    let mut content = String::new();
    let mut sections = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(SECTION_BEGIN) {
        content.push_str(&rest[..i]);
        let body = &rest[i + SECTION_BEGIN.len()..];
        match body.find(SECTION_END) {
            Some(j) => {
                sections.push(&body[..j]);
                rest = &body[j + SECTION_END.len()..];
            }
            None => {
                if !body.is_empty() {
                    sections.push(body);
                }
                rest = "";
            }
        }
    }
    content.push_str(rest);
    (content, sections)
}

/// Opens a reasoning block in Kimi K2-Thinking / K2.5 replies (one token of their vocabulary).
pub const THINK_BEGIN: &str = "<think>";
/// Closes a reasoning block.
pub const THINK_END: &str = "</think>";

/// A reply's reasoning split off as mlx-lm's server splits it when the vocabulary has `<think>` and `</think>`:
/// outside reasoning `<think>` opens it, inside `</think>` closes it (each marker is plain text in the other
/// state), and a tool section (`<|tool_calls_section_begin|>` to `<|tool_calls_section_end|>`, which may
/// open inside the reasoning) returns to the answer when it closes. Returns (reasoning, the rest): the rest is
/// the answer text with the tool sections kept verbatim, for [`parse_k2_tool_calls`]. `starts_in_reasoning`:
/// the prompt's last `<think>` is after its last `</think>` (mlx-lm's initial state).
pub fn split_k2_reasoning(text: &str, starts_in_reasoning: bool) -> (String, String) {
    let (mut reasoning, mut rest) = (String::new(), String::new());
    let mut in_reasoning = starts_in_reasoning;
    let mut s = text;
    loop {
        let open = if in_reasoning { THINK_END } else { THINK_BEGIN };
        let next = [(s.find(open), open), (s.find(SECTION_BEGIN), SECTION_BEGIN)]
            .into_iter()
            .filter_map(|(i, m)| i.map(|i| (i, m)))
            .min_by_key(|(i, _)| *i);
        let Some((i, marker)) = next else {
            (if in_reasoning { &mut reasoning } else { &mut rest }).push_str(s);
            return (reasoning, rest);
        };
        (if in_reasoning { &mut reasoning } else { &mut rest }).push_str(&s[..i]);
        s = &s[i + marker.len()..];
        if marker == SECTION_BEGIN {
            // The section goes to the tool parser whole; after it the reply is answer text again.
            rest.push_str(SECTION_BEGIN);
            match s.find(SECTION_END) {
                Some(j) => {
                    rest.push_str(&s[..j + SECTION_END.len()]);
                    s = &s[j + SECTION_END.len()..];
                }
                None => {
                    rest.push_str(s);
                    return (reasoning, rest);
                }
            }
            in_reasoning = false;
        } else {
            in_reasoning = !in_reasoning;
        }
    }
}

/// The calls of one tool section, or `None` where mlx-lm drops the section.
pub fn parse_k2_section(section: &str) -> Option<Vec<ToolCall>> {
    let r = res();
    let calls: Vec<&str> = r.split.captures_iter(section).map(|c| c.get(1).map_or("", |m| m.as_str())).collect();
    if calls.is_empty() {
        return Some(vec![single(section)?]);
    }
    calls.into_iter().map(single).collect()
}

fn single(text: &str) -> Option<ToolCall> {
    let r = res();
    let m = r.name.captures(text)?;
    let id = m.get(1)?.as_str().to_string();
    let name = m.get(2)?.as_str().to_string();
    let raw = r.args.captures(text)?.get(1).map_or("", |m| m.as_str());
    let value = json_loads(raw).or_else(|| literal_eval(raw)).unwrap_or_else(|| Py::Str(raw.to_string()));
    let arguments = dumps(&value).unwrap_or_else(|| dumps(&Py::Str(raw.to_string())).unwrap_or_default());
    Some(ToolCall { id, kind: "function".into(), function: FunctionCall { name, arguments: Value::String(arguments) } })
}

/// The answer text and the tool calls of a reply in Kimi K2's format.
pub fn parse_k2_tool_calls(text: &str) -> (String, Vec<ToolCall>) {
    let (content, sections) = split_sections(text);
    let calls = sections.into_iter().filter_map(parse_k2_section).flatten().collect();
    (content, calls)
}

/// A Python value as `json.loads` or `ast.literal_eval` makes it.
#[derive(Clone, Debug)]
enum Py {
    None,
    Bool(bool),
    /// Decimal digits, `-` first when negative, no leading zeros.
    Int(String),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
}

/// CPython 3.11's limit on the digits of an int converted from or to text.
const MAX_INT_DIGITS: usize = 4300;
/// Nesting deeper than this is not read (Python would stop at its recursion limit).
const MAX_DEPTH: usize = 200;

fn int_from_digits(neg: bool, digits: &str) -> Option<Py> {
    let d = digits.trim_start_matches('0');
    if d.len() > MAX_INT_DIGITS {
        return None;
    }
    Some(Py::Int(match (d.is_empty(), neg) {
        (true, _) => "0".into(),
        (false, true) => format!("-{d}"),
        (false, false) => d.to_string(),
    }))
}

/// Python dict key equality for the keys JSON can carry (`1 == 1.0 == True`).
fn key_eq(a: &Py, b: &Py) -> bool {
    fn num(p: &Py) -> Option<f64> {
        match p {
            Py::Bool(b) => Some(*b as u8 as f64),
            Py::Int(s) => s.parse::<f64>().ok(),
            Py::Float(f) => Some(*f),
            _ => None,
        }
    }
    match (a, b) {
        (Py::Str(x), Py::Str(y)) => x == y,
        (Py::None, Py::None) => true,
        (Py::Int(x), Py::Int(y)) => x == y,
        (Py::Int(_) | Py::Bool(_) | Py::Float(_), Py::Int(_) | Py::Bool(_) | Py::Float(_)) => {
            // Exact for the integers f64 holds; a huge int equal to a float is not worth more care here.
            matches!((num(a), num(b)), (Some(x), Some(y)) if x == y)
        }
        _ => false,
    }
}

fn dict_insert(items: &mut Vec<(Py, Py)>, k: Py, v: Py) {
    match items.iter_mut().find(|(x, _)| key_eq(x, &k)) {
        Some(slot) => slot.1 = v,
        None => items.push((k, v)),
    }
}

/// `json.dumps(v, ensure_ascii=False)`; `None` where Python raises (a key that is a list or dict).
fn dumps(v: &Py) -> Option<String> {
    let mut out = String::new();
    write_py(v, &mut out)?;
    Some(out)
}

fn float_json(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        python_float_repr(f)
    }
}

fn write_py(v: &Py, out: &mut String) -> Option<()> {
    match v {
        Py::None => out.push_str("null"),
        Py::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Py::Int(s) => out.push_str(s),
        Py::Float(f) => out.push_str(&float_json(*f)),
        Py::Str(s) => write_json_str(s, out),
        Py::List(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(x, out)?;
            }
            out.push(']');
        }
        Py::Dict(items) => {
            out.push('{');
            for (i, (k, x)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let key = match k {
                    Py::Str(s) => s.clone(),
                    Py::Int(s) => s.clone(),
                    Py::Float(f) => float_json(*f),
                    Py::Bool(b) => if *b { "true" } else { "false" }.into(),
                    Py::None => "null".into(),
                    _ => return None,
                };
                write_json_str(&key, out);
                out.push_str(": ");
                write_py(x, out)?;
            }
            out.push('}');
        }
    }
    Some(())
}

// ---------------------------------------------------------------------------------------------------------
// json.loads

struct Cursor<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
    depth: usize,
}

impl<'a> Cursor<'a> {
    fn new(text: &'a str) -> Self {
        Cursor { s: text.as_bytes(), text, i: 0, depth: 0 }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, lit: &str) -> bool {
        if self.text[self.i..].starts_with(lit) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }
    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.i - start
    }
}

/// Python's `json.loads` (NaN and Infinity accepted, integers exact, duplicate keys: the last value at the
/// first key's place); `None` where it raises.
fn json_loads(text: &str) -> Option<Py> {
    let mut c = Cursor::new(text);
    json_ws(&mut c);
    let v = json_value(&mut c)?;
    json_ws(&mut c);
    (c.i == c.s.len()).then_some(v)
}

fn json_ws(c: &mut Cursor) {
    while matches!(c.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        c.i += 1;
    }
}

fn json_value(c: &mut Cursor) -> Option<Py> {
    c.depth += 1;
    if c.depth > MAX_DEPTH {
        return None;
    }
    let v = match c.peek()? {
        b'{' => {
            c.i += 1;
            let mut items = Vec::new();
            json_ws(c);
            if c.peek() == Some(b'}') {
                c.i += 1;
            } else {
                loop {
                    json_ws(c);
                    if c.peek() != Some(b'"') {
                        return None;
                    }
                    let k = json_string(c)?;
                    json_ws(c);
                    if !c.eat(":") {
                        return None;
                    }
                    json_ws(c);
                    let v = json_value(c)?;
                    dict_insert(&mut items, Py::Str(k), v);
                    json_ws(c);
                    if c.eat(",") {
                        continue;
                    }
                    if c.eat("}") {
                        break;
                    }
                    return None;
                }
            }
            Py::Dict(items)
        }
        b'[' => {
            c.i += 1;
            let mut items = Vec::new();
            json_ws(c);
            if c.peek() == Some(b']') {
                c.i += 1;
            } else {
                loop {
                    json_ws(c);
                    items.push(json_value(c)?);
                    json_ws(c);
                    if c.eat(",") {
                        continue;
                    }
                    if c.eat("]") {
                        break;
                    }
                    return None;
                }
            }
            Py::List(items)
        }
        b'"' => Py::Str(json_string(c)?),
        _ if c.eat("null") => Py::None,
        _ if c.eat("true") => Py::Bool(true),
        _ if c.eat("false") => Py::Bool(false),
        _ if c.eat("NaN") => Py::Float(f64::NAN),
        _ if c.eat("Infinity") => Py::Float(f64::INFINITY),
        _ if c.eat("-Infinity") => Py::Float(f64::NEG_INFINITY),
        _ => {
            let start = c.i;
            let neg = c.eat("-");
            let int_start = c.i;
            if c.eat("0") {
            } else if c.peek().is_some_and(|d| (b'1'..=b'9').contains(&d)) {
                c.digits();
            } else {
                return None;
            }
            let int_end = c.i;
            let mut float = false;
            if c.peek() == Some(b'.') && c.s.get(c.i + 1).is_some_and(u8::is_ascii_digit) {
                c.i += 1;
                c.digits();
                float = true;
            }
            if matches!(c.peek(), Some(b'e' | b'E')) {
                let save = c.i;
                c.i += 1;
                if matches!(c.peek(), Some(b'+' | b'-')) {
                    c.i += 1;
                }
                if c.digits() == 0 {
                    c.i = save;
                } else {
                    float = true;
                }
            }
            if float {
                Py::Float(c.text[start..c.i].parse().ok()?)
            } else {
                int_from_digits(neg, &c.text[int_start..int_end])?
            }
        }
    };
    c.depth -= 1;
    Some(v)
}

fn hex4(c: &mut Cursor) -> Option<u32> {
    let h = c.text.get(c.i..c.i + 4)?;
    if !h.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    c.i += 4;
    u32::from_str_radix(h, 16).ok()
}

/// A JSON string at the cursor (on its `"`); control characters refused, as `strict=True` does.
fn json_string(c: &mut Cursor) -> Option<String> {
    c.i += 1;
    let mut out = String::new();
    loop {
        let rest = &c.text[c.i..];
        let ch = rest.chars().next()?;
        c.i += ch.len_utf8();
        match ch {
            '"' => return Some(out),
            '\\' => {
                let e = c.peek()?;
                c.i += 1;
                match e {
                    b'"' => out.push('"'),
                    b'\\' => out.push('\\'),
                    b'/' => out.push('/'),
                    b'b' => out.push('\u{8}'),
                    b'f' => out.push('\u{c}'),
                    b'n' => out.push('\n'),
                    b'r' => out.push('\r'),
                    b't' => out.push('\t'),
                    b'u' => {
                        let u = hex4(c)?;
                        let cp = if (0xD800..0xDC00).contains(&u) && c.text[c.i..].starts_with("\\u") {
                            let save = c.i;
                            c.i += 2;
                            match hex4(c) {
                                Some(lo) if (0xDC00..0xE000).contains(&lo) => {
                                    0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)
                                }
                                _ => {
                                    c.i = save;
                                    u
                                }
                            }
                        } else {
                            u
                        };
                        // A lone surrogate: Python keeps it; a Rust string cannot.
                        out.push(char::from_u32(cp)?);
                    }
                    _ => return None,
                }
            }
            c if (c as u32) < 0x20 => return None,
            c => out.push(c),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// ast.literal_eval

/// Python's `ast.literal_eval` for what JSON can hold: strings (quotes, triple quotes, `r`/`u` prefixes,
/// adjacent strings joined, escapes), ints (decimal, hex, octal, binary, underscores), floats, one sign,
/// `True`, `False`, `None`, lists, tuples (as lists), dicts, comments; `None` for anything else.
fn literal_eval(text: &str) -> Option<Py> {
    // literal_eval strips leading spaces and tabs.
    let text = text.trim_start_matches([' ', '\t']);
    let mut c = Cursor::new(text);
    py_ws(&mut c, false);
    let v = py_value(&mut c)?;
    py_ws(&mut c, true);
    (c.i == c.s.len()).then_some(v)
}

/// Skips whitespace and comments; newlines only inside brackets, or at the end (`trailing`).
fn py_ws(c: &mut Cursor, newlines: bool) {
    let newlines = newlines || c.depth > 0;
    loop {
        match c.peek() {
            Some(b' ' | b'\t' | b'\x0c') => c.i += 1,
            Some(b'\n' | b'\r') if newlines => c.i += 1,
            Some(b'\\') if c.text[c.i..].starts_with("\\\n") => c.i += 2,
            Some(b'\\') if c.text[c.i..].starts_with("\\\r\n") => c.i += 3,
            Some(b'#') => {
                while c.peek().is_some_and(|b| b != b'\n' && b != b'\r') {
                    c.i += 1;
                }
            }
            _ => break,
        }
    }
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

/// Items up to `close`, comma-separated, a trailing comma allowed; also whether a comma was seen.
fn py_items(c: &mut Cursor, close: u8) -> Option<(Vec<Py>, bool)> {
    let mut items = Vec::new();
    let mut comma = false;
    loop {
        py_ws(c, true);
        if c.peek() == Some(close) {
            c.i += 1;
            return Some((items, comma));
        }
        items.push(py_value(c)?);
        py_ws(c, true);
        if c.peek() == Some(b',') {
            c.i += 1;
            comma = true;
        } else if c.peek() == Some(close) {
            c.i += 1;
            return Some((items, comma));
        } else {
            return None;
        }
    }
}

fn py_value(c: &mut Cursor) -> Option<Py> {
    if c.depth >= MAX_DEPTH {
        return None;
    }
    let b = c.peek()?;
    match b {
        b'[' => {
            c.i += 1;
            c.depth += 1;
            let (items, _) = py_items(c, b']')?;
            c.depth -= 1;
            Some(Py::List(items))
        }
        b'(' => {
            c.i += 1;
            c.depth += 1;
            let (mut items, comma) = py_items(c, b')')?;
            c.depth -= 1;
            if items.len() == 1 && !comma {
                items.pop()
            } else {
                Some(Py::List(items))
            }
        }
        b'{' => {
            c.i += 1;
            c.depth += 1;
            let mut items = Vec::new();
            loop {
                py_ws(c, true);
                if c.eat("}") {
                    break;
                }
                let k = py_value(c)?;
                py_ws(c, true);
                // A `{a, b}` set is not JSON.
                if !c.eat(":") {
                    return None;
                }
                py_ws(c, true);
                let v = py_value(c)?;
                if matches!(k, Py::List(_) | Py::Dict(_)) {
                    return None;
                }
                dict_insert(&mut items, k, v);
                py_ws(c, true);
                if c.eat(",") {
                    continue;
                }
                if c.eat("}") {
                    break;
                }
                return None;
            }
            c.depth -= 1;
            Some(Py::Dict(items))
        }
        b'-' | b'+' => {
            c.i += 1;
            py_ws(c, false);
            match py_number(c)? {
                Py::Int(s) if b == b'-' && s != "0" => Some(Py::Int(format!("-{s}"))),
                Py::Float(f) if b == b'-' => Some(Py::Float(-f)),
                v => Some(v),
            }
        }
        b'0'..=b'9' | b'.' => py_number(c),
        _ => {
            if let Some(s) = py_strings(c)? {
                return Some(Py::Str(s));
            }
            let start = c.i;
            while c.peek().is_some_and(is_ident) {
                c.i += 1;
            }
            match &c.text[start..c.i] {
                "True" => Some(Py::Bool(true)),
                "False" => Some(Py::Bool(false)),
                "None" => Some(Py::None),
                _ => None,
            }
        }
    }
}

/// A number literal (no sign); imaginary numbers are not JSON.
fn py_number(c: &mut Cursor) -> Option<Py> {
    let start = c.i;
    while c.peek().is_some_and(|b| is_ident(b) || b == b'.') {
        // An exponent's sign belongs to the literal.
        if matches!(c.peek(), Some(b'e' | b'E'))
            && !c.text[start..c.i].starts_with("0x")
            && !c.text[start..c.i].starts_with("0X")
            && matches!(c.s.get(c.i + 1), Some(b'+' | b'-'))
        {
            c.i += 2;
            continue;
        }
        c.i += 1;
    }
    let lit = &c.text[start..c.i];
    // Underscores only between digits.
    if lit.contains("__") || lit.ends_with('_') || lit.contains("_.") || lit.contains("._") {
        return None;
    }
    let lower = lit.to_ascii_lowercase();
    for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
        if let Some(body) = lower.strip_prefix(prefix) {
            let body = body.strip_prefix('_').unwrap_or(body).replace('_', "");
            if body.is_empty() {
                return None;
            }
            return int_from_digits(false, &u128::from_str_radix(&body, radix).ok()?.to_string());
        }
    }
    let plain = lower.replace('_', "");
    if plain.is_empty() || plain.starts_with('_') {
        return None;
    }
    if plain.bytes().all(|b| b.is_ascii_digit()) {
        // `0`, `00` are fine; `01` is a syntax error.
        if plain.len() > 1 && plain.starts_with('0') && plain.bytes().any(|b| b != b'0') {
            return None;
        }
        return int_from_digits(false, &plain);
    }
    // A float: digits, at most one point, an optional exponent with digits; no `j`.
    let (mant, exp) = match plain.split_once('e') {
        Some((m, e)) => (m, Some(e)),
        None => (plain.as_str(), None),
    };
    let mant_ok = mant.bytes().filter(|b| *b == b'.').count() <= 1
        && mant.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && mant.bytes().any(|b| b.is_ascii_digit());
    let exp_ok = exp.is_none_or(|e| {
        let d = e.strip_prefix(['+', '-']).unwrap_or(e);
        !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
    });
    if !mant_ok || !exp_ok {
        return None;
    }
    Some(Py::Float(plain.parse().ok()?))
}

/// One or more adjacent string literals, joined; `Some(None)` when no string starts here, `None` when one
/// does but is not a str literal this reader evaluates.
fn py_strings(c: &mut Cursor) -> Option<Option<String>> {
    let mut out: Option<String> = None;
    loop {
        let save = c.i;
        let mut raw = false;
        let mut j = c.i;
        while let Some(&b) = c.s.get(j) {
            match b {
                b'r' | b'R' => raw = true,
                b'u' | b'U' => {}
                // Bytes and f-strings are not JSON strings.
                b'b' | b'B' | b'f' | b'F' => {
                    if matches!(c.s.get(j + 1), Some(b'\'' | b'"' | b'r' | b'R')) {
                        return None;
                    }
                    break;
                }
                _ => break,
            }
            j += 1;
        }
        if j - c.i > 1 || !matches!(c.s.get(j), Some(b'\'' | b'"')) {
            c.i = save;
            return Some(out);
        }
        // `ur''` is a syntax error; only single-letter prefixes pass the check above.
        c.i = j;
        let s = py_string(c, raw)?;
        out.get_or_insert_with(String::new).push_str(&s);
        let before_ws = c.i;
        py_ws(c, false);
        if !matches!(c.peek(), Some(b'\'' | b'"' | b'r' | b'R' | b'u' | b'U' | b'b' | b'B' | b'f' | b'F')) {
            c.i = before_ws;
            return Some(out);
        }
    }
}

fn py_string(c: &mut Cursor, raw: bool) -> Option<String> {
    let q = c.peek()? as char;
    let triple: String = std::iter::repeat_n(q, 3).collect();
    let long = c.text[c.i..].starts_with(&triple);
    c.i += if long { 3 } else { 1 };
    let mut out = String::new();
    loop {
        let rest = &c.text[c.i..];
        if long && rest.starts_with(&triple) {
            c.i += 3;
            return Some(out);
        }
        let ch = rest.chars().next()?;
        c.i += ch.len_utf8();
        match ch {
            _ if ch == q && !long => return Some(out),
            '\n' | '\r' if !long => return None,
            '\\' if raw => {
                // The backslash stays; it only keeps the next character from ending the string.
                out.push('\\');
                let next = c.text[c.i..].chars().next()?;
                c.i += next.len_utf8();
                out.push(next);
            }
            '\\' => {
                let e = c.text[c.i..].chars().next()?;
                c.i += e.len_utf8();
                match e {
                    '\n' => {}
                    '\r' => {
                        c.eat("\n");
                    }
                    '\\' | '\'' | '"' => out.push(e),
                    'a' => out.push('\u{7}'),
                    'b' => out.push('\u{8}'),
                    'f' => out.push('\u{c}'),
                    'n' => out.push('\n'),
                    'r' => out.push('\r'),
                    't' => out.push('\t'),
                    'v' => out.push('\u{b}'),
                    '0'..='7' => {
                        let mut v = e.to_digit(8)?;
                        for _ in 0..2 {
                            match c.peek() {
                                Some(d @ b'0'..=b'7') => {
                                    v = v * 8 + (d - b'0') as u32;
                                    c.i += 1;
                                }
                                _ => break,
                            }
                        }
                        out.push(char::from_u32(v)?);
                    }
                    'x' | 'u' | 'U' => {
                        let n = match e {
                            'x' => 2,
                            'u' => 4,
                            _ => 8,
                        };
                        let h = c.text.get(c.i..c.i + n)?;
                        if !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                            return None;
                        }
                        c.i += n;
                        out.push(char::from_u32(u32::from_str_radix(h, 16).ok()?)?);
                    }
                    // `\N{NAME}` needs Unicode's name table.
                    'N' => return None,
                    other => {
                        out.push('\\');
                        out.push(other);
                    }
                }
            }
            ch => out.push(ch),
        }
    }
}
