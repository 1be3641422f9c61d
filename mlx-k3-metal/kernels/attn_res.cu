// Attention-residual mix for MLX's fast::cuda_kernel (body of the generated __global__ function; see
// cpp/attn_res.cpp for the math). One block of THREADS per token, so the token count N is the grid's block
// count rather than a template constant: one compiled kernel serves every prompt length. Template constants:
// T (activation dtype), K snapshots, D hidden size, THREADS. Inputs: raw [K, N, D] (T), inv_rms [K, N] f32,
// partial [N, D] (T), w_eff [D] f32, params = [eps]. Output: out [N, D] (T). Not yet run on a GPU.
const int n = blockIdx.x;
const size_t N = gridDim.x;
const int tid = threadIdx.x;
float acc[K + 2];
for (int i = 0; i < K + 2; ++i) acc[i] = 0.0f;
const T* p = partial + static_cast<size_t>(n) * D;
for (int d = tid; d < D; d += THREADS) {
  const float w = w_eff[d];
  const float pv = static_cast<float>(p[d]);
  for (int k = 0; k < K; ++k) acc[k] += static_cast<float>(raw[(static_cast<size_t>(k) * N + n) * D + d]) * w;
  acc[K] += pv * w;
  acc[K + 1] += pv * pv;
}
__shared__ float part[K + 2][THREADS];
for (int i = 0; i < K + 2; ++i) part[i][tid] = acc[i];
__syncthreads();
for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
  if (tid < stride) {
    for (int i = 0; i < K + 2; ++i) part[i][tid] += part[i][tid + stride];
  }
  __syncthreads();
}
__shared__ float pi[K + 1];
if (tid == 0) {
  float logits[K + 1];
  for (int k = 0; k < K; ++k) logits[k] = part[k][0] * inv_rms[static_cast<size_t>(k) * N + n];
  logits[K] = part[K][0] * rsqrtf(part[K + 1][0] / D + params[0]);
  float m = logits[0];
  for (int k = 1; k <= K; ++k) m = fmaxf(m, logits[k]);
  float denom = 0.0f;
  for (int k = 0; k <= K; ++k) {
    logits[k] = expf(logits[k] - m);
    denom += logits[k];
  }
  for (int k = 0; k <= K; ++k) pi[k] = logits[k] / denom;
}
__syncthreads();
for (int d = tid; d < D; d += THREADS) {
  float o = 0.0f;
  for (int k = 0; k < K; ++k) o += pi[k] * static_cast<float>(raw[(static_cast<size_t>(k) * N + n) * D + d]);
  out[static_cast<size_t>(n) * D + d] = static_cast<T>(o + pi[K] * static_cast<float>(p[d]));
}
