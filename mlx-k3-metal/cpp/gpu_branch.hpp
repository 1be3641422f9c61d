// Which branch of a custom op runs, and with which kernels: the GPU one (kernels/*.cu through MLX's
// fast::cuda_kernel, kernels/*.metal through fast::metal_kernel) for GPU streams, the CPU primitive otherwise.
// A GPU stream takes the platform's kernels: Metal on Apple, CUDA elsewhere.
//
// tests/gpu_emulation.rs sets gpu_branch_on_cpu so that CPU streams take the GPU branch too, with the kernels
// of emulated_gpu_api, in a test program where fast::cuda_kernel and fast::metal_kernel are replaced by CPU
// emulators of the two execution models: that is how the CUDA and Metal kernels run, and are compared with the
// CPU paths, on machines without either GPU. Nothing else sets them.
#pragma once

#include "mlx/fast.h"
#include "mlx/stream.h"

namespace k3::kernels {

enum class GpuApi { cuda, metal };

#ifdef __APPLE__
inline constexpr GpuApi kPlatformGpuApi = GpuApi::metal;
#else
inline constexpr GpuApi kPlatformGpuApi = GpuApi::cuda;
#endif

extern bool gpu_branch_on_cpu;
extern GpuApi emulated_gpu_api;

// The most thread blocks (threadgroups) a launch of ours puts along the grid's y axis: CUDA's limit, 65535, for
// both APIs. Kernels that loop over rows past it (kernels/packed_qmm.*) are tested with a small value here
// (tests/gpu_emulation), so the loop runs without a launch of 65536 rows. Nothing else changes it.
extern int gpu_grid_y_limit;

inline bool gpu_branch(const mlx::core::Stream& s) {
  return s.device == mlx::core::Device::gpu || gpu_branch_on_cpu;
}

// The kernels a GPU branch launches on stream s.
inline GpuApi gpu_api(const mlx::core::Stream& s) {
  return s.device == mlx::core::Device::gpu ? kPlatformGpuApi : emulated_gpu_api;
}

// The kernel of one op for `api`: made by make_metal() or make_cuda() on first use and kept (per call site: each
// call site's lambdas are types of their own). Only the chosen API's factory runs, since MLX's factory for an
// API it has no back-end for throws (cuda_kernel on Apple).
template <class MakeMetal, class MakeCuda>
const mlx::core::fast::CustomKernelFunction& gpu_kernel(GpuApi api, MakeMetal make_metal, MakeCuda make_cuda) {
  if (api == GpuApi::metal) {
    static const auto metal = make_metal();
    return metal;
  }
  static const auto cuda = make_cuda();
  return cuda;
}

}  // namespace k3::kernels
