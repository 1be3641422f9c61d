// A small markdown renderer for chat replies: headings, fenced code blocks, inline code, bold, italic,
// lists, block quotes, rules and links. Everything is HTML-escaped first; only the tags made here are
// emitted, and links keep only http(s), mailto and relative targets. It renders partial text too (an open
// code fence runs to the end), since replies are re-rendered as they stream.
"use strict";

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline markup of one (unescaped) line or paragraph.
function renderInline(text) {
  // Code spans and links become placeholders so emphasis never reaches inside them.
  const held = [];
  const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
  let s = text.replace(/\u0000/g, "");
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + escapeHtml(code) + "</code>"));
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

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    BULLET.test(line) || NUMBERED.test(line);
}

// Markdown text to HTML.
function renderMarkdown(src) {
  const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim() === m[1])) body.push(lines[i++]);
      i++;
      const lang = m[2] ? ' class="language-' + escapeHtml(m[2]) + '"' : "";
      out.push("<pre><code" + lang + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
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
        } else if (items.length && /^\s{2,}\S/.test(lines[i]) && !FENCE.test(lines[i])) {
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
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i])) para.push(lines[i++]);
      // Chat replies mean their line breaks: keep them.
      out.push("<p>" + para.map(renderInline).join("<br>") + "</p>");
    }
  }
  return out.join("\n");
}

if (typeof module !== "undefined") module.exports = { renderMarkdown, escapeHtml };
