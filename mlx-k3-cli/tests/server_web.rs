//! The web chat page in headless Chromium (Debian's `chromium`), driven over the Chrome DevTools protocol:
//! load `/`, check the markdown renderer escapes HTML, send a prompt, see text stream in, press stop, see the
//! generation end, reload and find the conversation kept in the browser. A screenshot is saved to
//! `target/test-artifacts/web_chat.png`. A second test has the page show a stored assistant reply with
//! fenced and unfenced Python and checks that the code is displayed as code (indentation, `__init__`), and
//! that the page says what k3-nano is. A third serves with a drafter and reads the reply's footer: tokens
//! per verify cycle, as the metrics count them.
//!
//! Chromium is found on PATH (or `MLX_K3_CHROMIUM`); if missing, the test installs it with apt-get (as root,
//! or with sudo). It skips, loudly, only when Chromium can be neither found nor installed.

mod server_support;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use server_support::Server;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

fn find_on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|d| names.iter().map(move |n| d.join(n))).find(|p| p.is_file())
}

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MLX_K3_CHROMIUM").map(PathBuf::from).filter(|p| p.is_file()) {
        return Some(p);
    }
    let names = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"];
    if let Some(p) = find_on_path(&names) {
        return Some(p);
    }
    eprintln!("chromium not found on PATH: trying `apt-get install -y -q chromium`");
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    let apt = |args: &[&str]| {
        let mut c = if root { Command::new("apt-get") } else { Command::new("sudo") };
        if !root {
            c.args(["-n", "apt-get"]);
        }
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive").stdout(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    if !apt(&["install", "-y", "-q", "chromium"]) {
        apt(&["update", "-q"]);
        apt(&["install", "-y", "-q", "chromium"]);
    }
    find_on_path(&names)
}

