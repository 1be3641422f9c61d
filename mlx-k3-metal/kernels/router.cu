// Fused MoE router for MLX's fast::cuda_kernel (body of the generated __global__ function): one block per
// row of logits. Template constants: T (logits/weights dtype), E experts, EP = next power of two >= E,
// K = top_k, NG / KG = n_group / topk_group, RENORM, HAS_BIAS, HAS_MASK, THREADS (block size).
// Inputs: logits [rows, E] T, bias [E] f32 (or a dummy), mask [E] bool (or a dummy), params = [scale].
// Outputs: inds [rows, K] uint32, weights [rows, K] T, prot [rows, K] bool.
// The k indices come out sorted by (score desc, index asc), as MLX's GPU argpartition (a full sort) gives.
const int row = blockIdx.x;
const int tid = threadIdx.x;
__shared__ float sig[EP];
__shared__ float sel[EP];
__shared__ unsigned long long keys[EP];
__shared__ float gsum[NG > 1 ? NG : 1];
__shared__ int gdrop[NG > 1 ? NG : 1];
const T* x = logits + static_cast<size_t>(row) * E;
for (int i = tid; i < E; i += THREADS) {
  float l = static_cast<float>(x[i]);
  float y = 1.0f / (1.0f + expf(fabsf(l)));
  float s = l < 0.0f ? y : 1.0f - y;
  sig[i] = s;
  sel[i] = HAS_BIAS ? s + bias[i] : s;
}
__syncthreads();
if (NG > 1) {
  constexpr int G = E / (NG > 1 ? NG : 1);
  // Group score: sum of the two largest selection scores (NaN counts as largest).
  for (int g = tid; g < NG; g += THREADS) {
    float a = sel[g * G], b = sel[g * G + 1];
    if (isnan(b) || (!isnan(a) && b > a)) {
      float t = a; a = b; b = t;
    }
    for (int i = 2; i < G; ++i) {
      float v = sel[g * G + i];
      bool gt_a = !isnan(a) && (isnan(v) || v > a);
      bool gt_b = !isnan(b) && (isnan(v) || v > b);
      if (gt_a) { b = a; a = v; } else if (gt_b) { b = v; }
    }
    gsum[g] = b + a;
  }
  __syncthreads();
  // Drop the NG - KG lowest groups, ordered by (score, index) with NaN last (MLX's argpartition order).
  for (int g = tid; g < NG; g += THREADS) {
    float v = gsum[g];
    int rank = 0;
    for (int h = 0; h < NG; ++h) {
      float u = gsum[h];
      bool less = isnan(u) ? false : (isnan(v) ? true : (u < v || (u == v && h < g)));
      rank += less ? 1 : 0;
    }
    gdrop[g] = rank < NG - KG;
  }
  __syncthreads();
  for (int i = tid; i < E; i += THREADS) {
    if (gdrop[i / G]) sel[i] = 0.0f;
  }
  __syncthreads();
}
// Keys ordered like (-score, index): NaN last, -0 == +0, padding after everything.
for (int i = tid; i < EP; i += THREADS) {
  unsigned long long key = ~0ull;
  if (i < E) {
    float v = -sel[i];
    unsigned int u;
    if (isnan(v)) {
      u = 0xffffffffu;
    } else {
      if (v == 0.0f) v = 0.0f;
      u = __float_as_uint(v);
      u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    key = (static_cast<unsigned long long>(u) << 32) | static_cast<unsigned int>(i);
  }
  keys[i] = key;
}
__syncthreads();
// Bitonic sort, ascending.
for (int size = 2; size <= EP; size <<= 1) {
  for (int stride = size >> 1; stride > 0; stride >>= 1) {
    for (int t = tid; t < EP / 2; t += THREADS) {
      int lo = 2 * t - (t & (stride - 1));
      int hi = lo + stride;
      bool asc = (lo & size) == 0;
      unsigned long long a = keys[lo], b = keys[hi];
      if ((a > b) == asc) {
        keys[lo] = b;
        keys[hi] = a;
      }
    }
    __syncthreads();
  }
}
if (tid == 0) {
  float sum = 0.0f;
  for (int j = 0; j < K; ++j) sum += sig[static_cast<unsigned int>(keys[j])];
  float denom = sum + 1e-20f;
  for (int j = 0; j < K; ++j) {
    unsigned int idx = static_cast<unsigned int>(keys[j]);
    float w = sig[idx];
    if (K > 1 && RENORM) w = w / denom;
    w = w * params[0];
    size_t o = static_cast<size_t>(row) * K + j;
    inds[o] = idx;
    weights[o] = static_cast<T>(w);
    prot[o] = HAS_MASK ? mask[idx] : false;
  }
}
