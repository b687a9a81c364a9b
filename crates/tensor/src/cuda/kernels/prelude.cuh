// Prelude of every xtrain kernel module (prepended by the loader; NVRTC is given no headers,
// so nothing here includes one). Types, 16-bit conversions done by hand with the rounding the
// CPU path uses (round to nearest even), warp and block reductions in a fixed order.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define XT_WARP 32
#define XT_FULL_MASK 0xffffffffu
#define XT_NEG_INF (__int_as_float(0xff800000))

// bf16 is the upper half of an f32.
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// f32 -> bf16, round to nearest even; NaN stays NaN (quiet), as `half::bf16::from_f32`.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// The PTX of the kernels is in XT_EMU_PTX sections: the CPU emulation of the kernels that the
// tests run without a GPU (crates/tensor/tests/cuda_emu) defines each such function itself.
#ifndef XT_EMU_PTX
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif // XT_EMU_PTX

// Where a kernel writes an fp32 result: as fp32, or rounded to nearest even into the bf16 or
// fp16 operand that products read next (`tensor::operands`: the rounding a cast kernel would
// do afterwards, done by the kernel that computes the value, so the fp32 values are never
// written, read back and cast). The same value goes through the same function either way.
// `st8` stores 8 consecutive results at i (a multiple of 8, the buffer 16-byte aligned), 16
// bytes at a time: two float4, or one uint4 of 16-bit values (the lower-indexed one in the
// lower half of each word).
struct XtOutF32 {
    float* p;
    __device__ __forceinline__ void operator()(long long i, float v) const { p[i] = v; }
    __device__ __forceinline__ void st8(long long i, const float* v) const {
        ((float4*)(p + i))[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4*)(p + i))[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
};
__device__ __forceinline__ void xt_st8_u16(u16* p, const u16* h) {
    *(uint4*)p = make_uint4((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16),
                            (u32)h[4] | ((u32)h[5] << 16), (u32)h[6] | ((u32)h[7] << 16));
}
struct XtOutBf16 {
    u16* p;
    __device__ __forceinline__ void operator()(long long i, float v) const { p[i] = f32_to_bf16(v); }
    __device__ __forceinline__ void st8(long long i, const float* v) const {
        u16 h[8];
#pragma unroll
        for (int k = 0; k < 8; k++) h[k] = f32_to_bf16(v[k]);
        xt_st8_u16(p + i, h);
    }
};
struct XtOutF16 {
    u16* p;
    __device__ __forceinline__ void operator()(long long i, float v) const { p[i] = f32_to_f16(v); }
    __device__ __forceinline__ void st8(long long i, const float* v) const {
        u16 h[8];
#pragma unroll
        for (int k = 0; k < 8; k++) h[k] = f32_to_f16(v[k]);
        xt_st8_u16(p + i, h);
    }
};

// Sum over the warp (butterfly: every lane gets the same bits).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(XT_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(XT_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(XT_FULL_MASK, v, o));
    return v;
}

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory; the block must call it
// together.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Grid-stride loop over `n` elements.
#define XT_FOR(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)blockDim.x * gridDim.x)

// The element kernels over the rows of a matrix take a block a row (XT_FOR_ROWS, grid-stride
// over the rows) and its threads over the row's columns (XT_FOR_COLS), so that no element
// finds its row and column by a division: a 64-bit integer division is a subroutine of
// dozens of instructions on the GPU, which made such kernels compute-bound (the logits'
// gradient divides each of rows x vocabulary elements).
#define XT_FOR_ROWS(r, rows) \
    for (long long r = blockIdx.x; r < (long long)(rows); r += gridDim.x)
#define XT_FOR_COLS(c, cols) for (int c = threadIdx.x; c < (cols); c += blockDim.x)
