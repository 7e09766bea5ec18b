//! `/metrics`: Prometheus text under vLLM's metric names (a dashboard made for vLLM reads
//! them): requests, prompt and generation tokens, time to first token and inter-token latency
//! histograms, and the speculative counters — drafts, drafted tokens, accepted tokens and
//! accepted tokens per draft position.
//!
//! Example: one request whose single round drafted 4 tokens and kept 2 adds 1 to
//! `vllm:spec_decode_num_drafts`, 4 to `..._num_draft_tokens`, 2 to
//! `..._num_accepted_tokens`, and 1 to `..._num_accepted_tokens_per_pos{position="0"}` and
//! `{position="1"}`.

use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency buckets.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, x: f64, n: u64) {
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if x <= b {
                *c += n;
            }
        }
        self.count += n;
        self.sum += x * n as f64;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default)]
struct Counts {
    /// Requests by outcome: finished (stop, length), refused (4xx), shed (503), failed.
    finished_stop: u64,
    finished_length: u64,
    finished_abort: u64,
    refused: u64,
    shed: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    drafts: u64,
    draft_tokens: u64,
    accepted_tokens: u64,
    accepted_per_pos: Vec<u64>,
    /// Steps or rounds of the running batch: AR steps, and rounds that drafted.
    batch_ar: u64,
    batch_draft: u64,
    ttft: Histogram,
    itl: Histogram,
    running: usize,
    waiting: usize,
}

/// The server's counters (shared by the scheduler and the handlers).
#[derive(Default)]
pub struct Metrics(Mutex<Counts>);

/// How a request ended, for the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Stop,
    Length,
    /// The client went away, or the request failed while decoding.
    Abort,
    /// Refused with a 4xx.
    Refused,
    /// Refused with a 503: the queue was full.
    Shed,
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Counts)) {
        // a panic elsewhere never poisons counters worth stopping for
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut c)
    }

    pub fn request(&self, o: Outcome) {
        self.with(|c| match o {
            Outcome::Stop => c.finished_stop += 1,
            Outcome::Length => c.finished_length += 1,
            Outcome::Abort => c.finished_abort += 1,
            Outcome::Refused => c.refused += 1,
            Outcome::Shed => c.shed += 1,
        })
    }

    pub fn prompt(&self, tokens: usize) {
        self.with(|c| c.prompt_tokens += tokens as u64)
    }

    /// `n` tokens reached a client `secs` after the previous ones (or after arrival, when
    /// `first`): each counts `secs / n` of inter-token latency.
    pub fn tokens(&self, n: usize, secs: f64, first: bool) {
        if n == 0 {
            return;
        }
        self.with(|c| {
            c.generation_tokens += n as u64;
            if first {
                c.ttft.observe(secs, 1);
                if n > 1 {
                    c.itl.observe(0.0, n as u64 - 1);
                }
            } else {
                c.itl.observe(secs / n as f64, n as u64);
            }
        })
    }

    /// A round of drafting: `drafted` tokens offered, the first `accepted` kept.
    pub fn draft(&self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.with(|c| {
            c.drafts += 1;
            c.draft_tokens += drafted as u64;
            c.accepted_tokens += accepted as u64;
            if c.accepted_per_pos.len() < accepted {
                c.accepted_per_pos.resize(accepted, 0);
            }
            for p in &mut c.accepted_per_pos[..accepted] {
                *p += 1;
            }
        })
    }

    /// A step or round of the running batch (several requests), drafted or not.
    pub fn batch_round(&self, drafted: bool) {
        self.with(|c| match drafted {
            true => c.batch_draft += 1,
            false => c.batch_ar += 1,
        })
    }

    pub fn queue(&self, running: usize, waiting: usize) {
        self.with(|c| {
            c.running = running;
            c.waiting = waiting;
        })
    }

    /// The Prometheus text.
    pub fn render(&self, model: &str) -> String {
        let mut out = String::new();
        self.with(|c| {
            let l = format!("model_name=\"{}\"", model.replace('"', "'"));
            let mut counter = |name: &str, help: &str, rows: &[(String, u64)]| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
                for (labels, v) in rows {
                    let _ = writeln!(out, "{name}{{{l}{labels}}} {v}");
                }
            };
            counter("vllm:request_success_total", "Requests finished, by reason.", &[
                (",finished_reason=\"stop\"".into(), c.finished_stop),
                (",finished_reason=\"length\"".into(), c.finished_length),
                (",finished_reason=\"abort\"".into(), c.finished_abort),
            ]);
            counter("dflash:request_refused_total", "Requests refused: a bad request (4xx) or a full queue (503).", &[
                (",status=\"4xx\"".into(), c.refused),
                (",status=\"503\"".into(), c.shed),
            ]);
            counter("vllm:prompt_tokens_total", "Prompt tokens prefilled.", &[(String::new(), c.prompt_tokens)]);
            counter("vllm:generation_tokens_total", "Tokens generated.", &[(String::new(), c.generation_tokens)]);
            counter("vllm:spec_decode_num_drafts", "Rounds that drafted.", &[(String::new(), c.drafts)]);
            counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", &[(String::new(), c.draft_tokens)]);
            counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.", &[(String::new(), c.accepted_tokens)]);
            counter("dflash:batch_rounds_total", "Forwards of the running batch: AR steps, and rounds whose slots drafted.", &[
                (",kind=\"ar\"".into(), c.batch_ar),
                (",kind=\"draft\"".into(), c.batch_draft),
            ]);
            let per_pos: Vec<(String, u64)> = c
                .accepted_per_pos
                .iter()
                .enumerate()
                .map(|(i, &v)| (format!(",position=\"{i}\""), v))
                .collect();
            counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each position of a round's path.", &per_pos);
            let _ = writeln!(out, "# HELP vllm:num_requests_running Requests decoding.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{l}}} {}", c.running);
            let _ = writeln!(out, "# HELP vllm:num_requests_waiting Requests queued.\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{l}}} {}", c.waiting);
            c.ttft.write(&mut out, "vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token.");
            c.itl.write(&mut out, "vllm:inter_token_latency_seconds", "Time between a request's tokens.");
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_doc_example_counts() {
        let m = Metrics::default();
        m.draft(4, 2);
        m.draft(0, 0);
        let t = m.render("m");
        for line in [
            "vllm:spec_decode_num_drafts{model_name=\"m\"} 1",
            "vllm:spec_decode_num_draft_tokens{model_name=\"m\"} 4",
            "vllm:spec_decode_num_accepted_tokens{model_name=\"m\"} 2",
            "vllm:spec_decode_num_accepted_tokens_per_pos{model_name=\"m\",position=\"0\"} 1",
            "vllm:spec_decode_num_accepted_tokens_per_pos{model_name=\"m\",position=\"1\"} 1",
        ] {
            assert!(t.lines().any(|l| l == line), "{line} not in\n{t}");
        }
    }

    #[test]
    fn a_round_of_three_tokens_is_one_ttft_and_two_zero_gaps() {
        let m = Metrics::default();
        m.tokens(3, 0.05, true);
        m.tokens(2, 0.02, false);
        let t = m.render("m");
        assert!(t.contains("vllm:time_to_first_token_seconds_count 1"));
        assert!(t.contains("vllm:inter_token_latency_seconds_count 4"));
        assert!(t.contains("vllm:inter_token_latency_seconds_bucket{le=\"0.01\"} 4"));
        assert!(t.contains("vllm:generation_tokens_total{model_name=\"m\"} 5"));
    }
}
