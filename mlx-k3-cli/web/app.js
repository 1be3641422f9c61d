// The web chat: conversations kept in localStorage, replies streamed from POST /api/chat (server-sent
// events read from the fetch body, since EventSource cannot POST), thinking in a collapsible panel, answers
// rendered as markdown, and a stop button that asks the server to end the generation.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "mlx-k3.chat";
let data = load();
let running = null; // {session, controller, msg, view} while a reply streams
let pending = []; // images (data: URLs) attached to the next message
let vision = false; // whether the model takes images (/health)

function load() {
  try {
    const d = JSON.parse(localStorage.getItem(STORE));
    if (d && Array.isArray(d.sessions)) return d;
  } catch (_) { /* a fresh start */ }
  return { sessions: [], current: null, settings: {} };
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(data));
  } catch (_) {
    // Over the storage quota (images are large): keep the conversations without their images.
    const slim = JSON.parse(JSON.stringify(data));
    for (const s of slim.sessions) for (const m of s.messages) if (m.images) m.images = [];
    try { localStorage.setItem(STORE, JSON.stringify(slim)); } catch (_) { /* nothing more to drop */ }
  }
}

function newId() {
  const r = crypto.getRandomValues ? Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, "0")).join("") : String(Math.random()).slice(2);
  return "web-" + r;
}

function current() {
  let s = data.sessions.find((x) => x.id === data.current);
  if (!s) {
    s = { id: newId(), title: "New chat", messages: [] };
    data.sessions.unshift(s);
    data.current = s.id;
    save();
  }
  return s;
}

function setState(state, text) {
  document.body.dataset.state = state;
  $("send").disabled = state === "generating";
  $("stop").disabled = state !== "generating";
  $("status").textContent = text || "";
}

// ---- rendering ----

function renderSessions() {
  const ul = $("sessions");
  ul.textContent = "";
  for (const s of data.sessions) {
    const li = document.createElement("li");
    li.className = s.id === data.current ? "current" : "";
    const title = document.createElement("span");
    title.textContent = s.title;
    li.appendChild(title);
    const del = document.createElement("button");
    del.textContent = "\u00d7";
    del.title = "Delete this chat";
    del.onclick = (e) => {
      e.stopPropagation();
      data.sessions = data.sessions.filter((x) => x.id !== s.id);
      if (data.current === s.id) data.current = null;
      save();
      renderAll();
    };
    li.appendChild(del);
    li.onclick = () => {
      if (running) return;
      data.current = s.id;
      save();
      renderAll();
    };
    ul.appendChild(li);
  }
}

function messageView(msg) {
  const div = document.createElement("div");
  div.className = "msg " + msg.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = msg.role;
  div.appendChild(role);
  const view = { div };
  if (msg.role === "assistant") {
    view.thinking = document.createElement("details");
    view.thinking.className = "thinking";
    view.thinking.innerHTML = "<summary>Thinking</summary>";
    view.reasoning = document.createElement("div");
    view.reasoning.className = "reasoning";
    view.thinking.appendChild(view.reasoning);
    div.appendChild(view.thinking);
    view.body = document.createElement("div");
    view.body.className = "answer body";
    div.appendChild(view.body);
    view.meta = document.createElement("div");
    view.meta.className = "meta";
    div.appendChild(view.meta);
  } else {
    if (msg.images && msg.images.length) {
      const box = document.createElement("div");
      box.className = "images";
      for (const url of msg.images) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = "attached image";
        box.appendChild(img);
      }
      div.appendChild(box);
    }
    view.body = document.createElement("div");
    view.body.className = "body";
    div.appendChild(view.body);
  }
  updateView(view, msg);
  return view;
}

// ---- images ----

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  box.hidden = pending.length === 0;
  pending.forEach((url, i) => {
    const t = document.createElement("div");
    t.className = "thumb";
    const img = document.createElement("img");
    img.src = url;
    img.alt = "image to send";
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "\u00d7";
    del.title = "Remove";
    del.onclick = () => { pending.splice(i, 1); renderAttachments(); };
    t.append(img, del);
    box.appendChild(t);
  });
}

function attachFiles(files) {
  for (const f of files) {
    if (!/^image\/(png|jpeg|webp)$/.test(f.type)) {
      setState("idle", f.name + ": only PNG, JPEG and WebP images can be sent");
      continue;
    }
    const r = new FileReader();
    r.onload = () => { pending.push(r.result); renderAttachments(); };
    r.readAsDataURL(f);
  }
}

function updateView(view, msg) {
  if (msg.role !== "assistant") {
    view.body.textContent = msg.content;
    return;
  }
  view.thinking.hidden = !msg.reasoning;
  view.reasoning.textContent = msg.reasoning || "";
  view.body.innerHTML = renderMarkdown(msg.content || "");
  view.meta.textContent = msg.meta || "";
  if (msg.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = msg.error;
    view.meta.appendChild(e);
  }
}

function renderMessages() {
  const box = $("messages");
  box.textContent = "";
  for (const m of current().messages) box.appendChild(messageView(m).div);
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderSessions();
  renderMessages();
}

// ---- talking to the server ----

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// Yields {event, data} from a server-sent-events body.
async function* sseEvents(body) {
  const reader = body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const lines = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) lines.push(line.slice(5).replace(/^ /, ""));
      }
      if (lines.length) yield { event, data: lines.join("\n") };
    }
  }
}

