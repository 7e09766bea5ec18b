//! A response's text as its tokens arrive: what can be sent now, and where a stop string ends
//! it.
//!
//! Text is sent once it is final: not while the decoded text ends in an incomplete UTF-8
//! sequence (the tokenizer's U+FFFD), nor its last characters while they could begin a stop
//! string. Example, stop `"\n\n"`: tokens decoding to `"Hi\n"` send `"Hi"` and hold `"\n"`;
//! the next token `"\nBye"` completes the stop string: the response ends with `"Hi"`, reason
//! `stop`.

/// The text of one response so far.
pub struct TextStream {
    stop: Vec<String>,
    ids: Vec<u32>,
    /// Bytes of the decoded text already sent.
    sent: usize,
    /// The text ended at a stop string.
    pub stopped: bool,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        TextStream {
            stop,
            ids: Vec::new(),
            sent: 0,
            stopped: false,
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Add `tokens` (decoded by `decode` from all ids so far); the text that is final now.
    pub fn push(
        &mut self,
        tokens: &[u32],
        decode: impl Fn(&[u32]) -> anyhow::Result<String>,
    ) -> anyhow::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(tokens);
        let text = decode(&self.ids)?;
        // a stop string anywhere in the unsent text (it may begin in the held-back part)
        let from = floor_char(&text, self.sent.saturating_sub(self.longest_stop()));
        if let Some(at) = self
            .stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            self.stopped = true;
            let out = text.get(self.sent..at).unwrap_or("").to_string();
            self.sent = at.max(self.sent);
            return Ok(out);
        }
        let mut end = text.len();
        if text.ends_with('\u{FFFD}') {
            end = text.trim_end_matches('\u{FFFD}').len();
        }
        end = end.min(self.hold_back(&text[..end]));
        if end <= self.sent {
            return Ok(String::new());
        }
        let out = text[self.sent..end].to_string();
        self.sent = end;
        Ok(out)
    }

    /// Whatever is still held back, at the end of the response.
    pub fn finish(
        &mut self,
        decode: impl Fn(&[u32]) -> anyhow::Result<String>,
    ) -> anyhow::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let text = decode(&self.ids)?;
        let out = text.get(self.sent..).unwrap_or("").to_string();
        self.sent = text.len();
        Ok(out)
    }

    fn longest_stop(&self) -> usize {
        self.stop.iter().map(String::len).max().unwrap_or(0)
    }

    /// Where `text` may be sent up to: before a suffix that is a proper prefix of a stop
    /// string.
    fn hold_back(&self, text: &str) -> usize {
        let mut end = text.len();
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    end = end.min(text.len() - k);
                    break;
                }
            }
        }
        end
    }
}

/// The largest char boundary of `s` at or before `i`.
fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy tokenizer: token i is the i-th piece.
    fn pieces(p: &'static [&'static str]) -> impl Fn(&[u32]) -> anyhow::Result<String> {
        move |ids| Ok(ids.iter().map(|&i| p[i as usize]).collect())
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it() {
        let d = pieces(&["Hi", "\n", "\nBye"]);
        let mut t = TextStream::new(vec!["\n\n".into()]);
        assert_eq!(t.push(&[0], &d).unwrap(), "Hi");
        assert_eq!(t.push(&[1], &d).unwrap(), "");
        assert_eq!(t.push(&[2], &d).unwrap(), "");
        assert!(t.stopped);
        assert_eq!(t.finish(&d).unwrap(), "");
    }

    #[test]
    fn held_text_is_sent_when_it_is_not_a_stop() {
        let d = pieces(&["a", "\n", "b"]);
        let mut t = TextStream::new(vec!["\n\n".into()]);
        let mut out = t.push(&[0, 1], &d).unwrap();
        assert_eq!(out, "a");
        out += &t.push(&[2], &d).unwrap();
        out += &t.finish(&d).unwrap();
        assert_eq!(out, "a\nb");
        assert!(!t.stopped);
    }

    #[test]
    fn an_incomplete_character_waits_for_its_bytes() {
        let d = pieces(&["x", "\u{FFFD}", "é"]);
        let mut t = TextStream::new(vec![]);
        assert_eq!(t.push(&[0, 1], &d).unwrap(), "x");
        // the toy's second piece stands for half a character: the whole one replaces it
        let whole = |ids: &[u32]| -> anyhow::Result<String> {
            Ok(match ids.len() {
                3 => "xé".to_string(),
                _ => unreachable!(),
            })
        };
        assert_eq!(t.push(&[2], whole).unwrap(), "é");
    }
}
