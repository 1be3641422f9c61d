// The CUDA and Metal kernels (kernels/*.cu, kernels/*.metal) run on the CPU and are compared with the CPU paths
// of the same ops.
//
// No machine this project is built and tested on has a GPU (four CUDA kernels ran once on a lent H200, README;
// no Metal kernel has ever run on an Apple GPU), so without this CI would only compile the CUDA kernels
// (scripts/check_cuda_kernels.py) and not even that for Metal. This program replaces MLX's fast::cuda_kernel and
// fast::metal_kernel with definitions of its own (the linker takes them over libmlx's): a launch builds the
// translation unit MLX's JIT would build (same signature from the input/output names and dtypes, same template
// constants, same body; for Metal the signature text of MLX's write_signature, attributes and all) but with
// cuda_emu.hpp or metal_emu.hpp in place of MLX's device header, compiles it with the host C++ compiler as a
// shared object (AddressSanitizer on: this program is built with it, so a kernel that reads or writes past any
// input, output, __shared__ or threadgroup array stops the run with a report), loads it and runs the grid
// twice, the threads of each block in index order and backwards, requiring the same bits (an order dependence
// is a missing barrier). Setting k3::kernels::gpu_branch_on_cpu makes each op take its GPU branch on a CPU
// stream, with the kernels of k3::kernels::emulated_gpu_api, so the whole branch (its casts, dummy inputs,
// launch shape, template constants) runs, through the same C ABI the Rust crate calls.
//
// Every case runs once per API. Each calls the op twice on the same inputs, CPU branch then GPU branch, and
// compares. Outputs the kernel never writes hold NaN (every byte 0xff), so a missed element fails the
// comparison. Tolerances are stated per op below, from how the two paths' float32 arithmetic can differ; an
// indexing or synchronization mistake moves results by O(1) relative, far above them. Usage: gpu_emulation <c++
// compiler> <emulation include dir> <mlx include dir> <scratch dir> [clang++]. Exit status 0 when every case passes; one
// line per case. With a clang++ as the fifth argument, every Metal unit is also checked for address-space
// mistakes (compile_unit). K3EMU_SANITIZE=0 compiles the kernel units without AddressSanitizer (for a build of this
// program without it).
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_branch.hpp"
#include "k3_internal.hpp"
#include "k3_kernels.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace {

std::string g_cxx, g_emu_include, g_mlx_include, g_scratch;
std::string g_clang;  // clang++ for the Metal address-space check, or empty (no check)
int g_as_checks = 0;
int g_launches = 0, g_compiles = 0;
using k3::kernels::GpuApi;
int g_api_launches[2] = {0, 0};  // per GpuApi (cuda, metal)

// A dtype's type name in a generated CUDA unit (MLX's CUDA JIT) and in a generated Metal unit (MLX's
// get_type_string, mlx/backend/common/compiled.cpp).
std::string type_name(mx::Dtype t, bool metal) {
  struct Names {
    const char *cuda, *metal;
  };
  static const std::map<mx::Dtype::Val, Names> names{
      {mx::Dtype::Val::bool_, {"bool", "bool"}},
      {mx::Dtype::Val::int8, {"int8_t", "int8_t"}},
      {mx::Dtype::Val::int16, {"int16_t", "int16_t"}},
      {mx::Dtype::Val::int32, {"int32_t", "int32_t"}},
      {mx::Dtype::Val::int64, {"int64_t", "int64_t"}},
      {mx::Dtype::Val::uint8, {"uint8_t", "uint8_t"}},
      {mx::Dtype::Val::uint16, {"uint16_t", "uint16_t"}},
      {mx::Dtype::Val::uint32, {"uint32_t", "uint32_t"}},
      {mx::Dtype::Val::uint64, {"uint64_t", "uint64_t"}},
      {mx::Dtype::Val::float16, {"__half", "float16_t"}},
      {mx::Dtype::Val::bfloat16, {"__nv_bfloat16", "bfloat16_t"}},
      {mx::Dtype::Val::float32, {"float", "float"}}};
  auto it = names.find(t.val());
  if (it == names.end()) throw std::invalid_argument("gpu_emulation: no kernel type for this dtype");
  return metal ? it->second.metal : it->second.cuda;
}

std::string cuda_type(mx::Dtype t) {
  return type_name(t, false);
}

std::string metal_type(mx::Dtype t) {
  return type_name(t, true);
}

using TemplateArgs = std::vector<std::pair<std::string, mx::fast::TemplateArg>>;

// The entry point both kinds of unit end with: launches the kernel over the grid (blocks per dimension, threads
// per block as dispatched, threads of the grid), threads in index order or (reverse) backwards.
const char* const kEntry =
    "extern \"C\" void k3emu_entry(void* const* a, const unsigned* groups, const unsigned* block, const unsigned* grid,\n"
    "                              int reverse) {\n"
    "  k3emu::reverse_order = reverse != 0;\n";

// The translation unit of mlx/backend/cuda/custom_kernel.cpp's build_kernel (ensure_row_contiguous, no
// shape/stride parameters), with the emulation header, plus an entry point that launches it.
std::string build_cuda_unit(const std::string& name, const std::string& header, const std::string& body,
                            const std::vector<std::string>& in_names, const std::vector<mx::array>& inputs,
                            const std::vector<std::string>& out_names, const std::vector<mx::Dtype>& out_dtypes,
                            const TemplateArgs& targs) {
  std::string src = "#include \"cuda_emu.hpp\"\n" + header + "namespace mlx::core::cu {\n\n";
  src += "namespace cg = cooperative_groups;\n\n__global__ void " + name + "(\n";
  for (size_t i = 0; i < inputs.size(); ++i) src += "    const " + cuda_type(inputs[i].dtype()) + "* " + in_names[i] + ",\n";
  for (size_t i = 0; i < out_names.size(); ++i) {
    src += "    " + cuda_type(out_dtypes[i]) + "* " + out_names[i] + (i + 1 < out_names.size() ? ",\n" : ") {\n");
  }
  for (const auto& [k, v] : targs) {
    if (std::holds_alternative<int>(v)) {
      src += "  constexpr int " + k + " = " + std::to_string(std::get<int>(v)) + ";\n";
    } else if (std::holds_alternative<bool>(v)) {
      src += "  constexpr bool " + k + " = " + (std::get<bool>(v) ? "true" : "false") + ";\n";
    } else {
      src += "  using " + k + " = " + cuda_type(std::get<mx::Dtype>(v)) + ";\n";
    }
  }
  src += "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n\n";
  src += kEntry;
  src += "  k3emu::exited_threads_leave_barriers = true;\n  k3emu::tg_memory_limit = 0;\n";
  src += "  k3emu::launch(groups, block, grid, [a] { mlx::core::cu::" + name + "(";
  for (size_t i = 0; i < inputs.size(); ++i) {
    src += "static_cast<const " + cuda_type(inputs[i].dtype()) + "*>(a[" + std::to_string(i) + "]), ";
  }
  for (size_t i = 0; i < out_names.size(); ++i) {
    src += "static_cast<" + cuda_type(out_dtypes[i]) + "*>(a[" + std::to_string(inputs.size() + i) + "])";
    src += i + 1 < out_names.size() ? ", " : "); });\n}\n";
  }
  return src;
}

