//! Splitting a chat reply into reasoning and answer while it streams.
//!
//! Reasoning and answer are only separable by the chat format's markers (Kimi K3's XTML:
//! `...<|close|>think<|sep|><|open|>response<|sep|>...<|close|>response<|sep|>`, tool calls after
//! `<|open|>tools<|sep|>`; Kimi K2's tool sections `<|tool_calls_section_begin|>...<|tool_calls_section_end|>`;
//! with [`ReplySplitter::with_think_tags`], Kimi K2-Thinking's and K2.5's `<think>...</think>` reasoning, as
//! mlx-lm's server splits it), which arrive as several tokens. The splitter follows the same rules as
//! [`mlx_k3::chat::ChatEncoder::parse`] as a state machine and holds back only a tail that could still grow
//! into a marker, so text reaches the client token by token and a marker never leaks half-written. The final
//! reply (the engine's parse of the whole text) stays authoritative for the tool calls; in odd outputs (text
//! outside the response block) the streamed answer can hold text that the final parse drops.

const THINK_OPEN: &str = "<|open|>think";
const THINK_END: &str = "<|close|>think<|sep|>";
const SEP: &str = "<|sep|>";
const TOOLS_OPEN: &str = "<|open|>tools<|sep|>";
const RESPONSE_OPEN: &str = "<|open|>response<|sep|>";
const RESPONSE_CLOSE: &str = "<|close|>response<|sep|>";
const K2_TOOLS_OPEN: &str = "<|tool_calls_section_begin|>";
const K2_TOOLS_CLOSE: &str = "<|tool_calls_section_end|>";
const K2_THINK_OPEN: &str = "<think>";
const K2_THINK_CLOSE: &str = "</think>";
// Removed from the answer wherever they appear.
const DROPPED: [&str; 2] = ["<|close|>message<|sep|>", "<|im_end|>"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// Inside `<|open|>think ...`, before its `<|sep|>`.
    ThinkHeader,
    Reasoning,
    Answer,
    /// After the response block closed: only a tool section may follow.
    AfterAnswer,
    /// The tool section (its calls come from the final parse).
    Tools,
    /// A Kimi K2 tool section: held back until it closes, then the answer goes on.
    K2Tools,
    /// Kimi K2-Thinking's `<think>` block: reasoning until `</think>` or a tool section.
    K2Reasoning,
}

/// New reasoning and answer text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Thinking text.
    pub reasoning: String,
    /// Answer text.
    pub content: String,
}

impl Delta {
    /// Whether nothing is new.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

/// The state machine; feed it text pieces in order.
pub struct ReplySplitter {
    part: Part,
    pending: String,
    saw_response_open: bool,
    think_tags: bool,
}

impl ReplySplitter {
    /// A splitter for a reply that starts inside the thinking block or not.
    pub fn new(starts_in_thinking: bool) -> Self {
        let part = if starts_in_thinking { Part::Reasoning } else { Part::Answer };
        ReplySplitter { part, pending: String::new(), saw_response_open: false, think_tags: false }
    }

    /// With `on`, `<think>` in the answer opens reasoning that `</think>` closes (mlx-lm's states for a
    /// vocabulary with both tags: each tag is plain text in the other state, and a Kimi K2 tool section may
    /// open inside the reasoning and returns to the answer when it closes).
    pub fn with_think_tags(mut self, on: bool) -> Self {
        self.think_tags = on;
        if on && self.part == Part::Reasoning {
            self.part = Part::K2Reasoning;
        }
        self
    }

