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

/// Query rows a warp of the head-≤64 tensor-core attention forward and dQ kernels owns
/// (kernels/attention_tc.cu and attention_tc_bwd.cu, `XT_ATTN_K4_MTILES`), in m-tiles of 16:
/// 1, or 2 — FlashAttention-2's layout, 32 rows a warp, each K and V fragment read from shared
/// memory serving two m-tiles' products (half the shared-memory reads per FLOP, at 230–240
/// registers a thread against 161–166 and 8 warps an SM against 12). A block of 4 warps owns
/// `64 · ATTN_K4_MTILES` query rows; the launchers size their grids by the same constant,
/// which [`source`] hands the kernels as a `#define`, so the two cannot disagree. 1 is what has
/// been measured so far (docs/GPU.md); the GPU check's `tune` section measures 2 against it.
pub const ATTN_K4_MTILES: usize = 1;

/// The full source of `module` (prelude first, then its shared header if it has one), or
/// `None` for an unknown name; `#line` marks keep the compiler's messages on each file's lines.
pub fn source(module: &str) -> Option<String> {
    source_with(module, ATTN_K4_MTILES)
}

/// [`source`] with the head-≤64 forward's and dQ's m-tiles a warp `k4_mtiles` in place of
/// [`ATTN_K4_MTILES`] (the compile check builds both choices).
pub fn source_with(module: &str, k4_mtiles: usize) -> Option<String> {
    let (_, src) = SOURCES.iter().find(|(name, _)| *name == module)?;
    let header = HEADERS
        .iter()
        .find(|(m, _)| *m == module)
        .map(|(_, (file, text))| format!("#line 1 \"{file}\"\n{text}\n"))
        .unwrap_or_default();
    Some(format!(
        "#define XT_ATTN_K4_MTILES {k4_mtiles}\n#line 1 \"prelude.cuh\"\n{PRELUDE}\n{header}#line 1 \"{module}.cu\"\n{src}"
    ))
}
