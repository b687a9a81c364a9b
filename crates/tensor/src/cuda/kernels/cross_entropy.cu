// Softmax cross-entropy row pieces over a vocabulary shard [vocab_start, vocab_start + shard)
// (`tensor::cross_entropy`): per-row max, sum exp(z - max) and target logit; the log-sum-exp;
// the gradient in place, dz = exp(z - lse) * scale - onehot(t) * scale; the loss sum.

// One warp per row; blockDim.x = 32 * rows per block.
extern "C" __global__ void ce_row_stats(const float* logits, const long long* targets, int rows,
                                        int shard, int vocab_start, long long ignore,
                                        float* row_max, float* sumexp, float* target_logit) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* z = logits + (long long)row * shard;
    float m = XT_NEG_INF;
    for (int j = lane; j < shard; j += 32) m = fmaxf(m, z[j]);
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < shard; j += 32) s += expf(z[j] - m);
    s = warp_sum(s);
    if (lane == 0) {
        long long t = targets[row];
        long long j = t - vocab_start;
        row_max[row] = m;
        sumexp[row] = s;
        target_logit[row] = (t != ignore && j >= 0 && j < shard) ? z[j] : 0.0f;
    }
}

// lse = max + log(sumexp) for one shard holding the whole vocabulary (-inf for an empty row).
extern "C" __global__ void ce_lse(const float* row_max, const float* sumexp, float* lse,
                                  int rows) {
    XT_FOR(i, rows) lse[i] = row_max[i] == XT_NEG_INF ? XT_NEG_INF : row_max[i] + logf(sumexp[i]);
}

// In place: dz = exp(z - lse) * scale, minus scale at the target; zero for ignored rows. A
// block a row (XT_FOR_ROWS).
extern "C" __global__ void ce_grad_inplace(float* logits, const long long* targets,
                                           const float* lse, int rows, int shard,
                                           int vocab_start, long long ignore, float scale) {
    XT_FOR_ROWS(row, rows) {
        float* z = logits + row * shard;
        const long long t = targets[row];
        const float l = lse[row];
        XT_FOR_COLS(j, shard) {
            float v = 0.0f;
            if (t != ignore) {
                v = expf(z[j] - l) * scale;
                if (t - vocab_start == j) v -= scale;
            }
            z[j] = v;
        }
    }
}

// out[0] = sum over valid rows of (lse - target_logit), in f64, by one block in a fixed order;
// each row's difference is taken in f32 and then widened, as the CPU does.
extern "C" __global__ void ce_loss_sum(const float* lse, const float* target_logit,
                                       const long long* targets, int rows, long long ignore,
                                       double* out) {
    __shared__ double part[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < rows; i += blockDim.x)
        if (targets[i] != ignore) acc += (double)(lse[i] - target_logit[i]);
    acc = warp_sum_f64(acc);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) out[0] = acc;
    }
}