    /// Adds a piece; returns the text that is now certain.
    pub fn push(&mut self, piece: &str) -> Delta {
        self.pending.push_str(piece);
        let mut out = Delta::default();
        loop {
            match self.part {
                Part::ThinkHeader => match self.pending.find(SEP) {
                    Some(i) => {
                        self.pending.drain(..i + SEP.len());
                        self.part = Part::Reasoning;
                    }
                    None => break,
                },
                Part::Reasoning => match self.pending.find(THINK_END) {
                    Some(i) => {
                        out.reasoning.push_str(&self.pending[..i]);
                        self.pending.drain(..i + THINK_END.len());
                        self.part = Part::Answer;
                    }
                    None => {
                        let keep = partial_marker_len(&self.pending, &[THINK_END]);
                        let n = self.pending.len() - keep;
                        out.reasoning.push_str(&self.pending[..n]);
                        self.pending.drain(..n);
                        break;
                    }
                },
                Part::Answer => {
                    let close_ends = self.saw_response_open;
                    let mut markers = vec![THINK_OPEN, TOOLS_OPEN, RESPONSE_OPEN, RESPONSE_CLOSE, K2_TOOLS_OPEN];
                    markers.extend(DROPPED);
                    if self.think_tags {
                        markers.push(K2_THINK_OPEN);
                    }
                    let first = markers.iter().filter_map(|m| self.pending.find(m).map(|i| (i, *m))).min();
                    match first {
                        Some((i, m)) => {
                            out.content.push_str(&self.pending[..i]);
                            self.pending.drain(..i + m.len());
                            self.part = match m {
                                THINK_OPEN => Part::ThinkHeader,
                                TOOLS_OPEN => Part::Tools,
                                K2_TOOLS_OPEN => Part::K2Tools,
                                K2_THINK_OPEN => Part::K2Reasoning,
                                RESPONSE_CLOSE if close_ends => Part::AfterAnswer,
                                _ => Part::Answer,
                            };
                            if m == RESPONSE_OPEN {
                                self.saw_response_open = true;
                            }
                        }
                        None => {
                            let keep = partial_marker_len(&self.pending, &markers);
                            let n = self.pending.len() - keep;
                            out.content.push_str(&self.pending[..n]);
                            self.pending.drain(..n);
                            break;
                        }
                    }
                }
                Part::AfterAnswer => match self.pending.find(TOOLS_OPEN) {
                    Some(i) => {
                        self.pending.drain(..i + TOOLS_OPEN.len());
                        self.part = Part::Tools;
                    }
                    None => {
                        let keep = partial_marker_len(&self.pending, &[TOOLS_OPEN]);
                        self.pending.drain(..self.pending.len() - keep);
                        break;
                    }
                },
                Part::Tools => {
                    self.pending.clear();
                    break;
                }
                Part::K2Reasoning => {
                    let markers = [K2_THINK_CLOSE, K2_TOOLS_OPEN];
                    let first = markers.iter().filter_map(|m| self.pending.find(m).map(|i| (i, *m))).min();
                    match first {
                        Some((i, m)) => {
                            out.reasoning.push_str(&self.pending[..i]);
                            self.pending.drain(..i + m.len());
                            self.part = if m == K2_TOOLS_OPEN { Part::K2Tools } else { Part::Answer };
                        }
                        None => {
                            let keep = partial_marker_len(&self.pending, &markers);
                            let n = self.pending.len() - keep;
                            out.reasoning.push_str(&self.pending[..n]);
                            self.pending.drain(..n);
                            break;
                        }
                    }
                }
                Part::K2Tools => match self.pending.find(K2_TOOLS_CLOSE) {
                    Some(i) => {
                        self.pending.drain(..i + K2_TOOLS_CLOSE.len());
                        self.part = Part::Answer;
                    }
                    None => {
                        let keep = partial_marker_len(&self.pending, &[K2_TOOLS_CLOSE]);
                        self.pending.drain(..self.pending.len() - keep);
                        break;
                    }
                },
            }
        }
        out
    }

    /// The end of the reply: releases a held-back tail that never became a marker.
    pub fn finish(&mut self) -> Delta {
        let rest = std::mem::take(&mut self.pending);
        match self.part {
            Part::Reasoning | Part::K2Reasoning => Delta { reasoning: rest, content: String::new() },
            Part::Answer => Delta { reasoning: String::new(), content: rest },
            _ => Delta::default(),
        }
    }
}

/// Length of the longest tail of `text` that is a proper prefix of one of `markers`.
fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
    markers.iter().flat_map(|m| (1..m.len()).rev().find(|&k| text.ends_with(&m[..k]))).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use mlx_k3::chat::{ChatEncoder, ThinkingEffort};
    use mlx_k3::tokenizer::{TiktokenTokenizer, Tokenizer, KIMI_PATTERN};

