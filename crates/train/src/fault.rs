//! Fault injection for tests of failure handling: `XTRAIN_FAULT=<action>:<rank>@<step>` makes
//! world rank `<rank>` kill (`kill`, SIGKILL) or stop (`stop`, SIGSTOP) its own process right
//! after finishing optimizer step `<step>` (metrics row and any checkpoint of that step
//! written). It acts in the first generation of a launched group only (`XTRAIN_RESTART_COUNT`
//! unset or 0), so a group the launcher restarts runs through. Unset, it costs one check per
//! step; a malformed value is an error at start, never ignored.
use crate::error::{Result, TrainError};

/// The variable read by [`Fault::from_env`].
pub const FAULT_VAR: &str = "XTRAIN_FAULT";

/// What the injected fault does to the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL: the process dies at once (a crash, an OOM kill).
    Kill,
    /// SIGSTOP: the process stays but runs nothing (a hung or suspended host).
    Stop,
}

/// A fault armed for one rank and step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub action: Action,
    pub rank: usize,
    pub step: usize,
}

impl Fault {
    /// Parses `<kill|stop>:<rank>@<step>`.
    pub fn parse(s: &str) -> Result<Fault> {
        let bad = || {
            TrainError::Config(format!(
                "{FAULT_VAR}={s:?}: expected <kill|stop>:<rank>@<step>, e.g. kill:1@3"
            ))
        };
        let (action, rest) = s.split_once(':').ok_or_else(bad)?;
        let (rank, step) = rest.split_once('@').ok_or_else(bad)?;
        let action = match action {
            "kill" => Action::Kill,
            "stop" => Action::Stop,
            _ => return Err(bad()),
        };
        Ok(Fault {
            action,
            rank: rank.trim().parse().map_err(|_| bad())?,
            step: step.trim().parse().map_err(|_| bad())?,
        })
    }

    /// The fault armed by the environment for this process, if any (none in a restarted
    /// generation).
    pub fn from_env() -> Result<Option<Fault>> {
        let Some(v) = std::env::var(FAULT_VAR).ok().filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let fault = Fault::parse(&v)?;
        let restarted = std::env::var(comm::env::RESTART_VAR).is_ok_and(|r| r.trim() != "0");
        Ok((!restarted).then_some(fault))
    }

    /// Delivers the fault if it is armed for `rank` at `step`.
    pub fn at_step_end(&self, rank: usize, step: usize) {
        if rank != self.rank || step != self.step {
            return;
        }
        let (sig, name) = match self.action {
            Action::Kill => (libc::SIGKILL, "SIGKILL"),
            Action::Stop => (libc::SIGSTOP, "SIGSTOP"),
        };
        eprintln!("{FAULT_VAR}: rank {rank} sends itself {name} after step {step}");
        // SAFETY: raise(3) signals this process; it has no memory effects.
        unsafe {
            libc::raise(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_form_and_rejects_others() {
        assert_eq!(
            Fault::parse("kill:1@3").unwrap(),
            Fault {
                action: Action::Kill,
                rank: 1,
                step: 3
            }
        );
        assert_eq!(Fault::parse("stop:0@12").unwrap().action, Action::Stop);
        for bad in ["kill", "kill:1", "crash:1@3", "kill:x@3", "kill:1@"] {
            let e = Fault::parse(bad).unwrap_err().to_string();
            assert!(e.contains("expected <kill|stop>"), "{bad}: {e}");
        }
    }
}
