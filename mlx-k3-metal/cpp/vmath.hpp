// Branch-free fp32 math that compilers auto-vectorize (no libm calls inside loops). exp uses the classic
// range reduction x = n*ln2 + r (ln2 split in two parts so r is exact) and a degree-6 polynomial for e^r,
// ~1 ulp on [-87, 88]; tanh uses an odd polynomial below |x| = 0.625 (where 1 - 2/(e^2x + 1) would cancel)
// and the exp form above. Both are within a few fp32 ulp of libm; kernels using them are tested against
// MLX's own ops.
#pragma once

#include <bit>
#include <cstdint>

namespace k3::vmath {

inline float bits_to_float(uint32_t u) {
  return std::bit_cast<float>(u);
}

inline float min(float a, float b) {
  return a < b ? a : b;
}

inline float max(float a, float b) {
  return a > b ? a : b;
}

inline float exp(float x) {
  x = min(x, 88.0f);  // keeps 2^n finite (n <= 127)
  x = max(x, -87.3365447504019f);
  // Round to nearest with the 1.5 * 2^23 trick (plain adds vectorize on every x86-64 / arm64; floorf needs
  // SSE4.1 and otherwise becomes a library call per element).
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  return p * bits_to_float(static_cast<uint32_t>(e) << 23);
}

inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp(-x));
}

inline float tanh(float x) {
  float ax = x < 0.0f ? -x : x;
  // large: 1 - 2 / (e^{2|x|} + 1), with the sign restored
  float big = 1.0f - 2.0f / (exp(2.0f * ax) + 1.0f);
  big = x < 0.0f ? -big : big;
  // small: x + x^3 P(x^2)
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = x + x * z * p;
  return ax < 0.625f ? small : big;
}

}  // namespace k3::vmath