    /// A byte-level tokenizer whose specials are Kimi K3's XTML tokens, so the chat encoder parses XTML.
    fn xtml_encoder() -> ChatEncoder {
        let ranks: HashMap<Vec<u8>, u32> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
        let cfg = serde_json::json!({"added_tokens_decoder": {
            "256": {"content": "<|open|>"}, "257": {"content": "<|sep|>"}, "258": {"content": "<|close|>"},
            "259": {"content": "<|im_end|>"}, "260": {"content": "<|end_of_msg|>"}
        }});
        let tok = Tokenizer::Tiktoken(TiktokenTokenizer::from_ranks(ranks, &cfg, KIMI_PATTERN).unwrap());
        ChatEncoder::new(&tok, None, None, None).unwrap()
    }

    /// k3-nano's tokens (Kimi K2's `<|im_*|>` and tool-section tokens): replies are read as Kimi K2's.
    fn k2_encoder() -> ChatEncoder {
        let ranks: HashMap<Vec<u8>, u32> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
        let cfg = serde_json::json!({"added_tokens_decoder": {
            "256": {"content": "<|im_user|>"}, "257": {"content": "<|im_assistant|>"},
            "258": {"content": "<|im_middle|>"}, "259": {"content": "<|im_end|>"},
            "260": {"content": "<|tool_calls_section_begin|>"}, "261": {"content": "<|tool_calls_section_end|>"}
        }});
        let tok = Tokenizer::Tiktoken(TiktokenTokenizer::from_ranks(ranks, &cfg, KIMI_PATTERN).unwrap());
        ChatEncoder::new(&tok, None, None, None).unwrap()
    }

    #[test]
    fn kimi_k2_tool_sections_never_stream_as_answer() {
        let enc = k2_encoder();
        assert_eq!(enc.tool_syntax(), mlx_k3::chat::ToolSyntax::KimiK2);
        let call = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|>";
        let texts = [
            format!("Sure.<|tool_calls_section_begin|>{call}<|tool_calls_section_end|> Done.<|im_end|>"),
            format!("a<|tool_calls_section_begin|>{call}<|tool_calls_section_end|>b<|tool_calls_section_begin|>{call}"),
            "almost <|tool_calls_sec".to_string(),
            "stray <|tool_calls_section_end|> end".to_string(),
        ];
        for text in &texts {
            let want = enc.parse(text, ThinkingEffort::Off);
            if text.contains(K2_TOOLS_OPEN) {
                assert!(!want.content.contains("tool_call"), "{text}: {want:?}");
            }
            for cut in 0..=text.len() {
                if !text.is_char_boundary(cut) {
                    continue;
                }
                for cut2 in [cut, (cut + 5).min(text.len()), (cut + 17).min(text.len())] {
                    let got = stream(text, false, &[cut, cut2]);
                    assert_eq!(got.content, want.content, "answer of {text:?} cut at {cut}/{cut2}");
                    assert_eq!(got.reasoning, "");
                }
            }
        }
        assert_eq!(enc.parse(&texts[0], ThinkingEffort::Off).tool_calls.len(), 1);
        assert_eq!(enc.parse(&texts[1], ThinkingEffort::Off).tool_calls.len(), 2);
    }

    fn stream(text: &str, starts_in_thinking: bool, cuts: &[usize]) -> Delta {
        let mut s = ReplySplitter::new(starts_in_thinking);
        let mut all = Delta::default();
        let mut at = 0;
        for &c in cuts.iter().chain([&text.len()]) {
            let d = s.push(&text[at..c]);
            all.reasoning += &d.reasoning;
            all.content += &d.content;
            at = c;
        }
        let d = s.finish();
        all.reasoning += &d.reasoning;
        all.content += &d.content;
        all
    }

    #[test]
    fn streamed_split_matches_the_final_parse_at_every_cut() {
        let enc = xtml_encoder();
        let call = "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"x\" \
                    type=\"string\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
        let cases = [
            (
                "Let me think <b>.<|close|>think<|sep|><|open|>response<|sep|>**Hi** there<|close|>response<|sep|>\
                 <|close|>message<|sep|>",
                ThinkingEffort::High,
            ),
            ("still thinking <|close|>thi", ThinkingEffort::High),
            ("the answer<|close|>response<|sep|><|close|>message<|sep|>", ThinkingEffort::Off),
            (
                "<|open|>think effort=\"low\"<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok<|im_end|>",
                ThinkingEffort::Off,
            ),
            ("plain text with < and <| but no marker", ThinkingEffort::Off),
        ];
        let with_tools = format!("r<|close|>think<|sep|><|open|>response<|sep|>calling<|close|>response<|sep|>{call}");
        let mut all: Vec<(String, ThinkingEffort)> = cases.iter().map(|(t, e)| (t.to_string(), *e)).collect();
        all.push((with_tools, ThinkingEffort::High));
        for (text, effort) in &all {
            let want = enc.parse(text, *effort);
            let thinking = *effort != ThinkingEffort::Off;
            for cut in 0..=text.len() {
                for cut2 in [cut, (cut + 3).min(text.len()), (cut + 11).min(text.len())] {
                    let got = stream(text, thinking, &[cut, cut2]);
                    assert_eq!(got.reasoning, want.reasoning, "reasoning of {text:?} cut at {cut}/{cut2}");
                    assert_eq!(got.content, want.content, "answer of {text:?} cut at {cut}/{cut2}");
                }
            }
        }
    }

