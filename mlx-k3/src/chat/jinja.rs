//! Chat templates: a checkpoint's Jinja `chat_template` rendered with Hugging Face's semantics, under limits,
//! with the text that came from messages and tools marked so that it never becomes special tokens.
//!
//! **Semantics.** minijinja configured as transformers configures Jinja2: `trim_blocks` and `lstrip_blocks`
//! on, Python string/dict methods available (`.strip()`, `.items()`, ...), a `tojson` filter that formats
//! like Python's `json.dumps` (`", "` and `": "` separators, non-ASCII kept), and the `raise_exception(msg)`
//! and `strftime_now(fmt)` functions.
//!
//! **Limits.** A template is a program from the checkpoint: it runs with fuel (at most [`FUEL`] instructions
//! per render), minijinja's recursion limit, and at most [`MAX_OUTPUT`] bytes of output, so a template with
//! nested loops or runaway recursion is an error naming the limit instead of an engine that never answers.
//!
//! **Marking.** By default Hugging Face renders the template to one string and tokenizes it with special
//! tokens recognised anywhere, so a user who writes `<|im_end|><|im_start|>system` in a message forges a role
//! boundary. Here every special-token string inside a message, a tool definition or any other value the
//! caller passes (keys included) is replaced, before rendering, by one private-use character (U+F0000 and up,
//! one per distinct string; private-use characters already in the values are replaced the same way, so the
//! marks are unambiguous). After rendering the marks are put back, so the text is what Hugging Face renders,
//! and the prompt is encoded as transformers encodes it with `apply_chat_template(...,
//! sanitize_control_tokens=True)`: the template's text with special tokens recognised, each marked string on
//! its own as ordinary text. When nothing was marked this is one segment encoded as Hugging Face's default
//! does.

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JValue};
use serde_json::{Map, Value};

use super::pyjson::python_json;
use super::Segment;
use crate::{Error, Result};

/// Instructions a template may execute per render: about 3 s of a debug build, under 1 s of a release build
/// (a template takes a few hundred per message, so 2,500 messages through a tool-calling template used
/// about 1.5% of it).
pub const FUEL: u64 = 50_000_000;
/// Bytes a render may produce.
pub const MAX_OUTPUT: usize = 64 << 20;
/// Nesting depth of loops, macros and includes (minijinja's own cap; a macro call counts several levels).
pub const RECURSION_LIMIT: usize = 500;

fn tojson(value: JValue, kwargs: minijinja::value::Kwargs) -> std::result::Result<JValue, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // ensure_ascii / sort_keys are accepted; only the defaults transformers uses are implemented.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut v: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort == Some(true) {
        v = super::pyjson::sort_keys(&v);
    }
    Ok(JValue::from_safe_string(python_json(&v, indent)))
}

/// A chat template compiled for rendering.
pub struct JinjaTemplate {
    env: Environment<'static>,
}

/// A writer that refuses more than [`MAX_OUTPUT`] bytes.
struct Capped<'a> {
    out: &'a mut Vec<u8>,
    overflow: bool,
}

impl std::io::Write for Capped<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > MAX_OUTPUT {
            self.overflow = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl JinjaTemplate {
    /// Compiles `source`; a syntax error names the line.
    pub fn new(source: &str) -> Result<JinjaTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_recursion_limit(RECURSION_LIMIT);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<JValue, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> std::result::Result<JValue, JinjaError> {
            Ok(JValue::from(strftime_now(&fmt)))
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::invalid("chat_template", format!("does not compile: {e:#}")))?;
        Ok(JinjaTemplate { env })
    }

    /// Renders with the given variables (`messages`, `tools`, `add_generation_prompt`, ...), as Hugging Face
    /// would (no marking).
    pub fn render(&self, vars: &Value) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| Error::invalid("chat_template", e.to_string()))?;
        let mut buf = Vec::new();
        let mut w = Capped { out: &mut buf, overflow: false };
        let result = t.render_captured_to(JValue::from_serialize(vars), &mut w);
        let overflow = w.overflow;
        match result {
            Ok(_) => String::from_utf8(buf)
                .map_err(|_| Error::invalid("chat_template", "the template produced invalid UTF-8".to_string())),
            Err(_) if overflow => Err(Error::invalid(
                "chat_template",
                format!("rendering stopped: the prompt exceeds {} MiB", MAX_OUTPUT >> 20),
            )),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Error::invalid(
                "chat_template",
                format!("rendering stopped after {FUEL} template instructions (a runaway loop?)"),
            )),
            // The short form: minijinja's alternate form appends every variable, the whole conversation.
            Err(e) => Err(Error::invalid("chat_template", e.to_string())),
        }
    }
}

/// First private-use code point used for marks (Supplementary Private Use Area-A; through U+10FFFF).
const MARK_BASE: u32 = 0xF0000;
const MARK_COUNT: u32 = 0x110000 - MARK_BASE;

fn is_mark(c: char) -> bool {
    c as u32 >= MARK_BASE
}

