// Fused MoE router for MLX's fast::metal_kernel (body of the generated kernel): one threadgroup per row of
// logits. Template constants: T (logits/weights dtype), E experts, EP = next power of two >= E, K = top_k,
// NG / KG = n_group / topk_group, RENORM, HAS_BIAS, HAS_MASK, THREADS (threadgroup size).
// Inputs: logits [rows, E] T, bias [E] f32 (or a dummy), mask [E] bool (or a dummy), params = [scale].
// Outputs: inds [rows, K] uint32, weights [rows, K] T, prot [rows, K] bool.
// The k indices come out sorted by (score desc, index asc), as MLX's GPU argpartition (a full sort) gives.
uint row = threadgroup_position_in_grid.x;
uint tid = thread_position_in_threadgroup.x;
threadgroup float sig[EP];
threadgroup float sel[EP];
threadgroup ulong keys[EP];
threadgroup float gsum[NG > 1 ? NG : 1];
threadgroup int gdrop[NG > 1 ? NG : 1];
auto x = logits + row * E;
for (uint i = tid; i < uint(E); i += THREADS) {
  float l = static_cast<float>(x[i]);
  float y = 1.0f / (1.0f + metal::exp(metal::abs(l)));
  float s = l < 0.0f ? y : 1.0f - y;
  sig[i] = s;
  sel[i] = HAS_BIAS ? s + bias[i] : s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (NG > 1) {
  constexpr int G = E / (NG > 1 ? NG : 1);
  for (uint g = tid; g < uint(NG); g += THREADS) {
    float a = sel[g * G], b = sel[g * G + 1];
    if (metal::isnan(b) || (!metal::isnan(a) && b > a)) {
      float t = a;
      a = b;
      b = t;
    }
    for (int i = 2; i < G; ++i) {
      float v = sel[g * G + i];
      bool gt_a = !metal::isnan(a) && (metal::isnan(v) || v > a);
      bool gt_b = !metal::isnan(b) && (metal::isnan(v) || v > b);
      if (gt_a) {
        b = a;
        a = v;
      } else if (gt_b) {
        b = v;
      }
    }
    gsum[g] = b + a;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint g = tid; g < uint(NG); g += THREADS) {
    float v = gsum[g];
    int rank = 0;
    for (uint h = 0; h < uint(NG); ++h) {
      float u = gsum[h];
      bool less = metal::isnan(u) ? false : (metal::isnan(v) ? true : (u < v || (u == v && h < g)));
      rank += less ? 1 : 0;
    }
    gdrop[g] = rank < NG - KG;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < uint(E); i += THREADS) {
    if (gdrop[i / G]) sel[i] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (uint i = tid; i < uint(EP); i += THREADS) {
  ulong key = ~0ul;
  if (i < uint(E)) {
    float v = -sel[i];
    uint u;
    if (metal::isnan(v)) {
      u = 0xffffffffu;
    } else {
      if (v == 0.0f) v = 0.0f;
      u = as_type<uint>(v);
      u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    key = (ulong(u) << 32) | ulong(i);
  }
  keys[i] = key;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint size = 2; size <= uint(EP); size <<= 1) {
  for (uint stride = size >> 1; stride > 0; stride >>= 1) {
    for (uint t = tid; t < uint(EP) / 2; t += THREADS) {
      uint lo = 2 * t - (t & (stride - 1));
      uint hi = lo + stride;
      bool asc = (lo & size) == 0;
      ulong a = keys[lo], b = keys[hi];
      if ((a > b) == asc) {
        keys[lo] = b;
        keys[hi] = a;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
if (tid == 0) {
  float sum = 0.0f;
  for (int j = 0; j < K; ++j) sum += sig[uint(keys[j])];
  float denom = sum + 1e-20f;
  for (int j = 0; j < K; ++j) {
    uint idx = uint(keys[j]);
    float w = sig[idx];
    if (K > 1 && RENORM) w = w / denom;
    w = w * params[0];
    uint o = row * K + j;
    inds[o] = idx;
    weights[o] = static_cast<T>(w);
    prot[o] = HAS_MASK ? bool(mask[idx]) : false;
  }
}