// The attributes MLX's metal_kernel gives a kernel as parameters when its source names them (a substring
// search, as MLX's), in MLX's order, with their types (mlx/backend/common/metal_kernel.cpp).
const std::pair<const char*, const char*> kMetalAttributes[] = {
    {"dispatch_quadgroups_per_threadgroup", "uint"}, {"dispatch_simdgroups_per_threadgroup", "uint"},
    {"dispatch_threads_per_threadgroup", "uint3"},   {"grid_origin", "uint3"},
    {"grid_size", "uint3"},                          {"quadgroup_index_in_threadgroup", "uint"},
    {"quadgroups_per_threadgroup", "uint"},          {"simdgroup_index_in_threadgroup", "uint"},
    {"simdgroups_per_threadgroup", "uint"},          {"thread_execution_width", "uint"},
    {"thread_index_in_quadgroup", "uint"},           {"thread_index_in_simdgroup", "uint"},
    {"thread_index_in_threadgroup", "uint"},         {"thread_position_in_grid", "uint3"},
    {"thread_position_in_threadgroup", "uint3"},     {"threadgroup_position_in_grid", "uint3"},
    {"threadgroups_per_grid", "uint3"},              {"threads_per_grid", "uint3"},
    {"threads_per_simdgroup", "uint"},               {"threads_per_threadgroup", "uint3"}};

// Inputs with fewer elements go to the constant address space (MLX's max_constant_array_size).
constexpr size_t kMaxConstantArraySize = 8;

// The body with each `threadgroup` variable declaration (a statement `threadgroup TYPE NAME[DIMS];`, which
// Metal allows no initializer) turned into a reference to per-threadgroup storage (fibers.hpp, tg_var). Other
// uses of the word (a pointer's address space) are left to the header's empty macro.
std::string rewrite_threadgroup_declarations(const std::string& body) {
  static const std::regex word("\\bthreadgroup\\b");
  static const std::regex decl("^\\s*threadgroup\\s+(.*[^\\s])\\s+([A-Za-z_]\\w*)\\s*((?:\\[[^\\]]*\\]\\s*)*)$");
  std::string out;
  size_t pos = 0;
  int id = 0;
  for (auto it = std::sregex_iterator(body.begin(), body.end(), word); it != std::sregex_iterator(); ++it) {
    const size_t at = it->position();
    if (at < pos) continue;
    size_t before = at;
    while (before > 0 && std::isspace(static_cast<unsigned char>(body[before - 1]))) --before;
    const bool statement = before == 0 || body[before - 1] == ';' || body[before - 1] == '{' || body[before - 1] == '}';
    const size_t end = body.find(';', at);
    if (!statement || end == std::string::npos) continue;
    const std::string stmt = body.substr(at, end - at);
    std::smatch m;
    if (stmt.find_first_of("=(") != std::string::npos || !std::regex_match(stmt, m, decl)) continue;
    if (m[1].str().find(',') != std::string::npos && m[1].str().find('<') == std::string::npos) {
      throw std::invalid_argument("gpu_emulation: one threadgroup declaration per statement, please: " + stmt);
    }
    const std::string t = "k3emu_tg" + std::to_string(id) + "_t";
    out += body.substr(pos, at - pos);
    out += "typedef " + m[1].str() + " " + t + m[3].str() + "; auto& " + m[2].str() + " = K3EMU_TG_VAR(" + t +
           ", " + std::to_string(id) + ")";
    pos = end;
    ++id;
  }
  return out + body.substr(pos);
}

// The source MLX's metal_kernel builds (write_signature, write_template), with metal_emu.hpp in place of
// MLX's Metal prelude, the threadgroup declarations rewritten, plus an entry point that launches it.
std::string build_metal_unit(const std::string& name, const std::string& header, const std::string& body,
                             const std::vector<std::string>& in_names, const std::vector<mx::array>& inputs,
                             const std::vector<std::string>& out_names, const std::vector<mx::Dtype>& out_dtypes,
                             const TemplateArgs& targs) {
  const std::string fn = "custom_kernel_" + name;
  std::string src = "#include \"metal_emu.hpp\"\n" + header;
  std::string tdef;  // write_template: ints and bools as an ostream prints them (bools as 1/0), types by name
  if (!targs.empty()) {
    src += "template <";
    for (size_t i = 0; i < targs.size(); ++i) {
      const auto& [k, v] = targs[i];
      const bool is_int = std::holds_alternative<int>(v), is_bool = std::holds_alternative<bool>(v);
      src += (i ? ", " : "") + std::string(is_int ? "int" : is_bool ? "bool" : "typename") + " " + k;
      tdef += (i ? ", " : "") + (is_int    ? std::to_string(std::get<int>(v))
                                 : is_bool ? std::string(std::get<bool>(v) ? "1" : "0")
                                           : metal_type(std::get<mx::Dtype>(v)));
    }
    src += ">\n";
    tdef = "<" + tdef + ">";
  }
  src += "[[kernel]] void " + fn + "(\n";
  std::vector<std::pair<const char*, const char*>> attrs;
  for (const auto& a : kMetalAttributes) {
    if (body.find(a.first) != std::string::npos) attrs.push_back(a);
  }
  std::string call = "  k3emu::launch(groups, block, grid, [a] { " + fn + tdef + "(";
  int index = 0;
  for (size_t i = 0; i < inputs.size(); ++i, ++index) {
    const std::string t = metal_type(inputs[i].dtype());
    const bool scalar = inputs[i].ndim() == 0;
    src += "  const " + std::string(inputs[i].size() < kMaxConstantArraySize ? "constant" : "device") + " " + t +
           (scalar ? "&" : "*") + " " + in_names[i] + " [[buffer(" + std::to_string(index) + ")]],\n";
    call += std::string(scalar ? "*" : "") + "static_cast<const " + t + "*>(a[" + std::to_string(i) + "]), ";
  }
  for (size_t i = 0; i < out_names.size(); ++i, ++index) {
    const std::string t = metal_type(out_dtypes[i]);
    src += "  device " + t + "* " + out_names[i] + " [[buffer(" + std::to_string(index) + ")]]";
    src += i + 1 < out_names.size() || !attrs.empty() ? ",\n" : ") {\n";
    call += "static_cast<" + t + "*>(a[" + std::to_string(inputs.size() + i) + "])";
    call += i + 1 < out_names.size() || !attrs.empty() ? ", " : "";
  }
  for (size_t i = 0; i < attrs.size(); ++i) {
    const std::string n = attrs[i].first;
    src += "  " + std::string(attrs[i].second) + " " + n + " [[" + n + "]]" + (i + 1 < attrs.size() ? ",\n" : ") {\n");
    call += "k3emu::attr::" + n + "()" + (i + 1 < attrs.size() ? ", " : "");
  }
  src += rewrite_threadgroup_declarations(body) + "\n}\n\n";
  // The address-space check reads the kernel instantiated as MLX instantiates it (without the attributes, which
  // clang does not take there); the emulator's entry point converts untyped pointers, so it is left out.
  src += "#ifdef K3EMU_ADDRESS_SPACES\n";
  if (!tdef.empty()) src += "template decltype(" + fn + tdef + ") " + fn + tdef + ";\n";
  src += "#else\n";
  src += kEntry;
  // Metal: every thread of a threadgroup must reach each barrier; 32 KiB of threadgroup memory.
  src += "  k3emu::exited_threads_leave_barriers = false;\n  k3emu::tg_memory_limit = 32768;\n";
  src += call + "); });\n}\n#endif\n";
  return src;
}

