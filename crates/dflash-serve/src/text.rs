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
    /// The text of `ids[..read]`, decoded a window at a time: decoding every token again at
    /// each step would cost the square of the response's length.
    text: String,
    /// The window: `ids[prefix..read]` decode to the end of `text`; tokens after `read` are not
    /// in it yet. A window starts where the text was whole (no cut character), so that
    /// decoding it alone gives what decoding everything would (as TGI's and vLLM's
    /// incremental detokenizers do).
    prefix: usize,
    read: usize,
    /// Bytes of `text` already sent.
    sent: usize,
    /// The text ended at a stop string.
    pub stopped: bool,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        TextStream {
            stop,
            ids: Vec::new(),
            text: String::new(),
            prefix: 0,
            read: 0,
            sent: 0,
            stopped: false,
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The new text of the window, once it ends in a whole character (or `force`).
    fn advance(
        &mut self,
        decode: &impl Fn(&[u32]) -> anyhow::Result<String>,
        force: bool,
    ) -> anyhow::Result<()> {
        let before = decode(&self.ids[self.prefix..self.read])?;
        let now = decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && (force || !now.ends_with('\u{FFFD}')) {
            self.text.push_str(now.get(before.len()..).unwrap_or(""));
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(())
    }

    /// Add `tokens` (`decode` turns ids into text); the text that is final now.
    pub fn push(
        &mut self,
        tokens: &[u32],
        decode: impl Fn(&[u32]) -> anyhow::Result<String>,
    ) -> anyhow::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(tokens);
        self.advance(&decode, false)?;
        Ok(self.release(false))
    }

    /// Whatever is still held back, at the end of the response.
    pub fn finish(
        &mut self,
        decode: impl Fn(&[u32]) -> anyhow::Result<String>,
    ) -> anyhow::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.advance(&decode, true)?;
        Ok(self.release(true))
    }

    /// The text after `sent` that is final: up to a stop string (which ends the response), or
    /// (unless `all`) before a tail that could begin one.
    fn release(&mut self, all: bool) -> String {
        let text = &self.text;
        // a stop string anywhere in the unsent text (it may begin in the held-back part)
        let from = floor_char(text, self.sent.saturating_sub(self.longest_stop()));
        if let Some(at) = self
            .stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            self.stopped = true;
            let out = text.get(self.sent..at).unwrap_or("").to_string();
            self.sent = at.max(self.sent);
            return out;
        }
        let end = match all {
            true => text.len(),
            false => self.hold_back(text),
        };
        if end <= self.sent {
            return String::new();
        }
        let out = text[self.sent..end].to_string();
        self.sent = end;
        out
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
        // token 1 is the first byte of "é", token 2 its second: alone, each decodes to U+FFFD
        let d = |ids: &[u32]| -> anyhow::Result<String> {
            let mut out = String::new();
            let mut i = 0;
            while i < ids.len() {
                match (ids[i], ids.get(i + 1)) {
                    (0, _) => out.push('x'),
                    (1, Some(2)) => {
                        out.push('é');
                        i += 1;
                    }
                    _ => out.push('\u{FFFD}'),
                }
                i += 1;
            }
            Ok(out)
        };
        let mut t = TextStream::new(vec![]);
        // the window "x" + half a character waits for the character's second byte
        assert_eq!(t.push(&[0, 1], d).unwrap(), "");
        assert_eq!(t.push(&[2], d).unwrap(), "xé");
        assert_eq!(t.push(&[0], d).unwrap(), "x");
        assert_eq!(t.finish(d).unwrap(), "");
    }

    /// A real tokenizer's text streamed token by token is the text of all the tokens.
    #[test]
    fn streamed_text_is_the_whole_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen3-tiny");
        let tk = dflash_model::io::tokenizer::TextTokenizer::from_dir(&dir, &[]).unwrap();
        let ids = tk
            .encode(
                "Héllo wörld — a «test» of 😀 streaming, line\n\nbreaks.",
                false,
            )
            .unwrap();
        let d = |ids: &[u32]| tk.decode(ids);
        let mut t = TextStream::new(vec![]);
        let mut out = String::new();
        for id in &ids {
            out += &t.push(&[*id], d).unwrap();
        }
        out += &t.finish(d).unwrap();
        assert_eq!(out, tk.decode(&ids).unwrap());
    }
}
