//! Wall time per phase of a loop, for finding where the time goes on a device whose kernels
//! run asynchronously. Off unless `DFLASH_PROFILE` is set: then each [`Phases::mark`]
//! synchronises the device first, so a phase's time includes its kernels (and the loop runs
//! slower; these numbers are for attribution, not for benchmarks).
//!
//! Example: `mark("features")` after the target forward and `mark("backward")` after the
//! backward give "features 31%, backward 45%, …" in [`Phases::report`].

use std::time::Instant;

use candle_core::Device;

pub struct Phases {
    enabled: bool,
    device: Device,
    last: Instant,
    /// (phase, seconds, count), in first-seen order.
    totals: Vec<(&'static str, f64, usize)>,
}

impl Phases {
    pub fn new(device: &Device) -> Self {
        Self::with(std::env::var_os("DFLASH_PROFILE").is_some(), device)
    }

    pub fn with(enabled: bool, device: &Device) -> Self {
        Self {
            enabled,
            device: device.clone(),
            last: Instant::now(),
            totals: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Close the phase that ran since the previous mark (or construction).
    pub fn mark(&mut self, phase: &'static str) {
        if !self.enabled {
            return;
        }
        let _ = self.device.synchronize();
        let now = Instant::now();
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        match self.totals.iter_mut().find(|(p, _, _)| *p == phase) {
            Some(t) => {
                t.1 += dt;
                t.2 += 1;
            }
            None => self.totals.push((phase, dt, 1)),
        }
    }

    /// Restart the clock without charging any phase (e.g. after bookkeeping).
    pub fn skip(&mut self) {
        if self.enabled {
            let _ = self.device.synchronize();
            self.last = Instant::now();
        }
    }

    /// One line per phase: total seconds, share, count and mean milliseconds.
    pub fn report(&self) -> String {
        let total: f64 = self.totals.iter().map(|t| t.1).sum();
        let mut s = String::new();
        for (p, secs, n) in &self.totals {
            s.push_str(&format!(
                "{p:<20} {secs:>9.3} s {:>5.1}%  {n:>7} × {:>9.3} ms\n",
                100.0 * secs / total.max(1e-12),
                1e3 * secs / *n as f64
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_accumulate_in_order() {
        let mut p = Phases::with(true, &Device::Cpu);
        p.mark("a");
        p.mark("b");
        p.mark("a");
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with('a') && lines[0].contains("2 ×"), "{r}");
        assert!(lines[1].starts_with('b') && lines[1].contains("1 ×"), "{r}");
        let off = Phases::with(false, &Device::Cpu);
        assert!(off.report().is_empty());
    }
}