using Entry = void (*)(void* const*, const unsigned*, const unsigned*, const unsigned*, int);

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Compiles a unit and returns its entry point. Metal units (metal_emu.hpp) are also read by clang with Metal's
// address spaces as clang address spaces (metal_emu.hpp, K3EMU_ADDRESS_SPACES), where a pointer that mixes
// device, constant, threadgroup and thread memory is a type error, as it is for Metal's compiler.
Entry compile_unit(const std::string& src) {
  static std::map<std::string, Entry> cache;
  auto it = cache.find(src);
  if (it != cache.end()) return it->second;
  const std::string base = g_scratch + "/unit" + std::to_string(cache.size());
  std::ofstream(base + ".cpp") << src;
  if (!g_clang.empty() && src.find("#include \"metal_emu.hpp\"") != std::string::npos) {
    const std::string cmd = g_clang + " -std=c++20 -fsyntax-only -DK3EMU_ADDRESS_SPACES -Wno-unknown-attributes -I '" +
                            g_emu_include + "' -isystem '" + g_mlx_include + "' '" + base + ".cpp' 2> '" + base +
                            ".as.log'";
    if (std::system(cmd.c_str()) != 0) {
      throw std::runtime_error("gpu_emulation: the Metal kernel mixes address spaces (" + base +
                               ".cpp, read by clang with -DK3EMU_ADDRESS_SPACES):\n" +
                               read_text(base + ".as.log").substr(0, 4000));
    }
    ++g_as_checks;
  }
  const char* san = std::getenv("K3EMU_SANITIZE");
  const std::string flags = san && std::string(san) == "0" ? "" : " -fsanitize=address -fno-omit-frame-pointer";
  const std::string cmd = g_cxx + " -std=c++20 -O1 -g -fPIC -shared -Wno-attributes" + flags + " -I '" +
                          g_emu_include + "' -isystem '" + g_mlx_include + "' -o '" + base + ".so' '" + base +
                          ".cpp' -lpthread 2> '" + base + ".log'";
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("gpu_emulation: the kernel does not compile for the emulator (" + base + ".cpp):\n" +
                             read_text(base + ".log").substr(0, 4000));
  }
  void* lib = dlopen((base + ".so").c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) throw std::runtime_error(std::string("gpu_emulation: dlopen: ") + dlerror());
  auto entry = reinterpret_cast<Entry>(dlsym(lib, "k3emu_entry"));
  if (!entry) throw std::runtime_error("gpu_emulation: no k3emu_entry in " + base + ".so");
  ++g_compiles;
  return cache[src] = entry;
}

std::vector<mx::array> emulate(GpuApi api, const std::string& name, const std::vector<std::string>& in_names,
                               const std::vector<std::string>& out_names, const std::string& source,
                               const std::string& header, bool ensure_row_contiguous, int shared_memory,
                               const std::vector<mx::array>& inputs_in, const std::vector<mx::Shape>& out_shapes,
                               const std::vector<mx::Dtype>& out_dtypes, std::tuple<int, int, int> grid,
                               std::tuple<int, int, int> tg, const TemplateArgs& targs,
                               std::optional<float> init_value) {
  if (!ensure_row_contiguous) throw std::invalid_argument("gpu_emulation: only ensure_row_contiguous kernels");
  if (shared_memory != 0) throw std::invalid_argument("gpu_emulation: no dynamic shared memory");
  if (inputs_in.size() != in_names.size() || out_shapes.size() != out_names.size() ||
      out_dtypes.size() != out_names.size()) {
    throw std::invalid_argument("gpu_emulation: " + name + ": names and arrays disagree in number");
  }
  for (const auto& n : in_names) {
    if (std::regex_search(source, std::regex("\\b" + n + "_(shape|strides|ndim)\\b"))) {
      throw std::invalid_argument("gpu_emulation: " + name + " uses " + n + "_shape/_strides/_ndim (not emulated)");
    }
  }
  // Inputs: row-contiguous copies in buffers of their exact size (AddressSanitizer guards each one).
  std::vector<void*> args;
  for (const auto& x : inputs_in) {
    auto c = mx::contiguous(x, false);
    mx::eval(c);
    if (!c.flags().row_contiguous) throw std::logic_error("gpu_emulation: contiguous() is not row-contiguous");
    void* buf = std::malloc(c.nbytes() ? c.nbytes() : 1);
    std::memcpy(buf, c.data<char>(), c.nbytes());
    args.push_back(buf);
  }
  // Outputs: filled with init_value, or else with NaN (every byte 0xff), so elements the kernel skips show.
  std::vector<size_t> out_bytes;
  std::vector<std::vector<char>> out_init;
  for (size_t i = 0; i < out_shapes.size(); ++i) {
    size_t n = 1;
    for (int d : out_shapes[i]) n *= d;
    const size_t bytes = n * mx::size_of(out_dtypes[i]);
    std::vector<char> init(bytes, static_cast<char>(0xff));
    if (init_value) {
      auto v = mx::astype(mx::full(out_shapes[i], *init_value, mx::float32), out_dtypes[i]);
      mx::eval(v);
      std::memcpy(init.data(), v.data<char>(), bytes);
    }
    void* buf = std::malloc(bytes ? bytes : 1);
    std::memcpy(buf, init.data(), bytes);
    args.push_back(buf);
    out_bytes.push_back(bytes);
    out_init.push_back(std::move(init));
  }
  const auto [gx, gy, gz] = grid;
  const auto [tx, ty, tz] = tg;
  if (tx < 1 || ty < 1 || tz < 1 || gx < 0 || gy < 0 || gz < 0) throw std::invalid_argument("gpu_emulation: bad launch");
  // Both back-ends: threads per block = min(threadgroup, grid), blocks = ceil(grid / threadgroup) per dimension
  // (mlx/backend/cuda/custom_kernel.cpp; Metal's dispatch_threads). A CUDA grid is whole blocks; Metal's grid is
  // the threads asked for, so a block at its edge has fewer (non-uniform threadgroups).
  const unsigned block[3] = {(unsigned)std::min(tx, gx), (unsigned)std::min(ty, gy), (unsigned)std::min(tz, gz)};
  const unsigned blocks[3] = {(unsigned)((gx + tx - 1) / tx), (unsigned)((gy + ty - 1) / ty),
                              (unsigned)((gz + tz - 1) / tz)};
  const unsigned asked[3] = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
  unsigned threads[3];
  for (int d = 0; d < 3; ++d) threads[d] = api == GpuApi::cuda ? blocks[d] * block[d] : asked[d];
  if (block[0] * block[1] * block[2] > 1024) throw std::invalid_argument("gpu_emulation: more than 1024 threads a block");
  if ((long)blocks[0] * blocks[1] * blocks[2] > 0 && block[0] * block[1] * block[2] > 0) {
    const auto build = api == GpuApi::cuda ? build_cuda_unit : build_metal_unit;
    Entry entry = compile_unit(build(name, header, source, in_names, inputs_in, out_names, out_dtypes, targs));
    auto run = [&](int reverse) {
      try {
        entry(args.data(), blocks, block, threads, reverse);
      } catch (const std::exception& e) {
        throw std::runtime_error("gpu_emulation: " + name + ": " + e.what());
      }
    };
    // Threads in index order, then backwards from fresh outputs: the bits must not change.
    run(0);
    std::vector<std::vector<char>> forward;
    for (size_t i = 0; i < out_bytes.size(); ++i) {
      char* p = static_cast<char*>(args[inputs_in.size() + i]);
      forward.emplace_back(p, p + out_bytes[i]);
      std::memcpy(p, out_init[i].data(), out_bytes[i]);
    }
    run(1);
    for (size_t i = 0; i < out_bytes.size(); ++i) {
      if (std::memcmp(forward[i].data(), args[inputs_in.size() + i], out_bytes[i]) != 0) {
        throw std::runtime_error("gpu_emulation: " + name + ": output " + out_names[i] +
                                 " depends on the order the threads of a block run in (a thread reads what another "
                                 "writes without a barrier in between)");
      }
    }
    ++g_launches;
    ++g_api_launches[static_cast<int>(api)];
  }
  for (size_t i = 0; i < inputs_in.size(); ++i) std::free(args[i]);
  std::vector<mx::array> outs;
  for (size_t i = 0; i < out_shapes.size(); ++i) {
    outs.emplace_back(args[inputs_in.size() + i], out_shapes[i], out_dtypes[i], [](void* p) { std::free(p); });
  }
  return outs;
}

}  // namespace

