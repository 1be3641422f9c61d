// Which branch of a custom op runs: the GPU one (kernels/*.cu through MLX's fast::cuda_kernel, kernels/*.metal
// on Apple) for GPU streams, the CPU primitive otherwise. tests/cuda_emulation.rs sets gpu_branch_on_cpu so
// that CPU streams take the GPU branch too, in a test program where fast::cuda_kernel is replaced by a CPU
// emulator of CUDA's execution model: that is how the CUDA kernels run, and are compared with the CPU paths,
// on machines without a GPU. Nothing else sets it.
#pragma once

#include "mlx/stream.h"

namespace k3::kernels {

extern bool gpu_branch_on_cpu;

// The most blocks a CUDA launch of ours puts along the grid's y axis: CUDA's limit, 65535. Kernels that loop
// over rows past it (kernels/packed_qmm.cu) are tested with a small value here (tests/cuda_emulation), so the
// loop runs without a launch of 65536 rows. Nothing else changes it.
extern int gpu_grid_y_limit;

inline bool gpu_branch(const mlx::core::Stream& s) {
  return s.device == mlx::core::Device::gpu || gpu_branch_on_cpu;
}

}  // namespace k3::kernels
