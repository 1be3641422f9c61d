// A small markdown renderer for chat replies: headings, fenced code blocks, inline code, bold, italic,
// lists, block quotes, rules and links. Everything is HTML-escaped first; only the tags made here are
// emitted, and links keep only http(s), mailto and relative targets. It renders partial text too (an open
// code fence runs to the end), since replies are re-rendered as they stream.
//
// Code stays code. Models (k3-nano above all) often write Python without fences, so a run of lines that
// looks like code (a `def`/`class`/`import` line, a block opener followed by an indented line, indented
// lines) is a code block too, kept verbatim; Markdown's rules would flatten its indentation into a
// paragraph. Fences take any info string (```python title) and any indentation (a fence in a list item),
// and Python's dunder names (`__init__`) are text, never bold.
"use strict";

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Python's dunder names (__init__, __repr__, __name__): text, not emphasis.
const DUNDER = /(?<!\w)__[A-Za-z0-9](?:\w*[A-Za-z0-9])?__(?!\w)/g;

// Inline markup of one (unescaped) line or paragraph.
function renderInline(text) {
  // Code spans, dunder names and links become placeholders so emphasis never reaches inside them.
  const held = [];
  const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
  let s = text.replace(/\u0000/g, "");
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + escapeHtml(code) + "</code>"));
  s = s.replace(DUNDER, (name) => hold(escapeHtml(name)));
  s = escapeHtml(s);
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) => {
    const raw = url.replace(/&amp;/g, "&");
    if (!/^(https?:\/\/|mailto:|\/|#|\.\/)/i.test(raw)) return label;
    return hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>");
  });
  s = s.replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__(?=\S)([^_]*?\S)__/g, "<strong>$1</strong>");
  s = s.replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>");
  s = s.replace(/(^|[^\w_])_(?=[^\s_])([^_]*?[^\s_])_(?![\w_])/g, "$1<em>$2</em>");
  // Placeholders may nest (a code span inside a link label): restore until none is left.
  for (let i = 0; i < 4 && s.includes("\u0000"); i++) {
    s = s.replace(/\u0000(\d+)\u0000/g, (_, n) => held[Number(n)]);
  }
  return s;
}

// An opening fence: its indentation, the fence (3+ backticks or tildes) and an info string whose first word
// names the language. A backtick fence's info string has no backticks (```x``` is inline code).
const FENCE = /^(\s*)(`{3,}|~{3,})(.*)$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
// Lines that start code by themselves.
const CODE_LINE = new RegExp(
  "^(?:" +
    [
      "(?:async\\s+)?def\\s+\\w+\\s*\\(",
      "class\\s+\\w+\\s*[(:]",
      "import\\s+[\\w.]+(?:\\s+as\\s+\\w+)?(?:\\s*,\\s*[\\w.]+(?:\\s+as\\s+\\w+)?)*\\s*;?\\s*$",
      "from\\s+[\\w.]+\\s+import\\s+\\S",
      "@[\\w.]+(?:\\(.*\\))?\\s*$",
      "#!\\/",
      "if\\s+__name__\\s*==",
    ].join("|") +
    ")"
);
// A block opener (Python's `if x:`, C's `{`), code when the next line is indented deeper: a line that ends
// like one and starts with a keyword or holds code punctuation ("Here is how:" is prose).
const OPENER = /(?::|\{|\(|\[|,|\\)\s*$/;
const CODEISH = /^\s*(?:if|elif|else|for|while|with|try|except|finally|match|case|switch|do)\b|[=()[\]{};]/;
const INDENTED = /^(?: {2,}|\t)\S/;

function fenceAt(line) {
  const m = line.match(FENCE);
  if (!m || (m[2][0] === "`" && m[3].includes("`"))) return null;
  const lang = (m[3].trim().split(/\s+/)[0] || "").replace(/^\{?\.?/, "").replace(/[^\w+#.-].*$/, "");
  return { indent: m[1].length, fence: m[2], lang };
}

function closesFence(line, fence) {
  const m = line.match(/^\s*(`{3,}|~{3,})\s*$/);
  return !!m && m[1][0] === fence[0] && m[1].length >= fence.length;
}

function indentOf(line) {
  return line.match(/^\s*/)[0].replace(/\t/g, "    ").length;
}

function isListOrQuote(line) {
  return BULLET.test(line) || NUMBERED.test(line) || QUOTE.test(line);
}

