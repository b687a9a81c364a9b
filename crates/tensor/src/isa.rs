//! Which vector instruction set the hand-written kernels run on, chosen once per process.
//!
//! Three paths ([`Isa`]): AVX-512 (16-lane `zmm` intrinsics), AVX2 + FMA (8-lane `ymm`
//! intrinsics) and portable Rust (loops the compiler vectorises for the baseline target); the
//! matrix products run on the own SGEMM with the path's micro-kernel ([`crate::sgemm`]).
//! The best path the CPU supports is detected once (`is_x86_feature_detected!`) and cached;
//! the environment variable [`ISA_ENV`] (`XTRAIN_ISA=avx512|avx2|portable`) forces a lower
//! one, so that every path can be run and compared on one machine. Forcing a path the CPU
//! lacks is refused with an error ([`selected`]).
//!
//! Every dispatched kernel's entry point reads [`active`] and calls that path's function; the
//! paths compute the same formulas (see each kernel) and the tests compare each one the
//! machine supports against the portable reference.

use crate::TensorError;
use std::sync::OnceLock;

/// Environment variable that forces a kernel path: `avx512`, `avx2` or `portable`.
pub const ISA_ENV: &str = "XTRAIN_ISA";

/// A kernel path, ordered from the most portable to the widest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, no hand-written vector code.
    Portable,
    /// AVX2 with FMA (x86-64-v3): 8 f32 lanes.
    Avx2,
    /// AVX-512F: 16 f32 lanes, masked loads and stores; the own SGEMM.
    Avx512,
}

