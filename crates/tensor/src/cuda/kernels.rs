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

/// The full source of `module` (prelude first), or `None` for an unknown name.
pub fn source(module: &str) -> Option<String> {
    SOURCES
        .iter()
        .find(|(name, _)| *name == module)
        .map(|(_, src)| format!("{PRELUDE}\n#line 1 \"{module}.cu\"\n{src}"))
}
