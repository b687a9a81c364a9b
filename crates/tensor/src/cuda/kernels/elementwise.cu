// Element-wise kernels: storage casts, scaling (loss scaling, clipping), sums, SwiGLU, and the
// non-finite check of fp16 loss scaling. Formulas and operation order as in the CPU kernels
// (`tensor::activation`, `tensor::dtype`).

extern "C" __global__ void cast_f32_bf16(const float* x, u16* y, int n) {
    XT_FOR(i, n) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const u16* x, float* y, int n) {
    XT_FOR(i, n) y[i] = bf16_to_f32(x[i]);
}

extern "C" __global__ void cast_f32_f16(const float* x, u16* y, int n) {
    XT_FOR(i, n) y[i] = f32_to_f16(x[i]);
}

extern "C" __global__ void cast_f16_f32(const u16* x, float* y, int n) {
    XT_FOR(i, n) y[i] = f16_to_f32(x[i]);
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

// s = silu(g) * u, silu(g) = g * sigmoid(g)
extern "C" __global__ void swiglu_forward(const float* g, const float* u, float* s, int n) {
    XT_FOR(i, n) {
        float gi = g[i];
        s[i] = gi * sigmoid(gi) * u[i];
    }
}

// dg = ds * u * silu'(g), du = ds * silu(g); silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
extern "C" __global__ void swiglu_backward(const float* ds, const float* g, const float* u,
                                           float* dg, float* du, int n) {
    XT_FOR(i, n) {
        float gi = g[i], sg = sigmoid(gi), d = ds[i];
        dg[i] = d * u[i] * (sg * (1.0f + gi * (1.0f - sg)));
        du[i] = d * (gi * sg);
    }
}

// count[0] += number of non-finite elements (0 when all are finite).
extern "C" __global__ void count_nonfinite(const float* x, int n, int* count) {
    int local = 0;
    XT_FOR(i, n) local += isfinite(x[i]) ? 0 : 1;
    for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(XT_FULL_MASK, local, o);
    if ((threadIdx.x & 31) == 0 && local) atomicAdd(count, local);
}
