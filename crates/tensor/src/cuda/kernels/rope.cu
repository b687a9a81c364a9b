// Rotary embedding, HF rotate-half (`tensor::rope`): for each head vector with halves x1, x2
// and the token's (cos, sin) row: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin. The table is
// built on the host with the CPU's formula (so the angles are the same bits); `sin` already
// carries the sign (-1 for the backward, a rotation by -a).
//
// x: [tokens, heads, d], table: [rows, d] = (cos[d/2], sin[d/2]) per row, row[t]: the table row
// of token t. One thread per (token, head, i < d/2); `y` writes the rotated pair (in place in
// `x` for `rope_rotate`; rounded into a 16-bit copy for the products or attention that read it
// next for `rope_rotate_bf16` / `_f16`: a thread reads its pair before writing it).
template <typename Out>
__device__ __forceinline__ void rope_apply(const float* x, Out y, const float* table,
                                           const int* row, int tokens, int heads, int d) {
    int half = d >> 1;
    long long n = (long long)tokens * heads * half;
    XT_FOR(idx, n) {
        int i = (int)(idx % half);
        long long th = idx / half;      // token * heads + head
        int t = (int)(th / heads);
        const float* cs = table + (long long)row[t] * d;
        float c = cs[i], s = cs[half + i];
        const long long at = th * d;
        float a = x[at + i], b = x[at + half + i];
        y(at + i, a * c - b * s);
        y(at + half + i, b * c + a * s);
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
