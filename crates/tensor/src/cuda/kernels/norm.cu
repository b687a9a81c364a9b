// RMSNorm (`tensor::norm`): y = rstd * (x * w), rstd = 1 / sqrt(mean(x^2) + eps) per row;
// dx = rstd * (dy * w - x * c) (+ residual), c = (sum dy * w * x) * rstd^2 / dim;
// dw += sum_rows dy * x * rstd, in two deterministic passes (row chunks, then their sum in
// chunk order).

// One block per row; `y` writes each output (fp32, or rounded for the products that read it:
// `rmsnorm_forward_bf16` / `_f16`).
template <typename Out>
__device__ __forceinline__ void rmsnorm_forward_row(const float* x, const float* w, Out y,
                                                    float* rstd, int dim, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * dim;
    const float* xr = x + base;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y(base + i, r * (xr[i] * w[i]));
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

extern "C" __global__ void rmsnorm_forward(const float* x, const float* w, float* y,
                                           float* rstd, int dim, float eps) {
    rmsnorm_forward_row(x, w, XtOutF32{y}, rstd, dim, eps);
}

extern "C" __global__ void rmsnorm_forward_bf16(const float* x, const float* w, u16* y,
                                                float* rstd, int dim, float eps) {
    rmsnorm_forward_row(x, w, XtOutBf16{y}, rstd, dim, eps);
}

extern "C" __global__ void rmsnorm_forward_f16(const float* x, const float* w, u16* y,
                                               float* rstd, int dim, float eps) {
    rmsnorm_forward_row(x, w, XtOutF16{y}, rstd, dim, eps);
}

// One block per row; `residual` may be null.
extern "C" __global__ void rmsnorm_backward_input(const float* dy, const float* x,
                                                  const float* w, const float* rstd,
                                                  const float* residual, float* dx, int dim) {
    __shared__ float scratch[32];
    long long base = (long long)blockIdx.x * dim;
    float r = rstd[blockIdx.x];
    float d = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d += dy[base + i] * w[i] * x[base + i];
    d = block_sum(d, scratch);
    float c = d * r * r / (float)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = r * (dy[base + i] * w[i] - x[base + i] * c);
        dx[base + i] = residual ? residual[base + i] + v : v;
    }
}

// Pass 1: partial[chunk][col] = sum over rows chunk*rows_per_chunk.. of dy * x * rstd.
// Grid (ceil(dim / blockDim.x), chunks).
extern "C" __global__ void rmsnorm_dw_partial(const float* dy, const float* x,
                                              const float* rstd, float* partial, int rows,
                                              int dim, int rows_per_chunk) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= dim) return;
    int r0 = blockIdx.y * rows_per_chunk;
    int r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; r++) {
        long long i = (long long)r * dim + col;
        acc += dy[i] * x[i] * rstd[r];
    }
    partial[(long long)blockIdx.y * dim + col] = acc;
}

// Pass 2: dw[col] += sum over chunks (in order) of partial[chunk][col].
extern "C" __global__ void rmsnorm_dw_reduce(const float* partial, float* dw, int chunks,
                                             int dim) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= dim) return;
    float acc = 0.0f;
    for (int c = 0; c < chunks; c++) acc += partial[(long long)c * dim + col];
    dw[col] += acc;
}
