//! What Python does to JSON values, where chat encodings written in Python depend on it: `json.dumps`
//! formatting (separators, escapes, float `repr`), `str()` of a scalar, truthiness and `str.strip()`.

use std::collections::BTreeMap;

use serde_json::Value;

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` formatting (what transformers' `tojson`
/// filter produces), so rendered prompts match Jinja2 byte for byte: `", "` and `": "` separators without
/// indent, `","` and `": "` with it.
pub fn python_json(v: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    let item_sep = if indent.is_some() { "," } else { ", " };
    write_json(v, indent, 0, item_sep, ": ", &mut out);
    out
}

/// `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`.
pub fn python_json_compact(v: &Value) -> String {
    let mut out = String::new();
    write_json(v, None, 0, ",", ":", &mut out);
    out
}

/// A JSON string as Python's `json.dumps(s, ensure_ascii=False)` writes it.
pub(crate) fn write_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_json(v: &Value, indent: Option<usize>, level: usize, item_sep: &str, key_sep: &str, out: &mut String) {
    let (nl, pad, pad_in) = match indent {
        Some(n) => ("\n", " ".repeat(n * level), " ".repeat(n * (level + 1))),
        None => ("", String::new(), String::new()),
    };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&python_number(n)),
        Value::String(s) => write_json_str(s, out),
        Value::Array(a) if a.is_empty() => out.push_str("[]"),
        Value::Object(o) if o.is_empty() => out.push_str("{}"),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                out.push_str(nl);
                out.push_str(&pad_in);
                write_json(x, indent, level + 1, item_sep, key_sep, out);
            }
            out.push_str(nl);
            out.push_str(&pad);
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                out.push_str(nl);
                out.push_str(&pad_in);
                write_json_str(k, out);
                out.push_str(key_sep);
                write_json(x, indent, level + 1, item_sep, key_sep, out);
            }
            out.push_str(nl);
            out.push_str(&pad);
            out.push('}');
        }
    }
}

/// A JSON number as Python prints what `json.loads` made of it: integers in full, floats with `repr`.
pub fn python_number(n: &serde_json::Number) -> String {
    match n.as_f64().filter(|_| n.is_f64()) {
        Some(f) => python_float_repr(f),
        None => n.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, laid out as CPython's `float_repr_style =
/// 'short'` does (positional for decimal exponents -4 <= e < 16, else `d.ddde+XX`), `.0` on integral values.
pub fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's LowerExp without a precision prints the shortest round-trip digits: "-1.2345e-7".
    let s = format!("{x:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // Position of the decimal point after the first digit, as CPython's `decpt`.
    let decpt = exp + 1;
    let body = if -4 < decpt && decpt <= 16 {
        let n = digits.len() as i32;
        if decpt <= 0 {
            format!("0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= n {
            format!("{digits}{}.0", "0".repeat((decpt - n) as usize))
        } else {
            format!("{}.{}", &digits[..decpt as usize], &digits[decpt as usize..])
        }
    } else {
        let rest = &digits[1..];
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        format!("{}{frac}e{}{:02}", &digits[..1], if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{body}")
}

/// Python's truthiness of a JSON value (`None`, `False`, `0`, `""`, `[]`, `{}` are false).
pub fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// What a value is, for error messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Python's `str()` of a scalar JSON value (`None`, `True`, `7`, `2.5`, the string itself). Lists and
/// objects are refused, naming `field`: Python would print their `repr`, which no encoding means to carry.
pub fn py_str(v: &Value, field: &str) -> crate::Result<String> {
    Ok(match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => python_number(n),
        Value::String(s) => s.clone(),
        other => {
            return Err(crate::Error::invalid("chat", format!("{field}: must be a string, not {}", kind(other))));
        }
    })
}

/// Python's `str.isspace()` for one character: Unicode White_Space plus the separators U+001C..U+001F.
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()`.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Python's `deep_sort_dict`: object keys sorted (by code point, as Python sorts `str`), recursively.
pub fn sort_keys(v: &Value) -> Value {
    match v {
        Value::Object(o) => {
            let sorted: BTreeMap<&String, Value> = o.iter().map(|(k, v)| (k, sort_keys(v))).collect();
            Value::Object(sorted.into_iter().map(|(k, v)| (k.clone(), v)).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(sort_keys).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_is_pythons() {
        // Values and what CPython 3.11 prints for repr(x).
        let cases = [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e-7, "1e-07"),
            (1e-5, "1e-05"),
            (2.5e-5, "2.5e-05"),
            (1e-4, "0.0001"),
            (0.00012, "0.00012"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234567e16, "1.2345678901234568e+16"),
            (123456789.0, "123456789.0"),
            (1e22, "1e+22"),
            (-0.0, "-0.0"),
            (-1.5e300, "-1.5e+300"),
            (5e-324, "5e-324"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn strip_is_pythons() {
        assert_eq!(py_strip("\u{1c}\u{1f}\u{3000} a b\u{a0}\n"), "a b");
        assert_eq!(py_strip("\u{200b}x"), "\u{200b}x", "a zero-width space is not whitespace in Python");
    }
}