// These take the place of libmlx's definitions (a symbol of this executable wins over the shared library's).
namespace mlx::core::fast {
CustomKernelFunction cuda_kernel(const std::string& name, const std::vector<std::string>& input_names,
                                 const std::vector<std::string>& output_names, const std::string& source,
                                 const std::string& header, bool ensure_row_contiguous, int shared_memory) {
  return [=](const std::vector<array>& inputs, const std::vector<Shape>& out_shapes, const std::vector<Dtype>& out_dtypes,
             std::tuple<int, int, int> grid, std::tuple<int, int, int> tg,
             std::vector<std::pair<std::string, TemplateArg>> targs, std::optional<float> init_value, bool,
             StreamOrDevice) {
    return emulate(GpuApi::cuda, name, input_names, output_names, source, header, ensure_row_contiguous, shared_memory,
                   inputs, out_shapes, out_dtypes, grid, tg, targs, init_value);
  };
}

CustomKernelFunction metal_kernel(const std::string& name, const std::vector<std::string>& input_names,
                                  const std::vector<std::string>& output_names, const std::string& source,
                                  const std::string& header, bool ensure_row_contiguous, bool atomic_outputs,
                                  const CompileOptions& options) {
  if (atomic_outputs) throw std::invalid_argument("gpu_emulation: atomic outputs are not emulated");
  if (!(options == CompileOptions{})) throw std::invalid_argument("gpu_emulation: only the default math mode");
  return [=](const std::vector<array>& inputs, const std::vector<Shape>& out_shapes, const std::vector<Dtype>& out_dtypes,
             std::tuple<int, int, int> grid, std::tuple<int, int, int> tg,
             std::vector<std::pair<std::string, TemplateArg>> targs, std::optional<float> init_value, bool,
             StreamOrDevice) {
    return emulate(GpuApi::metal, name, input_names, output_names, source, header, ensure_row_contiguous, 0, inputs,
                   out_shapes, out_dtypes, grid, tg, targs, init_value);
  };
}
}  // namespace mlx::core::fast

namespace {

int g_failures = 0, g_cases = 0;
// The API whose kernels the cases run now, for the report lines.
const char* api_name() {
  return k3::kernels::emulated_gpu_api == GpuApi::metal ? "metal" : "cuda";
}
const k3_stream kCpu{0, -1, 0};  // the default stream (CPU: this MLX has no GPU)

k3_array h(const mx::array& a) {
  return k3_array{const_cast<mx::array*>(&a)};
}
k3_array none() {
  return k3_array{nullptr};
}

void ok(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + ": " + k3_last_error());
}

mx::array take(k3_array r) {
  auto* p = static_cast<mx::array*>(r.ctx);
  mx::array a = *p;
  delete p;
  return a;
}

// Runs `op` with the CPU branch and with the GPU branch (emulated kernel); both results evaluated.
std::pair<std::vector<mx::array>, std::vector<mx::array>> both(const std::function<std::vector<mx::array>()>& op) {
  k3::kernels::gpu_branch_on_cpu = false;
  auto cpu = op();
  mx::eval(cpu);
  const int api = static_cast<int>(k3::kernels::emulated_gpu_api);
  const int before = g_api_launches[api];
  k3::kernels::gpu_branch_on_cpu = true;
  auto gpu = op();
  k3::kernels::gpu_branch_on_cpu = false;
  mx::eval(gpu);
  if (g_api_launches[api] == before) throw std::logic_error(std::string("the GPU branch launched no ") + api_name() + " kernel");
  return {cpu, gpu};
}

std::vector<float> values(const mx::array& a) {
  auto f = mx::astype(a, mx::float32);
  mx::eval(f);
  auto c = mx::contiguous(f);
  mx::eval(c);
  return std::vector<float>(c.data<float>(), c.data<float>() + c.size());
}

// Relative rounding unit of a dtype (one ulp of x is at most eps * |x| for normal x).
double eps_of(mx::Dtype t) {
  if (t == mx::float16) return std::ldexp(1.0, -10);
  if (t == mx::bfloat16) return std::ldexp(1.0, -7);
  return std::ldexp(1.0, -23);
}

// Element-wise |got - ref| <= tol(i, ref); NaN anywhere fails. Prints one line.
void compare(const std::string& what, const mx::array& ref_a, const mx::array& got_a,
             const std::function<double(size_t, double)>& tol) {
  ++g_cases;
  if (ref_a.shape() != got_a.shape() || ref_a.dtype() != got_a.dtype()) {
    std::printf("FAIL %s %s: shape/dtype %s vs %s\n", api_name(), what.c_str(), k3::shape_str(ref_a.shape()).c_str(),
                k3::shape_str(got_a.shape()).c_str());
    ++g_failures;
    return;
  }
  auto ref = values(ref_a), got = values(got_a);
  double worst = 0.0;  // largest |diff| / tol
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs((double)got[i] - ref[i]), t = tol(i, ref[i]);
    const bool fine = std::isfinite(got[i]) && std::isfinite(ref[i]) && d <= t;
    if (!fine && bad++ == 0) first_bad = i;
    if (t > 0) worst = std::max(worst, d / t);
  }
  if (bad) {
    std::printf("FAIL %s %s: %zu of %zu elements off (first at %zu: cpu %.9g, emulated gpu %.9g)\n", api_name(), what.c_str(), bad,
                ref.size(), first_bad, ref[first_bad], got[first_bad]);
    ++g_failures;
  } else {
    std::printf("ok   %s %s: %zu elements, largest difference %.3f of the tolerance\n", api_name(), what.c_str(), ref.size(), worst);
  }
}

double max_abs(const mx::array& a) {
  double m = 0;
  for (float v : values(a)) m = std::max(m, (double)std::fabs(v));
  return m;
}

struct Rng {
  std::mt19937 g;
  explicit Rng(uint32_t seed) : g(seed) {}
  mx::array normal(const mx::Shape& shape, float scale, mx::Dtype dt = mx::float32) {
    size_t n = 1;
    for (int d : shape) n *= d;
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(g);
    return mx::astype(mx::array(v.begin(), shape, mx::float32), dt);
  }
};

const char* dname(mx::Dtype t) {
  return t == mx::float32 ? "f32" : t == mx::float16 ? "f16" : "bf16";
}

// SiTU: element-wise, the same formula in float32 (the CPU path's exp/tanh polynomials are within a few ulp of
// libm's, vmath.hpp); the two f32 results differ by a few ulp, so f32 output: 16 ulp of |ref|; f16/bf16
// output: both round nearby f32 values, which can land one ulp apart: 1 ulp of the output type (+ a subnormal
// floor).
void check_situ() {
  Rng rng(1);
  for (auto dt : {mx::float32, mx::float16, mx::bfloat16}) {
    for (bool lin : {false, true}) {
      auto up = rng.normal({3, 1001}, 3.0f, dt), gate = rng.normal({3, 1001}, 3.0f, dt);
      auto [cpu, gpu] = both([&] {
        k3_array r;
        ok(k3_situ(&r, h(up), h(gate), 2.5f, lin, 4.0f, kCpu), "k3_situ");
        return std::vector<mx::array>{take(r)};
      });
      const double e = dt == mx::float32 ? 16 * eps_of(dt) : eps_of(dt);
      compare(std::string("situ ") + dname(dt) + (lin ? " linear_beta" : ""), cpu[0], gpu[0],
              [&](size_t, double r) { return e * std::fabs(r) + 1e-7; });
    }
  }
}

