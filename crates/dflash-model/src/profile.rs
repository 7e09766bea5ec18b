//! Wall time per phase of a loop, through `tracing` spans, for finding where the time goes on a
//! device whose kernels run asynchronously.
//!
//! Code marks a phase with a span of target [`PHASE`]:
//! `let _p = tracing::info_span!(target: "phase", "backward").entered();`. Nothing is
//! recorded unless the binary installs [`PhaseLayer`] (the CLI does when `DFLASH_PROFILE` is
//! set); then the layer synchronises the device named by [`sync_on`] when a phase span is
//! entered and exited, so a phase's time includes its kernels (the loop runs slower: these
//! numbers are for attribution, not for benchmarks), and [`report`] lists the totals.
//!
//! Example: spans "target features", "drafter layers", "backward" around a training step's
//! parts give "target features 31%, drafter layers 24%, backward 45%" in [`report`].

use std::sync::Mutex;
use std::time::Instant;

use candle_core::Device;
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` target of phase spans.
pub const PHASE: &str = "phase";

/// (phase, seconds, count), in first-seen order.
static TOTALS: Mutex<Vec<(&'static str, f64, usize)>> = Mutex::new(Vec::new());
/// The device synchronised at the edges of a phase.
static SYNC: Mutex<Option<Device>> = Mutex::new(None);

/// Synchronise `device` at the edges of every phase from now on (the device a command runs
/// on; the CPU needs none).
pub fn sync_on(device: &Device) {
    *SYNC.lock().unwrap_or_else(|e| e.into_inner()) = (!device.is_cpu()).then(|| device.clone());
}

/// Whether `DFLASH_PROFILE` asks for phase times.
pub fn requested() -> bool {
    dflash_core::env::PROFILE.is_set()
}

fn synchronize() {
    if let Some(d) = SYNC.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        let _ = d.synchronize();
    }
}

/// The layer that times phase spans (the time between entering and leaving, summed over
/// visits). A phase inside another phase is part of the outer one's time and is not counted
/// again (e.g. the target features of validation rows count as "validation").
pub struct PhaseLayer;

/// The span `id` when it is a phase that no outer phase contains.
fn outer_phase<'a, S: Subscriber + for<'l> LookupSpan<'l>>(
    id: &Id,
    ctx: &'a Context<'_, S>,
) -> Option<tracing_subscriber::registry::SpanRef<'a, S>> {
    let span = ctx.span(id)?;
    let phase = |s: &tracing_subscriber::registry::SpanRef<'_, S>| s.metadata().target() == PHASE;
    (phase(&span) && !span.scope().skip(1).any(|s| phase(&s))).then_some(span)
}

struct Entered(Instant);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for PhaseLayer {
    fn on_new_span(&self, _: &Attributes<'_>, _: &Id, _: Context<'_, S>) {}

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = outer_phase(id, &ctx) {
            synchronize();
            span.extensions_mut().replace(Entered(Instant::now()));
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = outer_phase(id, &ctx) else {
            return;
        };
        let Some(Entered(t0)) = span.extensions_mut().remove::<Entered>() else {
            return;
        };
        synchronize();
        let dt = t0.elapsed().as_secs_f64();
        let name = span.metadata().name();
        let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
        match totals.iter_mut().find(|(p, _, _)| *p == name) {
            Some(t) => {
                t.1 += dt;
                t.2 += 1;
            }
            None => totals.push((name, dt, 1)),
        }
    }
}

/// One line per phase recorded so far: total seconds, share, count and mean milliseconds
/// (empty when nothing was recorded); the totals start again from zero.
pub fn report() -> String {
    let totals = std::mem::take(&mut *TOTALS.lock().unwrap_or_else(|e| e.into_inner()));
    let total: f64 = totals.iter().map(|t| t.1).sum();
    totals
        .iter()
        .map(|(p, secs, n)| {
            format!(
                "{p:<20} {secs:>9.3} s {:>5.1}%  {n:>7} × {:>9.3} ms\n",
                100.0 * secs / total.max(1e-12),
                1e3 * secs / *n as f64
            )
        })
        .collect()
}

/// Print [`report`] under `title` when phases were recorded.
pub fn print_report(title: &str) {
    let r = report();
    if !r.is_empty() {
        eprintln!("{title}, time per phase:\n{r}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn phases_accumulate_in_first_seen_order() {
        let sub = tracing_subscriber::registry().with(PhaseLayer);
        tracing::subscriber::with_default(sub, || {
            for name in ["a", "b", "a"] {
                let _p = match name {
                    "a" => tracing::info_span!(target: "phase", "a").entered(),
                    _ => tracing::info_span!(target: "phase", "b").entered(),
                };
            }
            // spans of other targets are not phases, phases inside phases count as the outer
            let _other = tracing::info_span!("not a phase").entered();
            let _outer = tracing::info_span!(target: "phase", "b").entered();
            let _inner = tracing::info_span!(target: "phase", "a").entered();
        });
        let r = report();
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines.len(), 2, "{r}");
        assert!(lines[0].starts_with('a') && lines[0].contains("2 ×"), "{r}");
        assert!(lines[1].starts_with('b') && lines[1].contains("2 ×"), "{r}");
        // the report drains the totals; nothing is recorded without the layer
        assert!(report().is_empty());
        let _p = tracing::info_span!(target: "phase", "c").entered();
        drop(_p);
        assert!(report().is_empty());
    }
}
