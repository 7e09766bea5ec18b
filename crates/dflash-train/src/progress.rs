//! Progress for long work: a bar on a terminal, and plain lines when stderr is a file or a
//! pipe (a GPU lease's log, CI), about twenty per run, so a log shows how far a run got.
//! Example (not a terminal, 400 prompts): "data generate: 20/400 prompts, 1.2 tok/s" … every 20.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: ProgressBar,
    label: &'static str,
    unit: &'static str,
    len: u64,
    pos: u64,
    /// Plain lines (stderr is not a terminal): one every `every` steps.
    every: Option<u64>,
}

impl Progress {
    /// `label`: what runs ("train"); `unit`: what is counted ("steps").
    pub fn new(len: usize, label: &'static str, unit: &'static str) -> Self {
        let plain = !std::io::stderr().is_terminal();
        let bar = if plain {
            ProgressBar::hidden()
        } else {
            let b = ProgressBar::new(len as u64);
            b.set_style(
                ProgressStyle::with_template(&format!(
                    "{{bar:30}} {{pos}}/{{len}} {unit} [{{elapsed_precise}} < {{eta_precise}}] {{msg}}"
                ))
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        };
        Self {
            bar,
            label,
            unit,
            len: len as u64,
            pos: 0,
            every: plain.then(|| (len as u64 / 20).max(1)),
        }
    }

    pub fn set_position(&mut self, pos: usize) {
        self.pos = pos as u64;
        self.bar.set_position(self.pos);
    }

    /// Advance by `n` with a status message.
    pub fn inc(&mut self, n: usize, msg: impl Into<String>) {
        let before = self.pos;
        self.pos += n as u64;
        let msg = msg.into();
        if let Some(every) = self.every {
            if before / every != self.pos / every || self.pos == self.len {
                eprintln!(
                    "{}: {}/{} {}, {msg}",
                    self.label, self.pos, self.len, self.unit
                );
            }
        }
        self.bar.set_position(self.pos);
        self.bar.set_message(msg);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