// Router: the chosen experts must be the same set per row (the CPU path returns MLX argpartition's order, the
// kernel (score desc, index asc): rows are compared sorted by index), the protected flags the same, the
// weights as SiTU's (sigmoid, a sum of k of them, one division: a few f32 ulp). Logits are drawn distinct per
// row, so no tie decides the set.
void check_router() {
  struct Case {
    mx::Dtype dt;
    int E, k, ng, kg;
    bool renorm, bias, mask;
  };
  const Case cases[] = {{mx::float32, 896, 16, 1, 1, true, true, false},  {mx::float16, 896, 16, 1, 1, true, true, false},
                        {mx::bfloat16, 896, 16, 1, 1, true, true, true},  {mx::float32, 256, 8, 8, 4, false, true, true},
                        {mx::float32, 64, 6, 1, 1, true, false, false},    {mx::float32, 1, 1, 1, 1, false, false, true},
                        {mx::float32, 1000, 32, 1, 1, true, true, false}};
  Rng rng(2);
  for (const auto& c : cases) {
    const int rows = 5;
    // Distinct logits in every row, exact in f16 and bf16 too: +-(1 + m/128) 2^e for m < 128, e in -3..0
    // (1024 values), shuffled; the first E of each shuffle make a row. Ties would make both sides' choice legal.
    std::vector<float> pool;
    for (int sgn : {-1, 1}) {
      for (int e = -3; e <= 0; ++e) {
        for (int m = 0; m < 128; ++m) pool.push_back(sgn * std::ldexp(1.0f + m / 128.0f, e));
      }
    }
    std::vector<float> lv;
    for (int r = 0; r < rows; ++r) {
      std::shuffle(pool.begin(), pool.end(), rng.g);
      lv.insert(lv.end(), pool.begin(), pool.begin() + c.E);
    }
    auto logits = mx::astype(mx::array(lv.begin(), {1, rows, c.E}, mx::float32), c.dt);
    auto bias = rng.normal({c.E}, 0.05f);
    std::vector<int> mv(c.E);
    for (int i = 0; i < c.E; ++i) mv[i] = (i * 7) % 3 == 0;
    auto mask = mx::array(mv.begin(), {c.E}, mx::int32);
    auto [cpu, gpu] = both([&] {
      k3_array r[3];
      size_t n = 0;
      ok(k3_moe_router(r, 3, &n, h(logits), c.bias ? h(bias) : none(), c.mask ? h(mask) : none(), c.k, c.ng, c.kg,
                       2.5f, c.renorm, kCpu),
         "k3_moe_router");
      std::vector<mx::array> out;
      for (size_t i = 0; i < n; ++i) out.push_back(take(r[i]));
      return out;
    });
    char what[160];
    std::snprintf(what, sizeof what, "router %s E=%d k=%d groups=%d/%d%s%s%s", dname(c.dt), c.E, c.k, c.ng, c.kg,
                  c.renorm ? " renorm" : "", c.bias ? " bias" : "", c.mask ? " mask" : "");
    ++g_cases;
    if (cpu.size() != gpu.size()) {
      std::printf("FAIL %s %s: %zu vs %zu outputs\n", api_name(), what, cpu.size(), gpu.size());
      ++g_failures;
      continue;
    }
    auto ci = values(cpu[0]), gi = values(gpu[0]), cw = values(cpu[1]), gw = values(gpu[1]);
    std::vector<float> cp(ci.size(), 0), gp(gi.size(), 0);
    if (c.mask) cp = values(cpu[2]), gp = values(gpu[2]);
    const double e = c.dt == mx::float32 ? 16 * eps_of(c.dt) : eps_of(c.dt);
    int bad = 0;
    double worst = 0;
    for (int r = 0; r < rows; ++r) {
      auto sorted = [&](const std::vector<float>& ind, const std::vector<float>& w, const std::vector<float>& p) {
        std::vector<std::tuple<float, float, float>> t;
        for (int j = 0; j < c.k; ++j) t.emplace_back(ind[r * c.k + j], w[r * c.k + j], p[r * c.k + j]);
        std::sort(t.begin(), t.end());
        return t;
      };
      auto a = sorted(ci, cw, cp), b = sorted(gi, gw, gp);
      for (int j = 0; j < c.k; ++j) {
        const auto [ia, wa, pa] = a[j];
        const auto [ib, wb, pb] = b[j];
        const double tol = e * std::fabs(wa) + 1e-7;
        worst = std::max(worst, std::fabs((double)wa - wb) / tol);
        if (ia != ib || pa != pb || !(std::fabs((double)wa - wb) <= tol)) ++bad;
      }
    }
    if (bad) {
      std::printf("FAIL %s %s: %d of %d (expert, weight, protected) entries differ\n", api_name(), what, bad, rows * c.k);
      ++g_failures;
    } else {
      std::printf("ok   %s %s: %d rows, same experts, weights within %.3f of the tolerance\n", api_name(), what, rows, worst);
    }
  }
}

// Attention-residual mix. Both paths form K+1 logits as D-term f32 dot products (different summation orders:
// each within D * eps * sum_d |b_d w_d| of the exact one, times the row's inv_rms), softmax them, and sum
// K+1 weighted rows. A logit error L moves the softmax weights by at most 2L in total, so the output moves by
// at most 2 L * max_k |v_kd| plus the final sum's rounding (K+2) eps max_k |v_kd|; the tolerance is twice that
// bound (L computed from the case's data), plus 1 ulp of the output type for f16/bf16.
void check_attn_res() {
  struct Case {
    mx::Dtype dt;
    int K, D;
  };
  const Case cases[] = {{mx::float32, 4, 300}, {mx::float16, 4, 300}, {mx::bfloat16, 4, 300}, {mx::float32, 1, 64},
                        {mx::float32, 16, 1000}};
  Rng rng(3);
  for (const auto& c : cases) {
    const mx::Shape tok{2, 3};
    auto raw = rng.normal({c.K, 2, 3, c.D}, 1.0f, c.dt), partial = rng.normal({2, 3, c.D}, 1.0f, c.dt);
    auto w_eff = rng.normal({c.D}, 0.2f);
    auto inv_rms = mx::rsqrt(mx::add(mx::mean(mx::square(mx::astype(raw, mx::float32)), -1), mx::array(1e-6f)));
    auto [cpu, gpu] = both([&] {
      k3_array r;
      ok(k3_attn_res_mix(&r, h(raw), h(inv_rms), h(partial), h(w_eff), 1e-6f, kCpu), "k3_attn_res_mix");
      return std::vector<mx::array>{take(r)};
    });
    // The bound's ingredients, per token n: L_n and max_k |v_knd| (v = the K rows and the partial).
    auto rv = values(raw), pv = values(partial), wv = values(w_eff), iv = values(inv_rms);
    const int N = 6;
    const double e32 = eps_of(mx::float32);
    std::vector<double> L(N, 0.0);
    for (int n = 0; n < N; ++n) {
      double pp = 0;
      for (int d = 0; d < c.D; ++d) pp += (double)pv[n * c.D + d] * pv[n * c.D + d];
      const double p_inv = 1.0 / std::sqrt(pp / c.D + 1e-6);
      for (int k = 0; k <= c.K; ++k) {
        double s = 0;
        for (int d = 0; d < c.D; ++d) {
          const float v = k < c.K ? rv[((size_t)k * N + n) * c.D + d] : pv[n * c.D + d];
          s += std::fabs((double)v * wv[d]);
        }
        // The partial's logit also carries the rounding of its own rms (another D-term sum).
        L[n] = std::max(L[n], c.D * e32 * s * (k < c.K ? iv[k * N + n] : 2 * p_inv));
      }
    }
    const double e_out = c.dt == mx::float32 ? 0.0 : eps_of(c.dt);
    compare(std::string("attn_res ") + dname(c.dt) + " K=" + std::to_string(c.K) + " D=" + std::to_string(c.D),
            cpu[0], gpu[0], [&](size_t i, double r) {
              const size_t n = i / c.D, d = i % c.D;
              double vmax = std::fabs(pv[n * c.D + d]);
              for (int k = 0; k < c.K; ++k) vmax = std::max(vmax, (double)std::fabs(rv[((size_t)k * N + n) * c.D + d]));
              return 2 * (2 * L[n] + (c.K + 2) * e32) * vmax + e_out * std::fabs(r) + 1e-7;
            });
  }
}

