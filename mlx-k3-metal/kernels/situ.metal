// SiTU for MLX's fast::metal_kernel (the body of a generated kernel; T is the element type).
// Inputs: up, gate (T, row-contiguous), params = [beta, linear_beta, has_linear_beta] (f32), count = [n].
uint i = thread_position_in_grid.x;
if (i >= uint(count[0])) {
  return;
}
float beta = params[0];
float g = float(gate[i]);
float u = float(up[i]);
if (params[2] != 0.0f) {
  u = params[1] * metal::precise::tanh(u / params[1]);
}
float a = beta * metal::precise::tanh(g / beta) * (1.0f / (1.0f + metal::precise::exp(-g)));
out[i] = static_cast<T>(a * u);
