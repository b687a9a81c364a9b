//! The console of a training run (rank 0): a progress bar with the step counter, loss (and
//! the latest validation loss), learning rate, tokens/s and MFU averaged since the bar
//! started, and the process's peak resident memory.
//!
//! The bar draws on stderr only when stderr is a terminal; otherwise (logs, CI, tests) it is
//! hidden and [`Console`] prints a step line about 50 times per run instead.
use parallel::memory::{human, peak_rss_bytes};
use std::time::Instant;

/// One finished step as the bar shows it.
#[derive(Clone, Copy, Debug)]
pub struct StepStatus {
    /// Steps done (1-based).
    pub step: usize,
    pub loss: f64,
    /// Validation loss measured at this step, if any.
    pub val_loss: Option<f64>,
    pub lr: f64,
    /// Tokens of the (global) batch of this step.
    pub tokens: usize,
}

/// Throughput since the bar started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub tokens_per_s: f64,
    /// Model FLOP/s over the peak (`flops_per_token · tokens_per_s / peak`).
    pub mfu: f64,
}

/// Progress bar over the steps of a run.
pub struct StepBar {
    bar: indicatif::ProgressBar,
    /// Model FLOPs per token (6N + 12·L·H·S) and the peak FLOP/s the MFU divides by.
    flops_per_token: f64,
    peak: f64,
    started: Instant,
    tokens: u64,
    last_val: Option<f64>,
}

impl StepBar {
    /// A bar for steps `start..total`; `quiet` hides it whatever stderr is.
    pub fn new(total: usize, start: usize, quiet: bool, flops_per_token: f64, peak: f64) -> Self {
        let bar = if quiet {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(total as u64)
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .expect("valid template"),
        );
        bar.set_position(start as u64);
        StepBar {
            bar,
            flops_per_token,
            peak,
            started: Instant::now(),
            tokens: 0,
            last_val: None,
        }
    }

    /// Whether the bar is drawn (stderr is a terminal and not quiet).
    pub fn visible(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Records a finished step, redraws the bar and returns the throughput so far.
    pub fn update(&mut self, s: &StepStatus) -> Rate {
        self.tokens += s.tokens as u64;
        self.last_val = s.val_loss.or(self.last_val);
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let tokens_per_s = self.tokens as f64 / secs;
        let rate = Rate {
            tokens_per_s,
            // NaN where the peak is unknown (a GPU missing from the data-sheet table).
            mfu: if self.peak > 0.0 {
                tokens_per_s * self.flops_per_token / self.peak
            } else {
                f64::NAN
            },
        };
        if self.visible() {
            self.bar.set_message(format!(
                "loss {:.4}{} lr {:.2e} {:.0} tok/s MFU {} rss {}",
                s.loss,
                self.last_val
                    .map(|v| format!(" val {v:.4}"))
                    .unwrap_or_default(),
                s.lr,
                rate.tokens_per_s,
                mfu_percent(rate.mfu),
                peak_rss_bytes().map(human).unwrap_or_else(|| "?".into())
            ));
            self.bar.set_position(s.step as u64);
        }
        rate
    }

    /// Prints a line: above the bar when it is drawn, on stdout otherwise.
    pub fn println(&self, msg: &str) {
        if self.visible() {
            self.bar.println(msg);
        } else {
            println!("{msg}");
        }
    }

    /// Leaves the finished bar on the terminal.
    pub fn finish(&self) {
        self.bar.finish();
    }
}

/// Rank 0's console during the step loop: the progress bar when stderr is a terminal;
/// otherwise a line per step for about 50 steps of the run (and the first and last),
/// `step N | loss L | lr … | grad norm … | … ms | … tok/s | MFU …%` followed by the caller's
/// detail. Quiet: neither.
pub struct Console {
    bar: StepBar,
    first: usize,
    total: usize,
    quiet: bool,
}

impl Console {
    /// For steps `first..total`; MFU is `flops_per_token · tokens/s / peak`.
    pub fn new(first: usize, total: usize, quiet: bool, flops_per_token: f64, peak: f64) -> Self {
        Console {
            bar: StepBar::new(total, first, quiet, flops_per_token, peak),
            first,
            total,
            quiet,
        }
    }

    /// Reports finished step `s.step` (counted from 1) with its gradient norm and time;
    /// `detail` (built only for printed lines) ends the line.
    pub fn step(
        &mut self,
        s: &StepStatus,
        grad_norm: f64,
        step_ms: f64,
        detail: impl FnOnce() -> String,
    ) {
        let rate = self.bar.update(s);
        let every = (self.total / 50).max(1);
        let done = s.step;
        let line = done == self.first + 1 || done.is_multiple_of(every) || done == self.total;
        if !self.quiet && !self.bar.visible() && line {
            println!(
                "step {done:>5} | loss {:.4} | lr {:.2e} | grad norm {grad_norm:.3} | {step_ms:.1} ms | {:.0} tok/s | MFU {}{}",
                s.loss,
                s.lr,
                rate.tokens_per_s,
                mfu_percent(rate.mfu),
                detail()
            );
        }
        if let Some(v) = s.val_loss {
            self.println(&format!("validation loss {v:.4} after step {done}"));
        }
    }

    /// Prints a message line (above the bar when it is drawn; nothing when quiet).
    pub fn println(&self, msg: &str) {
        if !self.quiet {
            self.bar.println(msg);
        }
    }

    /// Leaves the finished bar on the terminal.
    pub fn finish(&self) {
        self.bar.finish();
    }
}

/// A model-FLOP utilisation as a percentage, or `n/a` where the device's peak is not known
/// (a GPU missing from `DeviceInfo::bf16_peak_flops`'s table).
pub(crate) fn mfu_percent(mfu: f64) -> String {
    if mfu.is_finite() {
        format!("{:.1}%", 100.0 * mfu)
    } else {
        "n/a (this GPU's peak is not known)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mfu_of_an_unknown_peak_says_so() {
        assert_eq!(mfu_percent(0.2771), "27.7%");
        assert_eq!(mfu_percent(f64::NAN), "n/a (this GPU's peak is not known)");
    }

    #[test]
    fn rate_counts_every_step_and_mfu_divides_by_the_peak() {
        let mut bar = StepBar::new(10, 0, true, 2.0, 4.0);
        assert!(!bar.visible());
        let s = StepStatus {
            step: 1,
            loss: 1.0,
            val_loss: None,
            lr: 1e-3,
            tokens: 1000,
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        let r1 = bar.update(&s);
        let r2 = bar.update(&StepStatus { step: 2, ..s });
        // 1000 tokens in at least 20 ms.
        assert!(r1.tokens_per_s > 0.0 && r1.tokens_per_s <= 50_000.0);
        // Twice the tokens in hardly more time (microseconds after ≥ 20 ms).
        assert!(r2.tokens_per_s > 1.5 * r1.tokens_per_s);
        assert!((r2.mfu - r2.tokens_per_s * 2.0 / 4.0).abs() < 1e-9 * r2.mfu.max(1.0));
    }
}
