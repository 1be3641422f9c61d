// SiTU for MLX's fast::cuda_kernel (the body of a generated __global__ function; T is the element type).
// Inputs: up, gate (T, row-contiguous), params = [beta, linear_beta, has_linear_beta] (f32), count = [n].
auto i = cooperative_groups::this_grid().thread_rank();
if (i >= static_cast<size_t>(count[0])) {
  return;
}
float beta = params[0];
float g = static_cast<float>(gate[i]);
float u = static_cast<float>(up[i]);
if (params[2] != 0.0f) {
  u = params[1] * tanhf(u / params[1]);
}
float a = beta * tanhf(g / beta) * (1.0f / (1.0f + expf(-g)));
out[i] = static_cast<T>(a * u);