/// A headless browser and a DevTools connection to its page.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    fn launch(exe: &Path) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let child = Command::new(exe)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
                "--window-size=1280,860",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start chromium");
        // Chromium writes its DevTools port to the profile once it listens.
        let port_file = profile.path().join("DevToolsActivePort");
        let t0 = Instant::now();
        let port = loop {
            if let Some(p) =
                std::fs::read_to_string(&port_file).ok().and_then(|t| t.lines().next()?.parse::<u16>().ok())
            {
                break p;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "chromium did not open its DevTools port");
            std::thread::sleep(Duration::from_millis(100));
        };
        let list: Value = loop {
            let res = server_support::agent().get(format!("http://127.0.0.1:{port}/json/list")).call();
            if let Ok(mut r) = res {
                let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
                if v.as_array().is_some_and(|a| a.iter().any(|t| t["type"] == "page")) {
                    break v;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "chromium has no page target");
            std::thread::sleep(Duration::from_millis(100));
        };
        let page = list.as_array().unwrap().iter().find(|t| t["type"] == "page").unwrap();
        let url = page["webSocketDebuggerUrl"].as_str().unwrap();
        let (ws, _) = tungstenite::connect(url).expect("cannot connect to the DevTools socket");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        }
        Browser { child, _profile: profile, ws, next_id: 0 }
    }

    /// One DevTools command; returns its result (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(msg)).unwrap();
        loop {
            let m = self.ws.read().unwrap_or_else(|e| panic!("{method}: DevTools connection failed: {e}"));
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method} failed: {}", v["error"]);
                return v["result"].clone();
            }
        }
    }

    /// Evaluates JavaScript in the page and returns its value.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({"expression": expr, "returnByValue": true, "awaitPromise": true}));
        assert!(r.get("exceptionDetails").is_none(), "{expr} threw: {}", r["exceptionDetails"]);
        r["result"]["value"].clone()
    }

    /// Polls `expr` until it is true.
    fn wait_for(&mut self, expr: &str, timeout: Duration, what: &str) {
        let t0 = Instant::now();
        while self.eval(expr) != json!(true) {
            assert!(t0.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD.decode(r["data"].as_str().unwrap()).unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

fn artifacts() -> PathBuf {
    // CARGO_TARGET_TMPDIR is <target>/tmp.
    Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().join("test-artifacts")
}

const ANSWER_LEN: &str =
    "(document.querySelector('.msg.assistant:last-child .answer') || {textContent: ''}).textContent.length";

#[test]
fn web_chat_page_streams_and_stops_in_headless_chromium() {
    let Some(exe) = chromium() else {
        eprintln!("\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!");
        eprintln!("SKIPPED web_chat_page_streams_and_stops_in_headless_chromium: chromium is not installed and");
        eprintln!("`apt-get install chromium` failed. Install Debian's chromium package to run this test.");
        eprintln!("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n");
        return;
    };
    let s = Server::start(&[]);
    let mut b = Browser::launch(&exe);
    b.call("Page.enable", json!({}));
    b.call("Page.navigate", json!({"url": s.at("/")}));
    b.wait_for(
        "document.readyState === 'complete' && typeof renderMarkdown === 'function' \
         && document.body.dataset.state === 'idle'",
        Duration::from_secs(30),
        "the page to load",
    );
    b.wait_for("document.getElementById('model').textContent.startsWith('model:')", Duration::from_secs(10), "/health");

    // The markdown renderer: markup rendered, HTML escaped, unsafe links dropped.
    let md = "# Title\n**bold** and *it* and `a<b>`\n\n- one\n- two\n\n1. first\n\n```py\nprint('<p>')\n```\n\
              <script>alert(1)</script> [x](javascript:alert(1)) [ok](https://example.com/a_b_c)";
    let html = b.eval(&format!("renderMarkdown({})", json!(md)));
    let html = html.as_str().unwrap();
    for want in [
        "<h1>Title</h1>",
        "<strong>bold</strong>",
        "<em>it</em>",
        "<code>a&lt;b&gt;</code>",
        "<ul><li>one</li><li>two</li></ul>",
        "<ol><li>first</li></ol>",
        "<pre><code class=\"language-py\">print(&#39;&lt;p&gt;&#39;)</code></pre>",
        "&lt;script&gt;alert(1)&lt;/script&gt;",
        "<a href=\"https://example.com/a_b_c\" target=\"_blank\" rel=\"noopener noreferrer\">ok</a>",
    ] {
        assert!(html.contains(want), "renderMarkdown output lacks {want}:\n{html}");
    }
    assert!(!html.contains("javascript:") && !html.contains("<script>"), "{html}");

    // Send a prompt with room for a long answer, greedy.
    b.eval(
        "document.getElementById('max-tokens').value = '3000';
         document.getElementById('temperature').value = '0';
         document.getElementById('prompt').value = 'Write a Python class for a bank account.';
         document.getElementById('send').click(); true",
    );
    b.wait_for(
        &format!("document.body.dataset.state === 'generating' && {ANSWER_LEN} >= 20"),
        Duration::from_secs(60),
        "streamed text",
    );
    let len1 = b.eval(ANSWER_LEN).as_u64().unwrap();
    b.wait_for(&format!("{ANSWER_LEN} > {len1}"), Duration::from_secs(20), "more streamed text");
    assert_eq!(b.eval("document.getElementById('stop').disabled"), json!(false), "stop is enabled while generating");

    b.eval("document.getElementById('stop').click(); true");
    b.wait_for("document.body.dataset.state === 'idle'", Duration::from_secs(10), "the generation to end after stop");
    let status = b.eval("document.getElementById('status').textContent");
    assert_eq!(status, json!("stopped"));
    let meta = b.eval("document.querySelector('.msg.assistant:last-child .meta').textContent");
    assert!(meta.as_str().unwrap().starts_with("stopped"), "{meta}");
    let len_end = b.eval(ANSWER_LEN).as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.eval(ANSWER_LEN).as_u64().unwrap(), len_end, "text kept coming after stop");
    let answer_tokens = s.metric("mlx_k3_generated_tokens_total");
    assert!(answer_tokens < 3000.0, "the generation ran to the end: {answer_tokens} tokens");
    assert_eq!(s.metric("mlx_k3_queue_length"), 0.0);

    let shot = artifacts().join("web_chat.png");
    b.screenshot(&shot);
    assert!(std::fs::metadata(&shot).unwrap().len() > 1000);
    eprintln!("screenshot: {}", shot.display());

    // The conversation is kept in the browser across a reload.
    b.eval("window.beforeReload = true");
    b.call("Page.reload", json!({}));
    b.wait_for(
        "!window.beforeReload && document.readyState === 'complete' && document.querySelectorAll('.msg').length === 2",
        Duration::from_secs(30),
        "the conversation to come back after a reload",
    );
    let kept = b.eval(ANSWER_LEN).as_u64().unwrap();
    assert_eq!(kept, len_end, "the stored answer differs from the one shown");
}

/// An assistant reply with code in it, as a model writes one: a fenced block with an info string, unfenced
/// Python (k3-nano writes no fences), an indented block under prose, and dunder names in prose.
const CODE_REPLY: &str = "Here is a class:

```python title=\"account.py\"
class Account:
    def __init__(self, owner):
        self.owner = owner
```

And without fences:

def __repr__(self):
    return f\"Account({self.owner!r})\"

    if self.owner:
        return __name__

Indented under prose:
    x = 1
        y = 2
The __init__ method sets the owner; __repr__ shows it.";

#[test]
fn web_chat_page_shows_code_as_code_and_says_what_k3_nano_is() {
    let Some(exe) = chromium() else {
        eprintln!("\nSKIPPED web_chat_page_shows_code_as_code_and_says_what_k3_nano_is: chromium is not installed and");
        eprintln!("`apt-get install chromium` failed. Install Debian's chromium package to run this test.\n");
        return;
    };
    let s = Server::start(&[]);
    let mut b = Browser::launch(&exe);
    b.call("Page.enable", json!({}));
    b.call("Page.navigate", json!({"url": s.at("/")}));
    b.wait_for("document.readyState === 'complete'", Duration::from_secs(30), "the page to load");
    // A conversation as the page stores it, shown after a reload.
    let store = json!({
        "sessions": [{"id": "web-code", "title": "code", "messages": [
            {"role": "user", "content": "Write a class."},
            {"role": "assistant", "content": CODE_REPLY, "reasoning": "", "meta": "stop"},
        ]}],
        "current": "web-code",
        "settings": {},
    });
    b.eval(&format!("localStorage.setItem('mlx-k3.chat', {}); true", json!(store.to_string())));
    b.call("Page.reload", json!({}));
    b.wait_for(
        "document.readyState === 'complete' && document.querySelectorAll('.msg.assistant .answer pre').length > 0",
        Duration::from_secs(30),
        "the stored reply to render",
    );
    // innerText is what the page displays (CSS white-space applied), so collapsed indentation would show.
    let blocks = b.eval("Array.from(document.querySelectorAll('.msg.assistant .answer pre'), (p) => p.innerText)");
    let want = json!([
        "class Account:\n    def __init__(self, owner):\n        self.owner = owner",
        "def __repr__(self):\n    return f\"Account({self.owner!r})\"\n\n    if self.owner:\n        return __name__",
        "x = 1\n    y = 2",
    ]);
    assert_eq!(blocks, want, "code blocks as displayed");
    let lang = b.eval("document.querySelector('.msg.assistant .answer pre code').className");
    assert_eq!(lang, json!("language-python"));
    let prose = b.eval("document.querySelector('.msg.assistant .answer p:last-child').innerText");
    assert_eq!(prose, json!("The __init__ method sets the owner; __repr__ shows it."));
    let bold = b.eval("document.querySelectorAll('.msg.assistant .answer strong, .msg.assistant .answer em').length");
    assert_eq!(bold, json!(0), "no emphasis made of dunder names");

    // The page says what k3-nano is (when the tests run it: MLX_K3_TEST_MODEL may name another model).
    if server_support::model_dir().file_name().is_some_and(|n| n != "k3-nano") {
        return;
    }
    b.wait_for("!document.getElementById('notice').hidden", Duration::from_secs(10), "the note on k3-nano");
    let note = b.eval("document.getElementById('notice').innerText");
    assert_eq!(
        note,
        json!("k3-nano is a 3M-parameter model trained on Python code: expect Python-like text, not answers.")
    );
    b.screenshot(&artifacts().join("web_chat_code.png"));
}

#[test]
fn web_chat_footer_shows_tokens_per_cycle_with_a_drafter() {
    let Some(exe) = chromium() else {
        eprintln!("\nSKIPPED web_chat_footer_shows_tokens_per_cycle_with_a_drafter: chromium is not installed and");
        eprintln!("`apt-get install chromium` failed. Install Debian's chromium package to run this test.\n");
        return;
    };
    // k3-nano drafting for itself: every draft is kept, so a cycle emits num_draft + 1 tokens.
    let model = server_support::model_dir();
    // Gated by tokens: drafting starts at a request's first token (by time, the default, a request first
    // times a few plain steps, and these replies are short).
    let s = Server::start(&["--draft-model", model.to_str().unwrap(), "--num-draft", "3", "--gate-cost", "tokens"]);
    let mut b = Browser::launch(&exe);
    b.call("Page.enable", json!({}));
    b.call("Page.navigate", json!({"url": s.at("/")}));
    b.wait_for(
        "document.readyState === 'complete' && document.body.dataset.state === 'idle'",
        Duration::from_secs(30),
        "the page to load",
    );
    b.eval(
        "document.getElementById('max-tokens').value = '24';
         document.getElementById('temperature').value = '0';
         document.getElementById('prompt').value = 'def add(a, b):';
         document.getElementById('send').click(); true",
    );
    b.wait_for(
        "document.body.dataset.state === 'idle' && document.querySelectorAll('.msg').length === 2",
        Duration::from_secs(60),
        "the reply",
    );
    let meta = b.eval("document.querySelector('.msg.assistant:last-child .meta').textContent");
    let meta = meta.as_str().unwrap();
    let cycles = s.metric("mlx_k3_spec_cycles_total");
    assert!(cycles > 0.0, "no verify cycle ran ({meta})");
    let per_cycle = meta
        .split(" \u{b7} ")
        .find_map(|p| p.strip_suffix(" tokens/cycle"))
        .unwrap_or_else(|| panic!("the footer has no tokens/cycle: {meta}"));
    let per_cycle: f64 = per_cycle.parse().unwrap();
    // The same figure the metrics give: (accepted + cycles) / cycles.
    let accepted = s.metric("mlx_k3_spec_accepted_tokens_total");
    assert!((per_cycle - (accepted + cycles) / cycles).abs() < 0.006, "{meta}: {accepted} accepted in {cycles}");
    assert!(per_cycle > 1.0, "{meta}");
}

#[test]
fn web_chat_page_sends_an_attached_image() {
    let Some(exe) = chromium() else {
        eprintln!("\nSKIPPED web_chat_page_sends_an_attached_image: chromium is not installed and");
        eprintln!("`apt-get install chromium` failed. Install Debian's chromium package to run this test.\n");
        return;
    };
    // The end-to-end vision fixture (a tiny K3 checkpoint with a tower; tests/vision_chat.rs checks it
    // against mlx-vlm).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures");
    let png = root.join("vision_preprocess/rgb.png").canonicalize().unwrap();
    let s = Server::start_with(&root.join("vision_chat"), &[]);
    let mut b = Browser::launch(&exe);
    b.call("Page.enable", json!({}));
    b.call("Page.navigate", json!({"url": s.at("/")}));
    b.wait_for(
        "document.readyState === 'complete' && !document.getElementById('attach').hidden",
        Duration::from_secs(30),
        "the page to offer the image button (the model has a vision tower)",
    );
    // Choose the file as a user would in the file dialog.
    let root_node = b.call("DOM.getDocument", json!({}))["root"]["nodeId"].clone();
    let input = b.call("DOM.querySelector", json!({"nodeId": root_node, "selector": "#image-file"}))["nodeId"].clone();
    b.call("DOM.setFileInputFiles", json!({"nodeId": input, "files": [png.to_str().unwrap()]}));
    b.wait_for("document.querySelectorAll('#attachments img').length === 1", Duration::from_secs(10), "the thumbnail");
    b.eval(
        "document.getElementById('max-tokens').value = '4';
         document.getElementById('temperature').value = '0';
         document.getElementById('prompt').value = 'What is in the picture?';
         document.getElementById('send').click(); true",
    );
    b.wait_for(
        "document.body.dataset.state === 'idle' && document.querySelectorAll('.msg').length === 2",
        Duration::from_secs(60),
        "the reply",
    );
    // The image is shown in the conversation, the thumbnail strip is cleared, and the reply came back.
    assert_eq!(b.eval("document.querySelectorAll('.msg.user .images img').length"), json!(1));
    assert_eq!(b.eval("document.querySelectorAll('#attachments img').length"), json!(0));
    let meta = b.eval("document.querySelector('.msg.assistant:last-child .meta').textContent");
    assert!(
        !meta.as_str().unwrap().is_empty() && b.eval("document.querySelector('.msg.assistant .error')") == json!(null),
        "{meta}"
    );
    // The server saw the image: its prompt is longer than the text alone (the image's tokens are in it).
    assert_eq!(s.metric("mlx_k3_requests_total"), 1.0);
    let with_image = s.metric("mlx_k3_prompt_tokens_total");
    let body = json!({"messages": [{"role": "user", "content": "What is in the picture?"}], "max_tokens": 1,
                      "thinking_effort": "high"});
    let (code, v) = s.post_raw("/api/chat", &body.to_string());
    assert_eq!(code, 200, "{v}");
    let text_only = s.metric("mlx_k3_prompt_tokens_total") - with_image;
    assert!(with_image > text_only, "prompt tokens with the image {with_image}, without {text_only}");
}
