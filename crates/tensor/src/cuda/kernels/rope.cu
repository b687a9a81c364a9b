// Rotary embedding, HF rotate-half (`tensor::rope`): for each head vector with halves x1, x2
// and the token's (cos, sin) row: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin. The table is
// built on the host with the CPU's formula (so the angles are the same bits); `sin` already
// carries the sign (-1 for the backward, a rotation by -a).
//
// x: [tokens, heads, d], table: [rows, d] = (cos[d/2], sin[d/2]) per row, row[t]: the table row
// of token t. A warp per (token, head) row, its lanes over the pairs i < d/2 (no division per
// element: XT_FOR_ROWS in the prelude says why; tokens * heads < 2^31, which the launcher
// checks, so the one per row is 32-bit); `y` writes the rotated pair (in place in `x` for
// `rope_rotate`; rounded into a 16-bit copy for the products or attention that read it next
// for `rope_rotate_bf16` / `_f16`: a thread reads its pair before writing it).
template <typename Out>
__device__ __forceinline__ void rope_apply(const float* x, Out y, const float* table,
                                           const int* row, int tokens, int heads, int d) {
    const int half = d >> 1, lane = threadIdx.x & 31;
    const long long rows = (long long)tokens * heads; // token * heads + head
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long th = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; th < rows;
         th += warps) {
        const float* cs = table + (long long)row[(int)th / heads] * d;
        const long long at = th * d;
        for (int i = lane; i < half; i += 32) {
            const float c = cs[i], s = cs[half + i];
            const float a = x[at + i], b = x[at + half + i];
            y(at + i, a * c - b * s);
            y(at + half + i, b * c + a * s);
        }
    }
}

extern "C" __global__ void rope_rotate(float* x, const float* table, const int* row, int tokens,
                                       int heads, int d) {
    rope_apply(x, XtOutF32{x}, table, row, tokens, heads, d);
}

extern "C" __global__ void rope_rotate_bf16(const float* x, u16* y, const float* table,
                                            const int* row, int tokens, int heads, int d) {
    rope_apply(x, XtOutBf16{y}, table, row, tokens, heads, d);
}

extern "C" __global__ void rope_rotate_f16(const float* x, u16* y, const float* table,
                                           const int* row, int tokens, int heads, int d) {
    rope_apply(x, XtOutF16{y}, table, row, tokens, heads, d);
}
