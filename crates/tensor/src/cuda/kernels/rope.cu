// Rotary embedding, HF rotate-half (`tensor::rope`): for each head vector with halves x1, x2
// and the token's (cos, sin) row: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin. The table is
// built on the host with the CPU's formula (so the angles are the same bits); `sin` already
// carries the sign (-1 for the backward, a rotation by -a).
//
// x: [tokens, heads, d], table: [rows, d] = (cos[d/2], sin[d/2]) per row, row[t]: the table row
// of token t. One thread per (token, head, i < d/2).
extern "C" __global__ void rope_rotate(float* x, const float* table, const int* row, int tokens,
                                       int heads, int d) {
    int half = d >> 1;
    long long n = (long long)tokens * heads * half;
    XT_FOR(idx, n) {
        int i = (int)(idx % half);
        long long th = idx / half;      // token * heads + head
        int t = (int)(th / heads);
        const float* cs = table + (long long)row[t] * d;
        float c = cs[i], s = cs[half + i];
        float* h = x + th * d;
        float a = h[i], b = h[half + i];
        h[i] = a * c - b * s;
        h[half + i] = b * c + a * s;
    }
}