async function send(text) {
  const s = current();
  if (s.messages.length === 0) s.title = text.slice(0, 40);
  const user = { role: "user", content: text };
  if (pending.length) user.images = pending;
  pending = [];
  renderAttachments();
  s.messages.push(user);
  const history = s.messages.map((m) =>
    m.images && m.images.length ? { role: m.role, content: m.content, images: m.images } : { role: m.role, content: m.content });
  const msg = { role: "assistant", content: "", reasoning: "" };
  s.messages.push(msg);
  save();
  renderAll();
  const view = messageView(msg);
  const box = $("messages");
  box.lastChild.replaceWith(view.div);
  view.div.classList.add("streaming");
  const controller = new AbortController();
  running = { session: s.id, controller, msg, view };
  setState("generating", "generating\u2026");
  const settings = readSettings();
  let frame = 0;
  const redraw = () => {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      updateView(view, msg);
      box.scrollTop = box.scrollHeight;
    });
  };
  let finish = "";
  try {
    const res = await fetch("/api/chat", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        messages: history,
        session: s.id,
        max_tokens: settings.max_tokens,
        temperature: settings.temperature,
        thinking_effort: settings.thinking_effort,
      }),
    });
    if (!res.ok) {
      let detail = res.status + " " + res.statusText;
      try { detail = (await res.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(detail);
    }
    for await (const { event, data: raw } of sseEvents(res.body)) {
      const d = JSON.parse(raw);
      if (event === "thinking") {
        msg.reasoning += d.text;
        view.thinking.open = true;
      } else if (event === "answer") {
        msg.content += d.text;
        if (msg.content.trim()) view.thinking.open = false;
      } else if (event === "done") {
        finish = d.finish_reason;
        if (typeof d.content === "string") msg.content = d.content;
        if (typeof d.reasoning === "string") msg.reasoning = d.reasoning;
        const u = d.usage || {};
        const t = d.timing || {};
        const parts = [finish === "cancelled" ? "stopped" : finish];
        if (u.completion_tokens !== undefined) parts.push(u.completion_tokens + " tokens");
        if (t.generation_tps) parts.push(t.generation_tps.toFixed(1) + " tok/s");
        const sp = d.speculative;
        if (sp && sp.cycles > 0) parts.push(sp.tokens_per_cycle.toFixed(2) + " tokens/cycle");
        else if (sp && sp.plain_steps > 0) parts.push("drafting off");
        if (u.cached_tokens) parts.push(u.cached_tokens + " prompt tokens from cache");
        msg.meta = parts.join(" \u00b7 ");
      } else if (event === "error") {
        msg.error = d.error ? d.error.message : raw;
      }
      redraw();
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "cancelled";
    else msg.error = String(e.message || e);
  }
  if (!msg.meta) msg.meta = finish === "cancelled" ? "stopped" : finish;
  view.thinking.open = false;
  view.div.classList.remove("streaming");
  updateView(view, msg);
  running = null;
  save();
  setState("idle", finish === "cancelled" ? "stopped" : "");
}

async function stop() {
  if (!running) return;
  const r = running;
  setState("generating", "stopping\u2026");
  try {
    await fetch("/api/chat/stop", { method: "POST", headers: headers(), body: JSON.stringify({ session: r.session }) });
  } catch (_) { /* the abort below still ends it */ }
  // The stream ends by itself once the server stopped; abort if it does not.
  setTimeout(() => { if (running === r) r.controller.abort(); }, 3000);
}

// ---- settings and wiring ----

function readSettings() {
  const st = {
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 512),
    temperature: Math.min(2, Math.max(0, parseFloat($("temperature").value) || 0)),
    thinking_effort: $("thinking").value,
  };
  data.settings = Object.assign({}, st, { api_key: $("api-key").value });
  save();
  return st;
}

function applySettings() {
  const st = data.settings || {};
  if (st.max_tokens) $("max-tokens").value = st.max_tokens;
  if (st.temperature !== undefined) $("temperature").value = st.temperature;
  if (st.thinking_effort) $("thinking").value = st.thinking_effort;
  if (st.api_key) $("api-key").value = st.api_key;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("attach").addEventListener("click", () => $("image-file").click());
$("image-file").addEventListener("change", (e) => { attachFiles(e.target.files); e.target.value = ""; });
$("prompt").addEventListener("paste", (e) => {
  if (!vision) return;
  const files = Array.from(e.clipboardData ? e.clipboardData.files : []);
  if (files.length) {
    e.preventDefault();
    attachFiles(files);
  }
});
$("new-chat").addEventListener("click", () => {
  if (running) return;
  data.current = null;
  current();
  renderAll();
});
for (const id of ["max-tokens", "temperature", "thinking", "api-key"]) $(id).addEventListener("change", readSettings);

// What a new user should know about the project's tiny default model before reading its replies.
const K3_NANO_NOTE = "k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers.";

fetch("/health").then((r) => r.json()).then((h) => {
  $("model").textContent = "model: " + h.model + " (context " + h.max_context + ")";
  vision = !!h.vision;
  $("attach").hidden = !vision;
  if (h.model === "k3-nano") {
    $("notice").textContent = K3_NANO_NOTE;
    $("notice").hidden = false;
  }
}).catch(() => { $("model").textContent = "server unreachable"; });

applySettings();
renderAll();
setState("idle");
