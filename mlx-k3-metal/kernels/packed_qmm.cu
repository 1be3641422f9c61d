// Packed-weight matmul over an expert stack, y[p, m] = x[lhs[p], m] @ W[rhs[p]]^T, for MLX's fast::cuda_kernel
// (the body of a generated __global__ function): the GPU branch of codebook_qmm (one pair, expert 0),
// gather_codebook_qmm and gather_tiered_qmm (cpp/qmm.cpp builds the launch).
//
// One block of THREADS threads per output column n = blockIdx.x and output row r = p * M + m, for
// r = blockIdx.y, blockIdx.y + gridDim.y, ... (the host caps the grid's y at CUDA's 65535). Each thread takes
// the 8-weight groups g = tid, tid + THREADS, ... of row n of the pair's expert, decodes them as the CPU paths
// decode (cpp/qmm_cpu.cpp; layouts in mlx-k3/src/codebook.rs and MLX's quantize), and the block sums the
// partial dot products in shared memory. The format of a row depends only on r, so every thread of a block
// takes the same branch and meets the same barriers.
//
// Inputs: x [Bx * M, K] f32; lhs, rhs [P] u32 (the broadcast index pairs); tier [E] u8 and slot [E] u32 (read
// when TIERED; else expert e is slot e of the codebook stack); the codebook stack cb_codes [n_cb, N, K/8] u8,
// cb_qh [n_cb, N, K/32] u16, cb_scales [n_cb, N, ceil(K/256)] f16 and grid [4096] u32 (llama.cpp's 2048 IQ1_S
// entries, entry i = words 2i, 2i + 1, byte j = value j as int8); the MXFP4 stack fp4_w [n_fp4, N, K/8] u32
// (8 E2M1 codes a word, low nibble first) and fp4_scales [n_fp4, N, K/32] u8 (E8M0); the affine stack aff_w
// [n_aff, N, K * AFF_BITS / 32] u32 (MLX's LSB-first bitstream), aff_scales and aff_biases
// [n_aff, N, K / AFF_GROUP] ST; dims = [M, N, K, E, Bx, P, n_cb, n_fp4, n_aff] i32. Absent stacks are one-element
// placeholders with a stack size of 0. Output: out [P * M, N] f32. A pair whose indices are out of range, or whose
// expert's tier or slot the stack does not hold, gets NaN (a kernel cannot raise; the CPU path raises, and the
// loader validates the tier tables, mlx-k3/src/tiers.rs). THREADS is a power of two.
__shared__ float part[THREADS];
const int tid = threadIdx.x;
const int n = blockIdx.x;
const int M = dims[0];
const int N = dims[1];
const int K = dims[2];
const unsigned int E = static_cast<unsigned int>(dims[3]);
const unsigned int Bx = static_cast<unsigned int>(dims[4]);
const int P = dims[5];
const unsigned int stack_size[3] = {static_cast<unsigned int>(dims[6]), static_cast<unsigned int>(dims[7]),
                                    static_cast<unsigned int>(dims[8])};