    #[test]
    fn text_is_released_as_soon_as_it_cannot_be_a_marker() {
        let mut s = ReplySplitter::new(true);
        assert_eq!(s.push("abc<|clo").reasoning, "abc");
        assert_eq!(s.push("se|>x").reasoning, "<|close|>x");
        assert_eq!(s.push("<|close|>think<|sep|>").reasoning, "");
        assert_eq!(s.push("answer").content, "answer");
    }

    /// k3-nano's tokens plus `<think>` and `</think>` (as Kimi K2-Thinking's and K2.5's vocabularies have them).
    fn k2_think_encoder() -> ChatEncoder {
        let ranks: HashMap<Vec<u8>, u32> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
        let cfg = serde_json::json!({"added_tokens_decoder": {
            "256": {"content": "<|im_user|>"}, "257": {"content": "<|im_assistant|>"},
            "258": {"content": "<|im_middle|>"}, "259": {"content": "<|im_end|>"},
            "260": {"content": "<|tool_calls_section_begin|>"}, "261": {"content": "<|tool_calls_section_end|>"},
            "262": {"content": "<think>"}, "263": {"content": "</think>"}
        }});
        let tok = Tokenizer::Tiktoken(TiktokenTokenizer::from_ranks(ranks, &cfg, KIMI_PATTERN).unwrap());
        ChatEncoder::new(&tok, None, None, None).unwrap()
    }

    #[test]
    fn k2_think_blocks_stream_as_mlx_lm_splits_them() {
        // mlx-lm 0.32.2's splits of hand-written replies (scripts/make_k2_reasoning_fixtures.py), from either
        // initial state; the reply fed whole, in every cut into three pieces, and character by character.
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlx-k3/tests/fixtures/chat/k2_reasoning.json");
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(k2_think_encoder().splits_think_tags() && !k2_encoder().splits_think_tags());
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 20);
        for case in cases {
            let text = case["reply"].as_str().unwrap();
            let initial = case["initial"].as_str().unwrap() == "reasoning";
            let want = Delta {
                reasoning: case["streamed"]["reasoning"].as_str().unwrap().to_string(),
                content: case["streamed"]["content"].as_str().unwrap().to_string(),
            };
            let run = |pieces: &[&str]| {
                let mut s = ReplySplitter::new(initial).with_think_tags(true);
                let mut all = Delta::default();
                for p in pieces {
                    let d = s.push(p);
                    all.reasoning += &d.reasoning;
                    all.content += &d.content;
                }
                let d = s.finish();
                all.reasoning += &d.reasoning;
                all.content += &d.content;
                all
            };
            let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            let chars: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            assert_eq!(run(&chars), want, "{text:?} ({}) char by char", case["initial"]);
            for &a in &bounds {
                for &b in bounds.iter().filter(|&&b| b >= a).step_by(3) {
                    assert_eq!(run(&[&text[..a], &text[a..b], &text[b..]]), want, "{text:?} cut at {a}/{b}");
                }
            }
            // The final parse (the server's non-streamed reply) from the initial state the engine uses.
            if !initial {
                let got = k2_think_encoder().parse(text, ThinkingEffort::Auto);
                assert_eq!(got.reasoning, case["whole"]["reasoning"].as_str().unwrap(), "{text:?}");
                assert_eq!(got.content, case["whole"]["content"].as_str().unwrap(), "{text:?}");
                assert_eq!(got.tool_calls.len(), case["whole"]["tool_calls"].as_array().unwrap().len(), "{text:?}");
            }
        }
    }
}