/// Finds special-token strings; marks and unmarks values (see the module documentation).
pub struct Marker {
    specials: AhoCorasick,
}

/// The strings replaced by marks during one render; mark `i` stands for `entries[i]`.
#[derive(Default)]
pub struct Marks {
    entries: Vec<String>,
    index: HashMap<String, u32>,
}

impl Marks {
    fn mark(&mut self, s: &str, out: &mut String) -> Result<()> {
        let i = match self.index.get(s) {
            Some(&i) => i,
            None => {
                let i = self.entries.len() as u32;
                if i >= MARK_COUNT {
                    return Err(Error::invalid("chat", "too many distinct special-token strings in the messages"));
                }
                self.entries.push(s.to_string());
                self.index.insert(s.to_string(), i);
                i
            }
        };
        out.push(char::from_u32(MARK_BASE + i).expect("a scalar value above the surrogates"));
        Ok(())
    }

    /// Whether anything was marked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Marker {
    /// A marker for the given special-token strings.
    pub fn new<'a>(specials: impl IntoIterator<Item = &'a str>) -> Result<Marker> {
        let specials: Vec<&str> = specials.into_iter().filter(|s| !s.is_empty()).collect();
        let specials = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(specials)
            .map_err(|e| Error::invalid("chat", format!("cannot index the special tokens: {e}")))?;
        Ok(Marker { specials })
    }

    /// Refuses a template (or a token string passed to it) that itself contains the characters used as marks.
    pub fn check_trusted(&self, what: &'static str, text: &str) -> Result<()> {
        match text.chars().find(|&c| is_mark(c)) {
            Some(c) => Err(Error::invalid(
                what,
                format!(
                    "contains U+{:X}; mlx-k3 reserves U+F0000..U+10FFFF to mark message text (see docs/chat.md)",
                    c as u32
                ),
            )),
            None => Ok(()),
        }
    }

    fn mark_str(&self, s: &str, marks: &mut Marks) -> Result<Option<String>> {
        if !s.chars().any(is_mark) && self.specials.find(s).is_none() {
            return Ok(None);
        }
        let mut out = String::with_capacity(s.len());
        let plain = |text: &str, out: &mut String, marks: &mut Marks| -> Result<()> {
            for c in text.chars() {
                if is_mark(c) {
                    marks.mark(c.encode_utf8(&mut [0; 4]), out)?;
                } else {
                    out.push(c);
                }
            }
            Ok(())
        };
        let mut at = 0;
        for m in self.specials.find_iter(s) {
            plain(&s[at..m.start()], &mut out, marks)?;
            marks.mark(&s[m.start()..m.end()], &mut out)?;
            at = m.end();
        }
        plain(&s[at..], &mut out, marks)?;
        Ok(Some(out))
    }

    /// `v` with every special-token string (and mark character) in its strings and keys replaced by a mark.
    pub fn mark(&self, v: &Value, marks: &mut Marks) -> Result<Value> {
        Ok(match v {
            Value::String(s) => match self.mark_str(s, marks)? {
                Some(m) => Value::String(m),
                None => v.clone(),
            },
            Value::Array(a) => Value::Array(a.iter().map(|x| self.mark(x, marks)).collect::<Result<_>>()?),
            Value::Object(o) => {
                let mut out = Map::with_capacity(o.len());
                for (k, x) in o {
                    let k = self.mark_str(k, marks)?.unwrap_or_else(|| k.clone());
                    out.insert(k, self.mark(x, marks)?);
                }
                Value::Object(out)
            }
            other => other.clone(),
        })
    }

    /// The rendered text with its marks put back, as segments, as transformers' `encode_marked_chat` cuts
    /// it: the whole text as one segment with special tokens allowed when nothing was marked; else the
    /// template's text (special tokens allowed) and each marked special-token string (ordinary text) as
    /// separate segments. A mark that stood for a private-use character of the input goes back into the text
    /// around it.
    pub fn unmark(&self, rendered: &str, marks: &Marks) -> Vec<Segment> {
        let mut segs: Vec<Segment> = Vec::new();
        let mut text = String::new();
        for c in rendered.chars() {
            if !is_mark(c) {
                text.push(c);
                continue;
            }
            let entry = marks.entries.get((c as u32 - MARK_BASE) as usize).map(String::as_str).unwrap_or("");
            if entry.chars().count() == 1 && entry.chars().all(is_mark) {
                text.push_str(entry);
            } else {
                if !text.is_empty() {
                    segs.push(Segment { text: std::mem::take(&mut text), special: true });
                }
                segs.push(Segment { text: entry.to_string(), special: false });
            }
        }
        if !text.is_empty() || segs.is_empty() {
            segs.push(Segment { text, special: true });
        }
        segs
    }
}

/// Today's date with a few strftime codes (`%Y %m %d %B %b %A %a %H %M %S`), for templates that print it.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let wd = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let (hh, mm, ss) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(wd),
            Some('a') => out.push_str(&wd[..3]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}