// Whether lines[i] starts a block of unfenced code.
function codeStartsAt(lines, i) {
  const line = lines[i];
  if (line.trim() === "" || fenceAt(line)) return false;
  if (CODE_LINE.test(line)) return true;
  if (INDENTED.test(line) && !isListOrQuote(line)) return true;
  const next = lines[i + 1];
  if (next === undefined || next.trim() === "") return false;
  if (OPENER.test(line) && CODEISH.test(line) && !isListOrQuote(line) && indentOf(next) > indentOf(line) &&
      !isListOrQuote(next)) {
    return true;
  }
  // A Python comment right above code (not a heading).
  return /^#/.test(line) && (CODE_LINE.test(next) || (INDENTED.test(next) && !isListOrQuote(next)));
}

// The end (exclusive) of the unfenced code block starting at lines[i]: it runs over blank lines while code
// follows them, and stops at a fence or a blank line followed by anything else. A block that starts with an
// indented line (Markdown's indented code) also stops at the first line that is not indented.
function codeBlockEnd(lines, i) {
  const indented = INDENTED.test(lines[i]);
  let j = i + 1;
  let end = j;
  while (j < lines.length) {
    if (fenceAt(lines[j]) || (indented && lines[j].trim() !== "" && !INDENTED.test(lines[j]))) break;
    if (lines[j].trim() === "") {
      let k = j;
      while (k < lines.length && lines[k].trim() === "") k++;
      if (k === lines.length || !(INDENTED.test(lines[k]) || codeStartsAt(lines, k))) break;
      j = k;
    }
    j++;
    end = j;
  }
  return end;
}

function dedent(lines) {
  const depth = Math.min(...lines.filter((l) => l.trim() !== "").map((l) => l.match(/^[ \t]*/)[0].length));
  return lines.map((l) => l.slice(Math.min(depth, l.match(/^[ \t]*/)[0].length)));
}

function startsBlock(lines, i) {
  const line = lines[i];
  return !!fenceAt(line) || codeStartsAt(lines, i) || HEADING.test(line) || RULE.test(line) ||
    QUOTE.test(line) || BULLET.test(line) || NUMBERED.test(line);
}

// Markdown text to HTML.
function renderMarkdown(src) {
  const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    let fence;
    if ((fence = fenceAt(line))) {
      // The content loses up to the fence's own indentation (a fence inside a list item), nothing more.
      const body = [];
      i++;
      while (i < lines.length && !closesFence(lines[i], fence.fence)) {
        const l = lines[i++];
        body.push(l.slice(Math.min(fence.indent, l.match(/^ */)[0].length)));
      }
      i++;
      const lang = fence.lang ? ' class="language-' + escapeHtml(fence.lang) + '"' : "";
      out.push("<pre><code" + lang + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
    } else if (codeStartsAt(lines, i)) {
      const end = codeBlockEnd(lines, i);
      const body = dedent(lines.slice(i, end));
      while (body.length && body[body.length - 1].trim() === "") body.pop();
      out.push("<pre><code>" + escapeHtml(body.join("\n")) + "</code></pre>");
      i = end;
    } else if ((m = line.match(HEADING))) {
      const n = m[1].length;
      out.push("<h" + n + ">" + renderInline(m[2]) + "</h" + n + ">");
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) {
        body.push(m[1]);
        i++;
      }
      out.push("<blockquote>" + renderMarkdown(body.join("\n")) + "</blockquote>");
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = NUMBERED.test(line);
      const item = ordered ? NUMBERED : BULLET;
      const first = line.match(NUMBERED);
      const items = [];
      while (i < lines.length) {
        if ((m = lines[i].match(item))) {
          items.push([ordered ? m[2] : m[1]]);
        } else if (items.length && /^\s{2,}\S/.test(lines[i]) && !fenceAt(lines[i])) {
          items[items.length - 1].push(lines[i].trim()); // a continuation line of the item
        } else {
          break;
        }
        i++;
      }
      const lis = items.map((parts) => "<li>" + parts.map(renderInline).join("<br>") + "</li>").join("");
      const start = ordered && first[1] !== "1" ? ' start="' + Number(first[1]) + '"' : "";
      out.push(ordered ? "<ol" + start + ">" + lis + "</ol>" : "<ul>" + lis + "</ul>");
    } else if (line.trim() === "") {
      i++;
    } else {
      const para = [line];
      i++;
      while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines, i)) para.push(lines[i++]);
      // Chat replies mean their line breaks: keep them.
      out.push("<p>" + para.map(renderInline).join("<br>") + "</p>");
    }
  }
  return out.join("\n");
}

if (typeof module !== "undefined") module.exports = { renderMarkdown, escapeHtml };
