// Codebook (IQ1_S bits) matmul y = x @ W^T for MLX's fast::cuda_kernel (the body of a generated __global__
// function). One block of THREADS threads per (output column n = blockIdx.x, row m = blockIdx.y of x); each
// thread takes 8-weight groups g = tid, tid + THREADS, ... of row n, decodes them as the CPU path does
// (cpp/qmm_cpu.cpp; layout in mlx-k3/src/codebook.rs) and the block sums the partial dot products in shared
// memory. Inputs: x [M, K] f32, codes [N, K/8] u8, qh [N, K/32] u16, scales [N, ceil(K/256)] f16,
// grid [4096] u32 (llama.cpp's 2048 IQ1_S entries, entry i = words 2i, 2i+1, byte j = value j as int8),
// dims = [M, N, K] i32. Output: out [M, N] f32. THREADS is a power of two.
__shared__ float part[THREADS];
const int tid = threadIdx.x;
const int n = blockIdx.x;
const int m = blockIdx.y;
const int N = dims[1];
const int K = dims[2];
const int groups = K / 8;
const int sb = (K + 255) / 256;
const float* xr = x + static_cast<size_t>(m) * K;
const uint8_t* cr = codes + static_cast<size_t>(n) * groups;
const uint16_t* hr = qh + static_cast<size_t>(n) * (K / 32);
float acc = 0.0f;
for (int g = tid; g < groups; g += THREADS) {
  const unsigned int h = hr[g >> 2];
  const unsigned int idx = cr[g] | (((h >> (3 * (g & 3))) & 7u) << 8);
  const float dl = static_cast<float>(scales[static_cast<size_t>(n) * sb + (g >> 5)]) *
                   static_cast<float>(2 * ((h >> 12) & 7u) + 1);
  const float delta = (h & 0x8000u) ? -0.125f : 0.125f;
  const unsigned int lo = grid[2 * idx];
  const unsigned int hi = grid[2 * idx + 1];
  const float* xv = xr + 8 * g;
  float s = 0.0f;
  float sx = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const unsigned int word = j < 4 ? lo : hi;
    const int v = static_cast<int>(static_cast<signed char>((word >> (8 * (j & 3))) & 0xffu));
    s += static_cast<float>(v) * xv[j];
    sx += xv[j];
  }
  acc += dl * (s + delta * sx);
}
part[tid] = acc;
__syncthreads();
for (int w = THREADS / 2; w > 0; w >>= 1) {
  if (tid < w) {
    part[tid] += part[tid + w];
  }
  __syncthreads();
}
if (tid == 0) {
  out[static_cast<size_t>(m) * N + n] = part[0];
}
