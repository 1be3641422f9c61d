// Packed-weight matmul over an expert stack, y[p, m] = x[lhs[p], m] @ W[rhs[p]]^T, for MLX's fast::metal_kernel
// (the body of a generated [[kernel]] function): the Metal branch of codebook_qmm (one pair, expert 0),
// gather_codebook_qmm and gather_tiered_qmm (cpp/qmm.cpp builds the launch). Inputs, output, formats and the
// NaN rule for out-of-range pairs are packed_qmm.cu's (read its header); the decoding is the same arithmetic.
//
// Layout of the work, in the way of MLX's quantized GEMV (qmv): a threadgroup of SIMDGROUPS simdgroups of 32
// threads; simdgroup j of threadgroup t.x computes the COLS output columns n0 = (t.x * SIMDGROUPS + j) * COLS ...
// n0 + COLS - 1 of output row r = p * M + m, for r = t.y, t.y + threadgroups_per_grid.y, ... (the host caps the
// grid's y as for CUDA). Lane l takes the 8-weight groups g = l, l + 32, ... of K: it reads x's 8 values of the
// group once and decodes the group of each of its COLS weight rows; simd_sum adds the lanes' partial sums. A
// row's format depends only on r and a column's validity only on n0, so every lane of a simdgroup takes the
// same branches and meets every simd_sum.
//
// Pointers into the inputs are `auto`: MLX passes an input of fewer than 8 elements (an absent tier's
// placeholder, a short index list) in the constant address space, others in device memory, so a spelled-out
// address space would not compile for every call. The affine codes are read as 32-bit words for the same reason.
const uint lane = thread_index_in_simdgroup;
const int n0 = int((threadgroup_position_in_grid.x * SIMDGROUPS + simdgroup_index_in_threadgroup) * COLS);
const int M = dims[0];
const int N = dims[1];
const int K = dims[2];
const uint E = uint(dims[3]);
const uint Bx = uint(dims[4]);
const uint P = uint(dims[5]);
const uint stack_size[3] = {uint(dims[6]), uint(dims[7]), uint(dims[8])};
const int groups = K / 8;
const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
const uint rows = P * uint(M);
for (uint r = threadgroup_position_in_grid.y; r < rows; r += threadgroups_per_grid.y) {
  const uint p = r / uint(M);
  const uint m = r % uint(M);
  const uint e = rhs[p];
  const uint b = lhs[p];
  // kind: 0 codebook, 1 mxfp4, 2 affine, -1 nothing valid (an absent tier's stack size is 0).
  int kind = -1;
  uint s = e;
  if (e < E && b < Bx) {
    const uint t = TIERED ? uint(tier[e]) : 0u;
    s = TIERED ? slot[e] : e;
    if (t < 3u && s < stack_size[t]) {
      kind = int(t);
    }
  }
  float acc[COLS];
  for (int c = 0; c < COLS; ++c) {
    acc[c] = 0.0f;
  }
  if (kind >= 0) {
    auto xr = x + (ulong(b) * ulong(M) + m) * ulong(K);
    for (int g = int(lane); g < groups; g += 32) {
      float xv[8];
      float sx = 0.0f;
      for (int j = 0; j < 8; ++j) {
        xv[j] = xr[8 * g + j];
        sx += xv[j];
      }
      for (int c = 0; c < COLS && n0 + c < N; ++c) {
        const ulong row = ulong(s) * ulong(N) + ulong(n0 + c);  // weight row n, within its tier's stack
        if (kind == 0) {
          const uint h = cb_qh[row * ulong(K / 32) + ulong(g >> 2)];
          const uint idx = uint(cb_codes[row * ulong(groups) + ulong(g)]) | (((h >> (3 * (g & 3))) & 7u) << 8);
          const float dl = float(cb_scales[row * ulong((K + 255) / 256) + ulong(g >> 5)]) * float(2 * ((h >> 12) & 7u) + 1);
          const float delta = (h & 0x8000u) ? -0.125f : 0.125f;
          const uint lo = grid[2 * idx];
          const uint hi = grid[2 * idx + 1];
          float sum = 0.0f;
          for (int j = 0; j < 8; ++j) {
            const uint word = j < 4 ? lo : hi;
            const int v = as_type<int>(word << (24 - 8 * (j & 3))) >> 24;  // byte j & 3, sign-extended
            sum += float(v) * xv[j];
          }
          acc[c] += dl * (sum + delta * sx);
        } else if (kind == 1) {
          const uint word = fp4_w[row * ulong(groups) + ulong(g)];
          // E8M0: 2^(e - 127); 0 is 2^-127 (a subnormal), 0xff NaN, as MLX decodes them.
          const uint ex = uint(fp4_scales[row * ulong(K / 32) + ulong(g >> 2)]);
          const float scale = ex == 0xffu ? as_type<float>(0x7fc00000u)
                              : ex == 0u  ? as_type<float>(0x00400000u)
                                          : as_type<float>(ex << 23);
          float sum = 0.0f;
          for (int j = 0; j < 8; ++j) {
            const uint code = (word >> (4 * j)) & 15u;
            const float v = (code & 8u) ? -e2m1[code & 7u] : e2m1[code & 7u];
            sum += v * xv[j];
          }
          acc[c] += scale * sum;
        } else {
          // MLX's LSB-first bitstream: row n starts at word n * K * AFF_BITS / 32; code j of group g at bit
          // 8 * AFF_BITS * g + AFF_BITS * j of it, possibly straddling two words.
          const uint mask = (1u << AFF_BITS) - 1u;
          const ulong base = row * (ulong(K) * ulong(AFF_BITS) / 32);
          float sum = 0.0f;
          for (int j = 0; j < 8; ++j) {
            const uint bit = uint(8 * AFF_BITS * g + AFF_BITS * j);
            const uint sh = bit & 31u;
            uint v = aff_w[base + ulong(bit >> 5)] >> sh;
            if (sh + uint(AFF_BITS) > 32u) {
              v |= aff_w[base + ulong(bit >> 5) + 1] << (32u - sh);
            }
            sum += float(v & mask) * xv[j];
          }
          const ulong q = row * ulong(K / AFF_GROUP) + ulong((8 * g) / AFF_GROUP);
          acc[c] += float(aff_scales[q]) * sum + float(aff_biases[q]) * sx;
        }
      }
    }
  }
  for (int c = 0; c < COLS; ++c) {
    const float total = simd_sum(acc[c]);
    if (lane == 0 && n0 + c < N) {
      out[ulong(r) * ulong(N) + ulong(n0 + c)] = kind < 0 ? as_type<float>(0x7fc00000u) : total;
    }
  }
}
