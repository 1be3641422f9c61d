// KDA one-token decode step for MLX's fast::cuda_kernel (body of the generated __global__ function; see
// cpp/kda_step.cpp for the math). One block per (batch, head), one thread per channel / state row.
// Template constants: T (activation dtype), H heads, D head_dim (block size), KC conv kernel, HAS_LB,
// HAS_CONV, HAS_SSM. Inputs: qkv [B, 3P], a [B, H, D], b [B, H], gate [B, H, D] (T); conv_w [3P, KC],
// a_log [H], dt_bias [P], norm_w [D] (f32); conv_state [B, KC-1, 3P] (T) or a dummy; ssm [B, H, D, D] (f32)
// or a dummy; params = [lower_bound, norm_eps]. Outputs: out [B, P], new_conv [B, KC-1, 3P], new_ssm.
// Not yet run on a GPU.
constexpr int P = H * D;
constexpr int C = 3 * P;
const int bh = blockIdx.x;
const int bi = bh / H;
const int h = bh % H;
const int i = threadIdx.x;
__shared__ float q[D];
__shared__ float k[D];
__shared__ float red[D];
__shared__ float alpha[D];
float vi = 0.0f;
for (int part = 0; part < 3; ++part) {
  const int c = part * P + h * D + i;
  float acc = 0.0f;
  for (int t = 0; t < KC - 1; ++t) {
    float s = HAS_CONV ? static_cast<float>(conv_state[(static_cast<size_t>(bi) * (KC - 1) + t) * C + c]) : 0.0f;
    acc += conv_w[static_cast<size_t>(c) * KC + t] * s;
  }
  const float xin = static_cast<float>(qkv[static_cast<size_t>(bi) * C + c]);
  acc += conv_w[static_cast<size_t>(c) * KC + KC - 1] * xin;
  const float val = acc / (1.0f + expf(-acc));
  if (part == 0) q[i] = val;
  else if (part == 1) k[i] = val;
  else vi = val;
  for (int t = 0; t + 1 < KC - 1; ++t) {
    new_conv[(static_cast<size_t>(bi) * (KC - 1) + t) * C + c] =
        HAS_CONV ? conv_state[(static_cast<size_t>(bi) * (KC - 1) + t + 1) * C + c] : static_cast<T>(0.0f);
  }
  if (KC > 1) new_conv[(static_cast<size_t>(bi) * (KC - 1) + KC - 2) * C + c] = qkv[static_cast<size_t>(bi) * C + c];
}
__syncthreads();
// |q|^2 and |k|^2 (thread 0 sums; D is small).
red[i] = q[i] * q[i];
__syncthreads();
__shared__ float sums[3];
if (i == 0) {
  float s = 0.0f;
  for (int j = 0; j < D; ++j) s += red[j];
  sums[0] = s;
}
__syncthreads();
red[i] = k[i] * k[i];
__syncthreads();
if (i == 0) {
  float s = 0.0f;
  for (int j = 0; j < D; ++j) s += red[j];
  sums[1] = s;
}
__syncthreads();
const float inv_d = 1.0f / D;
const float eps = 1e-6f * inv_d;
const float qs = rsqrtf(sums[0] * inv_d + eps) * inv_d;
const float ks = rsqrtf(sums[1] * inv_d + eps) * rsqrtf(static_cast<float>(D));
__syncthreads();
q[i] *= qs;
k[i] *= ks;
const float ea = expf(a_log[h]);
const float av = static_cast<float>(a[(static_cast<size_t>(bi) * H + h) * D + i]) + dt_bias[h * D + i];
if (HAS_LB) {
  alpha[i] = expf(params[0] / (1.0f + expf(-ea * av)));
} else {
  const float sp = fmaxf(av, 0.0f) + log1pf(expf(-fabsf(av)));
  alpha[i] = expf(-ea * sp);
}
const float beta = 1.0f / (1.0f + expf(-static_cast<float>(b[static_cast<size_t>(bi) * H + h])));
__syncthreads();
// State row i.
const size_t off = (static_cast<size_t>(bi) * H + h) * D * D + static_cast<size_t>(i) * D;
float kv = 0.0f;
for (int j = 0; j < D; ++j) {
  const float s = HAS_SSM ? ssm[off + j] * alpha[j] : 0.0f;
  new_ssm[off + j] = s;
  kv += s * k[j];
}
const float delta = (vi - kv) * beta;
float y = 0.0f;
for (int j = 0; j < D; ++j) {
  const float s = new_ssm[off + j] + k[j] * delta;
  new_ssm[off + j] = s;
  y += s * q[j];
}
y = static_cast<float>(static_cast<T>(y));
red[i] = y * y;
__syncthreads();
if (i == 0) {
  float s = 0.0f;
  for (int j = 0; j < D; ++j) s += red[j];
  sums[2] = s;
}
__syncthreads();
const float r = rsqrtf(sums[2] * inv_d + params[1]);
const float g = static_cast<float>(gate[(static_cast<size_t>(bi) * H + h) * D + i]);
out[static_cast<size_t>(bi) * P + h * D + i] = static_cast<T>(y * r * norm_w[i] / (1.0f + expf(-g)));