impl Isa {
    /// Every path, most portable first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name used by [`ISA_ENV`] and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses a name as written in [`ISA_ENV`] (case-insensitive, surrounding blanks ignored).
    pub fn parse(s: &str) -> Result<Isa, TensorError> {
        let t = s.trim().to_ascii_lowercase();
        Isa::ALL.into_iter().find(|i| i.name() == t).ok_or_else(|| {
            TensorError::Config(format!(
                "{ISA_ENV}={s:?}: expected one of avx512, avx2, portable"
            ))
        })
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The widest path this CPU supports.
    pub fn detected() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.supported())
            .unwrap_or(Isa::Portable)
    }

    /// Every path this CPU supports, most portable first (what the tests run).
    pub fn supported_paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// The path of each dispatched kernel under this ISA, as `(kernel, path)` pairs.
    pub fn kernel_paths(self) -> Vec<(&'static str, &'static str)> {
        let vector = match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "AVX2+FMA",
            Isa::Avx512 => "AVX-512",
        };
        let gemm = crate::sgemm::Kernel::for_isa(self).describe();
        vec![
            ("matmul", gemm),
            ("attention tiles", vector),
            ("exp/softmax", vector),
            ("SwiGLU", vector),
            ("RMSNorm", vector),
            ("RoPE", vector),
            ("cross-entropy", vector),
        ]
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The path a value of [`ISA_ENV`] asks for (`None`: unset or empty, use the detected one),
/// refused when this CPU cannot run it.
pub fn choose(env: Option<&str>) -> Result<Isa, TensorError> {
    let Some(v) = env.filter(|v| !v.trim().is_empty()) else {
        return Ok(Isa::detected());
    };
    let isa = Isa::parse(v)?;
    if !isa.supported() {
        return Err(TensorError::Config(format!(
            "{ISA_ENV}={}: this CPU does not support it (it supports: {})",
            isa.name(),
            Isa::supported_paths()
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(isa)
}

/// The process's kernel path: [`ISA_ENV`] if set, else the detected one; read once. Programs
/// call this at start-up so that a bad value is reported as an error before any kernel runs.
pub fn selected() -> Result<Isa, TensorError> {
    static SELECTED: OnceLock<Result<Isa, TensorError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| choose(std::env::var(ISA_ENV).ok().as_deref()))
        .clone()
}

#[cfg(test)]
thread_local! {
    /// A path forced on this thread by [`with_isa`] (tests of single-threaded kernels).
    static FORCED: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// The path the kernels take now: [`selected`]. A kernel cannot return the error of a bad
/// [`ISA_ENV`], so it stops the program with that message; programs avoid this by calling
/// [`selected`] first.
#[inline]
pub fn active() -> Isa {
    #[cfg(test)]
    if let Some(isa) = FORCED.with(|f| f.get()) {
        return isa;
    }
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| selected().unwrap_or_else(|e| panic!("{e}")))
}

/// Runs `f` with the kernels called *on this thread* taking path `isa` (which must be
/// supported); for tests of the single-threaded tile and row kernels.
#[cfg(test)]
pub(crate) fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(isa.supported(), "{isa} is not supported here");
    let before = FORCED.with(|c| c.replace(Some(isa)));
    let r = f();
    FORCED.with(|c| c.set(before));
    r
}

/// The CPU's model name (Linux `/proc/cpuinfo`), for reports.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// One line for reports: the CPU, the detected and the chosen path (and whether it was
/// forced), and each kernel's path.
pub fn describe() -> String {
    let cpu = cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let (detected, chosen) = (Isa::detected(), active());
    let how = if chosen == detected {
        "detected".to_string()
    } else {
        format!("forced by {ISA_ENV}; the CPU has {detected}")
    };
    let paths: Vec<String> = chosen
        .kernel_paths()
        .into_iter()
        .map(|(k, p)| format!("{k} {p}"))
        .collect();
    format!("CPU {cpu}; kernels {chosen} ({how}): {}", paths.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unsupported_paths_are_refused() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()).unwrap(), isa);
            assert_eq!(
                Isa::parse(&format!(" {} ", isa.name().to_uppercase())).unwrap(),
                isa
            );
        }
        let e = Isa::parse("sse9").unwrap_err().to_string();
        assert!(e.contains(ISA_ENV) && e.contains("avx2"), "{e}");
        assert_eq!(choose(None).unwrap(), Isa::detected());
        assert_eq!(choose(Some(" ")).unwrap(), Isa::detected());
        assert_eq!(choose(Some("portable")).unwrap(), Isa::Portable);
        for isa in Isa::ALL {
            match choose(Some(isa.name())) {
                Ok(i) => assert!(i == isa && isa.supported()),
                Err(e) => {
                    assert!(!isa.supported());
                    assert!(e.to_string().contains("does not support"), "{e}");
                }
            }
        }
        assert!(Isa::supported_paths().contains(&Isa::Portable));
        assert!(Isa::supported_paths().contains(&Isa::detected()));
    }

    #[test]
    fn forcing_a_path_on_a_thread_is_scoped() {
        let before = active();
        let inner = with_isa(Isa::Portable, || {
            (active(), std::thread::spawn(active).join().unwrap())
        });
        // Forced on this thread only; other threads keep the process's path.
        assert_eq!(inner, (Isa::Portable, before));
        assert_eq!(active(), before);
        let d = describe();
        assert!(d.contains(before.name()) && d.contains("matmul"), "{d}");
    }

    /// Each lower path this machine supports, forced for a whole process by [`ISA_ENV`] (so
    /// also on the thread pool's workers), passes the tests of every dispatched kernel, which
    /// compare with f64 references and finite differences: this test binary runs again,
    /// filtered to those modules, once per path.
    #[test]
    fn forced_lower_paths_pass_the_kernel_tests() {
        if std::env::var_os(ISA_ENV).is_some() {
            return; // a forced run (or one of the runs below) covers only its own path
        }
        let exe = std::env::current_exe().unwrap();
        let modules = [
            "attention::",
            "activation::",
            "cross_entropy::",
            "gemm::tests::",
            "microkernel::",
            "norm::",
            "peak::",
            "rope::",
            "softmax::",
        ];
        for isa in Isa::supported_paths() {
            if isa == active() {
                continue;
            }
            let out = std::process::Command::new(&exe)
                .env(ISA_ENV, isa.name())
                .arg("--test-threads=2")
                .args(modules)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{ISA_ENV}={isa}:\n{text}");
            let passed: usize = text
                .split("test result: ok. ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            assert!(
                passed >= 20,
                "{ISA_ENV}={isa}: only {passed} tests ran:\n{text}"
            );
        }
    }
}