// KDA decode step. The conv state update is a copy: exact. The state and the output come from D-term f32 dot
// products and the same elementwise math in both paths (different orders and exp implementations); a
// relative 64 D eps of the largest magnitude (the few-ulp elementwise differences, amplified by at most D-term
// sums twice: kv = S k, y = S q, and the RMS norm that divides by an f32 sum of D squares) bounds it. The output
// is rounded through the activation type twice (y, then the result): 2 ulp of it for f16/bf16.
void check_kda_step() {
  struct Case {
    mx::Dtype dt;
    int B, H, d, Kc;
    bool lb, conv, ssm;
  };
  const Case cases[] = {{mx::float32, 2, 3, 64, 4, false, true, true}, {mx::float16, 1, 2, 128, 4, false, true, true},
                        {mx::bfloat16, 2, 2, 32, 4, true, true, true}, {mx::float32, 1, 2, 16, 1, true, false, false},
                        {mx::float32, 2, 2, 32, 3, false, false, true}};
  Rng rng(4);
  for (const auto& c : cases) {
    const int P = c.H * c.d;
    auto qkv = rng.normal({c.B, 1, 3 * P}, 1.0f, c.dt), a = rng.normal({c.B, 1, c.H, c.d}, 1.0f, c.dt);
    auto b = rng.normal({c.B, 1, c.H}, 1.0f, c.dt), gate = rng.normal({c.B, 1, c.H, c.d}, 1.0f, c.dt);
    auto conv_w = rng.normal({3 * P, c.Kc, 1}, 0.5f), a_log = rng.normal({c.H}, 0.5f);
    auto dt_bias = rng.normal({P}, 0.5f), norm_w = mx::add(rng.normal({c.d}, 0.1f), mx::array(1.0f));
    auto conv_state = rng.normal({c.B, c.Kc - 1, 3 * P}, 1.0f, c.dt), ssm = rng.normal({c.B, c.H, c.d, c.d}, 0.3f);
    auto [cpu, gpu] = both([&] {
      k3_array r[3];
      size_t n = 0;
      ok(k3_kda_step(r, 3, &n, h(qkv), h(a), h(b), h(gate), h(conv_w), h(a_log), h(dt_bias), h(norm_w),
                     c.conv ? h(conv_state) : none(), c.ssm ? h(ssm) : none(), c.H, c.d, c.lb, -5.0f, 1e-5f, kCpu),
         "k3_kda_step");
      std::vector<mx::array> out;
      for (size_t i = 0; i < n; ++i) out.push_back(take(r[i]));
      return out;
    });
    char what[160];
    std::snprintf(what, sizeof what, "kda_step %s B=%d H=%d d=%d Kc=%d%s%s%s", dname(c.dt), c.B, c.H, c.d, c.Kc,
                  c.lb ? " lower_bound" : "", c.conv ? " conv_state" : "", c.ssm ? " ssm_state" : "");
    const double rel = 64.0 * c.d * eps_of(mx::float32);
    const double out_max = max_abs(cpu[0]), ssm_max = max_abs(cpu[2]);
    const double e_out = c.dt == mx::float32 ? 0.0 : 2 * eps_of(c.dt);
    compare(std::string(what) + " out", cpu[0], gpu[0],
            [&](size_t, double r) { return rel * out_max + e_out * std::fabs(r) + 1e-7; });
    compare(std::string(what) + " conv state", cpu[1], gpu[1], [](size_t, double) { return 0.0; });
    compare(std::string(what) + " ssm state", cpu[2], gpu[2], [&](size_t, double) { return rel * ssm_max + 1e-7; });
  }
}

// The residual mix and the KDA step have no Metal kernel: their GPU branch must say so (an error naming the
// missing kernel), not run something else.
void check_no_metal_kernel() {
  Rng rng(11);
  auto expect_refusal = [](const char* what, const std::function<int()>& call) {
    ++g_cases;
    k3::kernels::gpu_branch_on_cpu = true;
    const int rc = call();
    k3::kernels::gpu_branch_on_cpu = false;
    const std::string msg = rc != 0 ? k3_last_error() : "";
    if (rc != 0 && msg.find("no Metal kernel") != std::string::npos) {
      std::printf("ok   %s %s: refused (%s)\n", api_name(), what, msg.c_str());
    } else {
      std::printf("FAIL %s %s: %s\n", api_name(), what, rc == 0 ? "ran" : msg.c_str());
      ++g_failures;
    }
  };
  auto raw = rng.normal({2, 1, 3, 64}, 1.0f), partial = rng.normal({1, 3, 64}, 1.0f), w_eff = rng.normal({64}, 0.2f);
  auto inv_rms = mx::ones({2, 1, 3});
  expect_refusal("attn_res without a Metal kernel", [&] {
    k3_array r;
    return k3_attn_res_mix(&r, h(raw), h(inv_rms), h(partial), h(w_eff), 1e-6f, kCpu);
  });
  const int H = 2, d = 16, P = H * d;
  auto qkv = rng.normal({1, 1, 3 * P}, 1.0f), a = rng.normal({1, 1, P}, 1.0f), b = rng.normal({1, 1, H}, 1.0f);
  auto gate = rng.normal({1, 1, P}, 1.0f), conv_w = rng.normal({3 * P, 4, 1}, 0.5f), a_log = rng.normal({H}, 0.5f);
  auto dt_bias = rng.normal({P}, 0.5f), norm_w = mx::ones({d});
  expect_refusal("kda_step without a Metal kernel", [&] {
    k3_array r[3];
    size_t n = 0;
    return k3_kda_step(r, 3, &n, h(qkv), h(a), h(b), h(gate), h(conv_w), h(a_log), h(dt_bias), h(norm_w), none(),
                       none(), H, d, false, 0.0f, 1e-5f, kCpu);
  });
}

}  // namespace

// A random expert stack of each format (every bit pattern of codes, qh, fp4 nibbles and affine codes is a valid
// weight), and the largest "magnitude factor" W of any weight: the bound on |w| that the summation-order
// tolerance scales with (codebook |d| (2L + 1) 1.125; MXFP4 6 * 2^(e - 127); affine |scale| (2^bits - 1) + |bias|,
// the two terms the paths sum separately).
struct Stacks {
  std::vector<mx::array> cb, fp4, aff;
  double wmax = 0;
};