const int groups = K / 8;
const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
const long long rows = static_cast<long long>(P) * M;
for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
  const int p = static_cast<int>(r / M);
  const int m = static_cast<int>(r % M);
  const unsigned int e = rhs[p];
  const unsigned int b = lhs[p];
  // kind: 0 codebook, 1 mxfp4, 2 affine, -1 nothing valid (an absent tier's stack size is 0).
  int kind = -1;
  unsigned int s = e;
  if (e < E && b < Bx) {
    const int t = TIERED ? tier[e] : 0;
    s = TIERED ? slot[e] : e;
    if (t < 3 && s < stack_size[t]) {
      kind = t;
    }
  }
  const size_t row = static_cast<size_t>(s) * N + n;  // weight row n of the expert, within its tier's stack
  const float* xr = x + (static_cast<size_t>(b) * M + m) * K;
  float acc = 0.0f;
  if (kind == 0) {
    const int sb = (K + 255) / 256;
    const uint8_t* cr = cb_codes + row * groups;
    const uint16_t* hr = cb_qh + row * (K / 32);
    for (int g = tid; g < groups; g += THREADS) {
      const unsigned int h = hr[g >> 2];
      const unsigned int idx = cr[g] | (((h >> (3 * (g & 3))) & 7u) << 8);
      const float dl = static_cast<float>(cb_scales[row * sb + (g >> 5)]) * static_cast<float>(2 * ((h >> 12) & 7u) + 1);
      const float delta = (h & 0x8000u) ? -0.125f : 0.125f;
      const unsigned int lo = grid[2 * idx];
      const unsigned int hi = grid[2 * idx + 1];
      const float* xv = xr + 8 * g;
      float sum = 0.0f;
      float sx = 0.0f;
      for (int j = 0; j < 8; ++j) {
        const unsigned int word = j < 4 ? lo : hi;
        const int v = static_cast<int>(static_cast<signed char>((word >> (8 * (j & 3))) & 0xffu));
        sum += static_cast<float>(v) * xv[j];
        sx += xv[j];
      }
      acc += dl * (sum + delta * sx);
    }
  } else if (kind == 1) {
    const uint32_t* wr = fp4_w + row * groups;
    const uint8_t* sr = fp4_scales + row * (K / 32);
    for (int g = tid; g < groups; g += THREADS) {
      const unsigned int word = wr[g];
      // E8M0: 2^(e - 127); 0 is 2^-127 (a subnormal), 0xff NaN, as MLX decodes them.
      const unsigned int ex = sr[g >> 2];
      const float scale = ex == 0xffu ? __uint_as_float(0x7fc00000u)
                          : ex == 0u  ? __uint_as_float(0x00400000u)
                                      : __uint_as_float(ex << 23);
      const float* xv = xr + 8 * g;
      float sum = 0.0f;
      for (int j = 0; j < 8; ++j) {
        const unsigned int c = (word >> (4 * j)) & 15u;
        const float v = (c & 8u) ? -e2m1[c & 7u] : e2m1[c & 7u];
        sum += v * xv[j];
      }
      acc += scale * sum;
    }
  } else if (kind == 2) {
    constexpr unsigned int mask = (1u << AFF_BITS) - 1u;
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(aff_w) + row * (static_cast<size_t>(K) * AFF_BITS / 8);
    const ST* scr = aff_scales + row * (K / AFF_GROUP);
    const ST* bir = aff_biases + row * (K / AFF_GROUP);
    for (int g = tid; g < groups; g += THREADS) {
      const uint8_t* c = wr + static_cast<size_t>(g) * AFF_BITS;  // 8 codes take AFF_BITS bytes
      const float* xv = xr + 8 * g;
      float sum = 0.0f;
      float sx = 0.0f;
      for (int j = 0; j < 8; ++j) {
        const int bit = AFF_BITS * j;
        unsigned int v = c[bit >> 3];
        if ((bit & 7) + AFF_BITS > 8) {
          v |= static_cast<unsigned int>(c[(bit >> 3) + 1]) << 8;
        }
        sum += static_cast<float>((v >> (bit & 7)) & mask) * xv[j];
        sx += xv[j];
      }
      const int q = (8 * g) / AFF_GROUP;
      acc += static_cast<float>(scr[q]) * sum + static_cast<float>(bir[q]) * sx;
    }
  }
  part[tid] = acc;
  __syncthreads();
  for (int w = THREADS / 2; w > 0; w >>= 1) {
    if (tid < w) {
      part[tid] += part[tid + w];
    }
    __syncthreads();
  }
  // Only thread 0 reads part[0] here and only it writes part[0] next: no barrier needed before the next row.
  if (tid == 0) {
    out[static_cast<size_t>(r) * N + n] = kind < 0 ? __uint_as_float(0x7fc00000u) : part[0];
  }
}
