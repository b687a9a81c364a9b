// Element-wise kernels: storage casts, scaling (loss scaling, clipping), sums, SwiGLU, and the
// non-finite check of fp16 loss scaling. Formulas and operation order as in the CPU kernels
// (`tensor::activation`, `tensor::dtype`).

// Storage casts. Where both buffers start 16-byte aligned (whole allocations, and most views)
// a thread converts 8 consecutive elements, reading and writing them 16 bytes at a time (two
// float4 or one uint4): a cast is bandwidth-bound, and one element a thread (a 2-byte store
// each) reached about a quarter of an H200's bandwidth on the 124M's activations. A view at
// another offset takes one element a thread. The launcher sizes the grid by the same test
// (`per_thread` in ops.rs).
__device__ __forceinline__ bool xt_aligned16(const void* a, const void* b,
                                             const void* c = nullptr, const void* d = nullptr) {
    return (((u64)a | (u64)b | (u64)c | (u64)d) & 15u) == 0;
}

__device__ __forceinline__ void xt_ld8(const float* p, float* v) {
    const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void xt_ld8(const u16* p, u16* v) {
    const uint4 a = *(const uint4*)p;
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) v[2 * i] = (u16)(w[i] & 0xffffu), v[2 * i + 1] = (u16)(w[i] >> 16);
}

