//! The kernel modules: CUDA C sources under `kernels/`, each compiled as one NVRTC program with
//! the shared prelude (`kernels/prelude.cuh`: types, bf16/fp16 conversions, warp and block
//! reductions) put in front.

/// `(module, source)` of every kernel module, without the prelude.
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("norm", include_str!("kernels/norm.cu")),
    ("rope", include_str!("kernels/rope.cu")),
    ("embedding", include_str!("kernels/embedding.cu")),
    ("cross_entropy", include_str!("kernels/cross_entropy.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("attention_tc", include_str!("kernels/attention_tc.cu")),
    (
        "attention_tc_bwd",
        include_str!("kernels/attention_tc_bwd.cu"),
    ),
    ("optimizer", include_str!("kernels/optimizer.cu")),
    ("moe", include_str!("kernels/moe.cu")),
];

/// The shared prelude.
pub const PRELUDE: &str = include_str!("kernels/prelude.cuh");

/// The tensor-core helpers of the two attention modules.
const TENSOR_CORE: (&str, &str) = ("tensor_core.cuh", include_str!("kernels/tensor_core.cuh"));

/// `(module, (file, text))`: a header put between the prelude and the modules that share it.
const HEADERS: &[(&str, (&str, &str))] = &[
    ("attention_tc", TENSOR_CORE),
    ("attention_tc_bwd", TENSOR_CORE),
];

/// The full source of `module` (prelude first, then its shared header if it has one), or
/// `None` for an unknown name; `#line` marks keep the compiler's messages on each file's lines.
pub fn source(module: &str) -> Option<String> {
    let (_, src) = SOURCES.iter().find(|(name, _)| *name == module)?;
    let header = HEADERS
        .iter()
        .find(|(m, _)| *m == module)
        .map(|(_, (file, text))| format!("#line 1 \"{file}\"\n{text}\n"))
        .unwrap_or_default();
    Some(format!(
        "#line 1 \"prelude.cuh\"\n{PRELUDE}\n{header}#line 1 \"{module}.cu\"\n{src}"
    ))
}