Stacks random_stacks(std::mt19937& g, Rng& rng, int n_cb, int n_fp4, int n_aff, int N, int K, int bits, int group,
                     mx::Dtype st) {
  Stacks s;
  auto bytes = [&](size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(g());
    return v;
  };
  if (n_cb) {
    const int sb = (K + 255) / 256;
    auto codes = bytes((size_t)n_cb * N * K / 8);
    std::vector<uint16_t> qh((size_t)n_cb * N * K / 32);
    for (auto& v : qh) v = static_cast<uint16_t>(g());
    auto scales = mx::astype(rng.normal({n_cb, N, sb}, 0.02f), mx::float16);
    auto sc = values(scales);
    for (size_t r = 0; r < (size_t)n_cb * N; ++r) {
      for (int b = 0; b < K / 32; ++b) {
        const int L = (qh[r * (K / 32) + b] >> 12) & 7;
        s.wmax = std::max(s.wmax, std::fabs(sc[r * sb + b / 8]) * (2 * L + 1) * 1.125);
      }
    }
    s.cb = {mx::array(codes.begin(), {n_cb, N, K / 8}, mx::uint8), mx::array(qh.begin(), {n_cb, N, K / 32}, mx::uint16),
            scales};
  }
  if (n_fp4) {
    std::vector<uint32_t> w((size_t)n_fp4 * N * K / 8);
    for (auto& v : w) v = g();
    std::vector<uint8_t> e((size_t)n_fp4 * N * K / 32);
    for (auto& v : e) {
      v = static_cast<uint8_t>(121 + g() % 6);
      s.wmax = std::max(s.wmax, 6 * std::ldexp(1.0, v - 127));
    }
    s.fp4 = {mx::array(w.begin(), {n_fp4, N, K / 8}, mx::uint32), mx::array(e.begin(), {n_fp4, N, K / 32}, mx::uint8)};
  }
  if (n_aff) {
    std::vector<uint32_t> w((size_t)n_aff * N * K * bits / 32);
    for (auto& v : w) v = g();
    auto scales = rng.normal({n_aff, N, K / group}, 0.02f, st), biases = rng.normal({n_aff, N, K / group}, 0.05f, st);
    double smax = max_abs(scales), bmax = max_abs(biases);
    s.wmax = std::max(s.wmax, smax * ((1 << bits) - 1) + bmax);
    s.aff = {mx::array(w.begin(), {n_aff, N, K * bits / 32}, mx::uint32), scales, biases};
  }
  return s;
}

// Per output row (the result's rows of N), sum_k |x_k| of the x row it reads, for pairs (b, e) given in order.
std::vector<double> pair_row_abs(const mx::array& x, int M, const std::vector<int>& b_of_pair) {
  const int K = x.shape(-1);
  const auto xs = values(x);
  std::vector<double> out;
  for (int b : b_of_pair) {
    for (int m = 0; m < M; ++m) {
      double a = 0;
      for (int k = 0; k < K; ++k) a += std::fabs(xs[((size_t)b * M + m) * K + k]);
      out.push_back(a);
    }
  }
  return out;
}

// Codebook matmul: random codes, qh (every bit pattern is a valid block: index bits, scale, delta sign) and f16
// super-block scales; both paths decode the same weights exactly and sum K products in different orders, so
// |diff| <= 2 K eps Wmax sum_k |x_mk| per row m (the worst case for two f32 sums of the same terms), with Wmax
// the largest |weight| (|d| (2L + 1) 1.125 over the blocks). K = 96 ends inside its only super-block.
void check_codebook() {
  struct Case {
    mx::Shape x;
    int N;
  };
  const Case cases[] = {{{1, 512}, 64}, {{3, 96}, 7}, {{1, 5, 1024}, 33}, {{2, 256}, 1}};
  std::mt19937 g(5);
  Rng rng(6);
  for (const auto& c : cases) {
    const int K = c.x.back(), N = c.N;
    const auto st = random_stacks(g, rng, 1, 0, 0, N, K, 0, 0, mx::float32);
    std::vector<mx::array> w;  // the one expert as [N, ...]
    for (const auto& a : st.cb) w.push_back(mx::squeeze(a, 0));
    const double wmax = st.wmax;
    auto x = rng.normal(c.x, 1.0f);
    auto [cpu, gpu] = both([&] {
      k3_array r;
      ok(k3_codebook_qmm(&r, h(x), h(w[0]), h(w[1]), h(w[2]), kCpu), "k3_codebook_qmm");
      return std::vector<mx::array>{take(r)};
    });
    const auto row_abs = pair_row_abs(x, static_cast<int>(x.size() / K), {0});
    const double e = 2.0 * K * eps_of(mx::float32) * wmax;
    compare("codebook_qmm x=" + k3::shape_str(c.x) + " N=" + std::to_string(N), cpu[0], gpu[0],
            [&](size_t i, double) { return e * row_abs[i / N]; });
  }
}

// Gathered codebook matmul. Pairs: the model's form (x [T, 1, 1, K], rhs [T, k], no lhs: token t's row for each of
// its k experts), and explicit lhs and rhs over x [2, 3, K] (M = 3). Both paths decode the same weights and sum
// K products in different orders: the codebook_qmm tolerance per output row. One case caps the grid's y extent at 3
// blocks so the kernel's loop over rows runs. An out-of-range expert index: the CPU raises; the kernel leaves
// NaN in exactly that pair's rows and the right values elsewhere.
void check_gather_codebook() {
  std::mt19937 g(7);
  Rng rng(8);
  struct Case {
    int E, N, K, T, k;  // model form when T > 0
    int y_limit;
  };
  const Case cases[] = {{6, 40, 512, 5, 3, 65535}, {3, 17, 96, 4, 2, 3}, {5, 24, 256, 0, 0, 65535}};
  for (const auto& c : cases) {
    auto st = random_stacks(g, rng, c.E, 0, 0, c.N, c.K, 0, 0, mx::float32);
    mx::array x = mx::array(0.0f), rhs = mx::array(0u);
    std::optional<mx::array> lhs;
    std::vector<int> b_of_pair;  // each pair's x row block
    int M = 1;
    if (c.T > 0) {
      x = rng.normal({c.T, 1, 1, c.K}, 1.0f);
      std::vector<uint32_t> r(c.T * c.k);
      for (int t = 0; t < c.T; ++t) {
        for (int j = 0; j < c.k; ++j) {
          r[t * c.k + j] = g() % c.E;
          b_of_pair.push_back(t);
        }
      }
      rhs = mx::array(r.begin(), {c.T, c.k}, mx::uint32);
    } else {
      M = 3;
      x = rng.normal({2, M, c.K}, 1.0f);
      std::vector<uint32_t> l{1, 0, 1, 1}, r{4, 2, 0, 2};
      b_of_pair.assign(l.begin(), l.end());
      lhs = mx::array(l.begin(), {4}, mx::uint32);
      rhs = mx::array(r.begin(), {4}, mx::uint32);
    }
    auto call = [&](const mx::array& rh) {
      k3_array r;
      ok(k3_gather_codebook_qmm(&r, h(x), h(st.cb[0]), h(st.cb[1]), h(st.cb[2]), lhs ? h(*lhs) : none(), h(rh), kCpu),
         "k3_gather_codebook_qmm");
      return std::vector<mx::array>{take(r)};
    };
    k3::kernels::gpu_grid_y_limit = c.y_limit;
    auto [cpu, gpu] = both([&] { return call(rhs); });
    k3::kernels::gpu_grid_y_limit = 65535;
    const auto row_abs = pair_row_abs(x, M, b_of_pair);
    const double e = 2.0 * c.K * eps_of(mx::float32) * st.wmax;
    char what[160];
    std::snprintf(what, sizeof what, "gather_codebook_qmm E=%d N=%d K=%d pairs=%zu M=%d%s%s", c.E, c.N, c.K,
                  b_of_pair.size(), M, lhs ? " lhs" : "", c.y_limit < 65535 ? " grid_y=3" : "");
    compare(what, cpu[0], gpu[0], [&](size_t i, double) { return e * row_abs[i / c.N]; });

    // Pair 1's expert out of range.
    auto rv = values(rhs);
    std::vector<uint32_t> bad(rv.begin(), rv.end());
    bad[1] = c.E;
    auto bad_a = mx::array(bad.begin(), rhs.shape(), mx::uint32);
    ++g_cases;
    k3::kernels::gpu_branch_on_cpu = false;
    k3_array r;
    const int rc = k3_gather_codebook_qmm(&r, h(x), h(st.cb[0]), h(st.cb[1]), h(st.cb[2]), lhs ? h(*lhs) : none(),
                                          h(bad_a), kCpu);
    bool cpu_raised = rc != 0;
    if (rc == 0) {
      auto y = take(r);
      try {
        mx::eval(y);
      } catch (const std::exception&) {
        cpu_raised = true;
      }
    }
    k3::kernels::gpu_branch_on_cpu = true;
    auto y = call(bad_a)[0];
    k3::kernels::gpu_branch_on_cpu = false;
    const auto yb = values(y), yr = values(gpu[0]);
    size_t wrong = 0;
    for (size_t i = 0; i < yb.size(); ++i) {
      const bool in_bad_pair = i / ((size_t)M * c.N) == 1;
      if (in_bad_pair ? !std::isnan(yb[i]) : !(yb[i] == yr[i])) ++wrong;
    }
    if (!cpu_raised || wrong) {
      std::printf("FAIL %s %s, expert index out of range: cpu %s, %zu of %zu kernel outputs wrong\n", api_name(), what,
                  cpu_raised ? "raised" : "did not raise", wrong, yb.size());
      ++g_failures;
    } else {
      std::printf("ok   %s %s, expert index out of range: cpu raised, kernel NaN in that pair's %d rows only\n", api_name(), what, M);
    }
  }
}

