//! Process-wide on/off settings of the own SGEMM for A/B measurements (the thread schedule,
//! the kernel loop): on by default, off when an environment variable says so, or as last set
//! from code. Both settings of every switch give the same bits.

use std::sync::atomic::{AtomicU8, Ordering};

/// One setting: the environment is read on first use unless code has set it before.
pub(super) struct EnvSwitch {
    /// 0 = not chosen yet, 1 = off, 2 = on.
    state: AtomicU8,
    /// The variable, and the value of it that turns the setting off.
    var: &'static str,
    off_value: &'static str,
}

impl EnvSwitch {
    pub(super) const fn new(var: &'static str, off_value: &'static str) -> EnvSwitch {
        EnvSwitch {
            state: AtomicU8::new(0),
            var,
            off_value,
        }
    }

    pub(super) fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    pub(super) fn get(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = std::env::var(self.var).as_deref() != Ok(self.off_value);
                self.set(on);
                on
            }
            s => s == 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_unless_the_variable_or_code_turns_it_off() {
        // PATH is set and never equal to this value: the default, on.
        let sw = EnvSwitch::new("PATH", "xtrain-no-such-value");
        assert!(sw.get());
        sw.set(false);
        assert!(!sw.get());
        sw.set(true);
        assert!(sw.get());
        // The variable's off value turns it off (PATH's own value stands in for one).
        let path = std::env::var("PATH").unwrap_or_default();
        let off = EnvSwitch::new("PATH", Box::leak(path.into_boxed_str()));
        assert!(!off.get());
    }
}