__device__ __forceinline__ void xt_st8(float* p, const float* v) {
    ((float4*)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4*)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ void xt_st8(u16* p, const u16* v) { xt_st8_u16(p, v); }

struct XtToBf16 {
    __device__ u16 operator()(float f) const { return f32_to_bf16(f); }
};
struct XtFromBf16 {
    __device__ float operator()(u16 h) const { return bf16_to_f32(h); }
};
struct XtToF16 {
    __device__ u16 operator()(float f) const { return f32_to_f16(f); }
};
struct XtFromF16 {
    __device__ float operator()(u16 h) const { return f16_to_f32(h); }
};

template <typename A, typename B, typename F>
__device__ __forceinline__ void xt_cast(const A* x, B* y, int n, F convert) {
    if (xt_aligned16(x, y)) {
        const long long groups = n >> 3;
        XT_FOR(g, groups) {
            A a[8];
            B b[8];
            xt_ld8(x + 8 * g, a);
#pragma unroll
            for (int i = 0; i < 8; i++) b[i] = convert(a[i]);
            xt_st8(y + 8 * g, b);
        }
        XT_FOR(i, n - 8 * groups) y[8 * groups + i] = convert(x[8 * groups + i]);
    } else {
        XT_FOR(i, n) y[i] = convert(x[i]);
    }
}

extern "C" __global__ void cast_f32_bf16(const float* x, u16* y, int n) {
    xt_cast(x, y, n, XtToBf16());
}

extern "C" __global__ void cast_bf16_f32(const u16* x, float* y, int n) {
    xt_cast(x, y, n, XtFromBf16());
}

extern "C" __global__ void cast_f32_f16(const float* x, u16* y, int n) {
    xt_cast(x, y, n, XtToF16());
}

extern "C" __global__ void cast_f16_f32(const u16* x, float* y, int n) {
    xt_cast(x, y, n, XtFromF16());
}

// Rounds f32 values to bf16 and back, in place (weights as a bf16 copy sees them).
extern "C" __global__ void round_bf16(float* x, int n) {
    XT_FOR(i, n) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

extern "C" __global__ void round_f16(float* x, int n) {
    XT_FOR(i, n) x[i] = f16_to_f32(f32_to_f16(x[i]));
}

// x *= s
extern "C" __global__ void scale_f32(float* x, float s, int n) {
    XT_FOR(i, n) x[i] *= s;
}

// y += a * x
extern "C" __global__ void axpy_f32(float* y, const float* x, float a, int n) {
    XT_FOR(i, n) y[i] += a * x[i];
}

// y = a + b
extern "C" __global__ void add_f32(float* y, const float* a, const float* b, int n) {
    XT_FOR(i, n) y[i] = a[i] + b[i];
}

extern "C" __global__ void fill_f32(float* y, float v, int n) {
    XT_FOR(i, n) y[i] = v;
}

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// SwiGLU's kernels take 8 elements a thread where every buffer starts 16-byte aligned (16-byte
// loads and stores, as the casts above; the launcher sizes the grid by the same test,
// `per_thread` in ops.rs), else one; each element's arithmetic is the same either way.

// s = silu(g) * u, silu(g) = g * sigmoid(g); `_bf16` / `_f16` write s rounded for the product
// that reads it.
__device__ __forceinline__ float xt_swiglu(float g, float u) { return g * sigmoid(g) * u; }

template <typename Out>
__device__ __forceinline__ void swiglu_forward_all(const float* g, const float* u, Out s, int n) {
    if (xt_aligned16(g, u, s.p)) {
        const long long groups = n >> 3;
        XT_FOR(k, groups) {
            float a[8], b[8], r[8];
            xt_ld8(g + 8 * k, a);
            xt_ld8(u + 8 * k, b);
#pragma unroll
            for (int e = 0; e < 8; e++) r[e] = xt_swiglu(a[e], b[e]);
            s.st8(8 * k, r);
        }
        XT_FOR(i, n - 8 * groups) {
            const long long j = 8 * groups + i;
            s(j, xt_swiglu(g[j], u[j]));
        }
    } else {
        XT_FOR(i, n) s(i, xt_swiglu(g[i], u[i]));
    }
}

extern "C" __global__ void swiglu_forward(const float* g, const float* u, float* s, int n) {
    swiglu_forward_all(g, u, XtOutF32{s}, n);
}

extern "C" __global__ void swiglu_forward_bf16(const float* g, const float* u, u16* s, int n) {
    swiglu_forward_all(g, u, XtOutBf16{s}, n);
}

extern "C" __global__ void swiglu_forward_f16(const float* g, const float* u, u16* s, int n) {
    swiglu_forward_all(g, u, XtOutF16{s}, n);
}

// dg = ds * u * silu'(g), du = ds * silu(g); silu'(g) = sig(g) * (1 + g * (1 - sig(g)));
// `_bf16` / `_f16` write dg and du rounded for the products that read them.
__device__ __forceinline__ void xt_swiglu_grad(float d, float g, float u, float& dg,
                                               float& du) {
    const float sg = sigmoid(g);
    dg = d * u * (sg * (1.0f + g * (1.0f - sg)));
    du = d * (g * sg);
}

template <typename Out>
__device__ __forceinline__ void swiglu_backward_all(const float* ds, const float* g,
                                                    const float* u, Out dg, Out du, int n) {
    if (xt_aligned16(ds, g, u, dg.p) && xt_aligned16(du.p, nullptr)) {
        const long long groups = n >> 3;
        XT_FOR(k, groups) {
            float d[8], a[8], b[8], rg[8], ru[8];
            xt_ld8(ds + 8 * k, d);
            xt_ld8(g + 8 * k, a);
            xt_ld8(u + 8 * k, b);
#pragma unroll
            for (int e = 0; e < 8; e++) xt_swiglu_grad(d[e], a[e], b[e], rg[e], ru[e]);
            dg.st8(8 * k, rg);
            du.st8(8 * k, ru);
        }
        XT_FOR(i, n - 8 * groups) {
            const long long j = 8 * groups + i;
            float x, y;
            xt_swiglu_grad(ds[j], g[j], u[j], x, y);
            dg(j, x);
            du(j, y);
        }
    } else {
        XT_FOR(i, n) {
            float x, y;
            xt_swiglu_grad(ds[i], g[i], u[i], x, y);
            dg(i, x);
            du(i, y);
        }
    }
}

extern "C" __global__ void swiglu_backward(const float* ds, const float* g, const float* u,
                                           float* dg, float* du, int n) {
    swiglu_backward_all(ds, g, u, XtOutF32{dg}, XtOutF32{du}, n);
}

extern "C" __global__ void swiglu_backward_bf16(const float* ds, const float* g, const float* u,
                                                u16* dg, u16* du, int n) {
    swiglu_backward_all(ds, g, u, XtOutBf16{dg}, XtOutBf16{du}, n);
}

extern "C" __global__ void swiglu_backward_f16(const float* ds, const float* g, const float* u,
                                               u16* dg, u16* du, int n) {
    swiglu_backward_all(ds, g, u, XtOutF16{dg}, XtOutF16{du}, n);
}

// count[0] += number of non-finite elements (0 when all are finite).
extern "C" __global__ void count_nonfinite(const float* x, int n, int* count) {
    int local = 0;
    XT_FOR(i, n) local += isfinite(x[i]) ? 0 : 1;
    for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(XT_FULL_MASK, local, o);
    if ((threadIdx.x & 31) == 0 && local) atomicAdd(count, local);
}