// Mixed-tier expert stacks: each expert's tier drawn from the present ones, slots in order within each tier. The
// CPU path runs each pair on its tier's CPU kernel (SIMD where this CPU has it), the kernel decodes each
// format itself: the same weights, summed in different orders, so the codebook tolerance with W the largest
// magnitude factor of any tier's weights. Affine widths 2-8 bits (3, 5 and 6 straddle bytes), group sizes
// 32-128, f32/f16/bf16 scales; stacks without some tiers.
void check_tiered() {
  std::mt19937 g(9);
  Rng rng(10);
  struct Case {
    bool cb, fp4, aff;
    int bits, group;
    mx::Dtype st;
    int K;
  };
  const Case cases[] = {{true, true, true, 4, 64, mx::float32, 256},   {true, true, true, 2, 32, mx::float16, 256},
                        {true, true, true, 3, 64, mx::float32, 256},   {true, true, true, 5, 32, mx::bfloat16, 96},
                        {true, true, true, 6, 128, mx::float32, 256},  {true, true, true, 8, 64, mx::bfloat16, 512},
                        {true, true, false, 4, 64, mx::float32, 256},  {false, false, true, 4, 128, mx::float16, 256},
                        {false, true, false, 4, 64, mx::float32, 96}};
  const int E = 9, N = 24, T = 4, k = 4;
  for (const auto& c : cases) {
    std::vector<int> present;
    if (c.cb) present.push_back(0);
    if (c.fp4) present.push_back(1);
    if (c.aff) present.push_back(2);
    std::vector<uint8_t> tier(E);
    std::vector<uint32_t> slot(E);
    int count[3] = {0, 0, 0};
    for (int e = 0; e < E; ++e) {
      // Every present tier gets at least one expert (the first ones), the rest at random.
      const int t = e < (int)present.size() ? present[e] : present[g() % present.size()];
      tier[e] = static_cast<uint8_t>(t);
      slot[e] = count[t]++;
    }
    auto st = random_stacks(g, rng, count[0], count[1], count[2], N, c.K, c.bits, c.group, c.st);
    auto x = rng.normal({T, 1, 1, c.K}, 1.0f);
    std::vector<uint32_t> r(T * k);
    std::vector<int> b_of_pair;
    for (int i = 0; i < T * k; ++i) {
      r[i] = i < E ? i : g() % E;  // every expert used
      b_of_pair.push_back(i / k);
    }
    auto rhs = mx::array(r.begin(), {T, k}, mx::uint32);
    auto tier_a = mx::array(tier.begin(), {E}, mx::uint8);
    auto slot_a = mx::array(slot.begin(), {E}, mx::uint32);
    auto arg = [](const std::vector<mx::array>& v, size_t i) { return v.empty() ? none() : h(v[i]); };
    auto [cpu, gpu] = both([&] {
      k3_array res;
      ok(k3_gather_tiered_qmm(&res, h(x), h(tier_a), h(slot_a), arg(st.cb, 0), arg(st.cb, 1), arg(st.cb, 2),
                              arg(st.fp4, 0), arg(st.fp4, 1), arg(st.aff, 0), arg(st.aff, 1), arg(st.aff, 2), c.group,
                              c.bits, none(), h(rhs), kCpu),
         "k3_gather_tiered_qmm");
      return std::vector<mx::array>{take(res)};
    });
    const auto row_abs = pair_row_abs(x, 1, b_of_pair);
    const double e = 2.0 * c.K * eps_of(mx::float32) * st.wmax;
    char what[200];
    std::snprintf(what, sizeof what, "gather_tiered_qmm K=%d experts codebook/mxfp4/affine %d/%d/%d", c.K, count[0],
                  count[1], count[2]);
    std::string desc = what;
    if (c.aff) desc += " affine " + std::to_string(c.bits) + "-bit group " + std::to_string(c.group) + " " + dname(c.st);
    compare(desc, cpu[0], gpu[0], [&](size_t i, double) { return e * row_abs[i / N]; });
  }
}

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr,
                 "usage: %s <c++ compiler> <emulation include dir> <mlx include dir> <scratch dir> [clang++]\n",
                 argv[0]);
    return 2;
  }
  if (argc == 6) g_clang = argv[5];
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  g_cxx = argv[1];
  g_emu_include = argv[2];
  g_mlx_include = argv[3];
  g_scratch = argv[4];
  std::filesystem::create_directories(g_scratch);
  k3_kernels_set_act_q8(0);  // the CPU paths in f32 (int8 activations are an opt-in approximation)
  // One exception (a kernel that does not compile, a deadlock, ...) fails its check function, not the run.
  auto run = [](const char* what, void (*check)()) {
    try {
      check();
    } catch (const std::exception& e) {
      ++g_cases;
      ++g_failures;
      k3::kernels::gpu_branch_on_cpu = false;
      k3::kernels::gpu_grid_y_limit = 65535;
      std::printf("FAIL %s %s: %s\n", api_name(), what, e.what());
    }
  };
  // K3EMU_API=cuda or metal runs one API's checks only (tests/gpu_emulation.rs runs the two in parallel
  // processes: compiling the units is most of the time, one compiler at a time per process).
  const char* only = std::getenv("K3EMU_API");
  const std::string api = only ? only : "";
  if (!api.empty() && api != "cuda" && api != "metal") {
    std::fprintf(stderr, "K3EMU_API must be cuda or metal, not %s\n", api.c_str());
    return 2;
  }
  if (api != "metal") {
    k3::kernels::emulated_gpu_api = GpuApi::cuda;
    run("situ", check_situ);
    run("router", check_router);
    run("attn_res", check_attn_res);
    run("kda_step", check_kda_step);
    run("codebook", check_codebook);
    run("gather_codebook", check_gather_codebook);
    run("tiered", check_tiered);
  }
  const int cuda_cases = g_cases, cuda_failures = g_failures;
  if (api != "cuda") {
    k3::kernels::emulated_gpu_api = GpuApi::metal;
    run("situ", check_situ);
    run("router", check_router);
    run("no Metal kernel", check_no_metal_kernel);
    run("codebook", check_codebook);
    run("gather_codebook", check_gather_codebook);
    run("tiered", check_tiered);
  }
  // "gpu_emulation: P of N cases passed (...)": tests/gpu_emulation.rs reads P and N, and the CUDA and Metal
  // counts in the parentheses.
  std::printf("gpu_emulation: %d of %d cases passed (cuda %d of %d, metal %d of %d; %d kernel launches, %d compiled "
              "units, %d Metal units address-space checked)\n",
              g_cases - g_failures, g_cases, cuda_cases - cuda_failures, cuda_cases,
              (g_cases - cuda_cases) - (g_failures - cuda_failures), g_cases - cuda_cases, g_launches, g_compiles,
              g_as_checks);
  return g_failures ? 1 : 0;
}
