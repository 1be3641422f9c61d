// Safetensors I/O and distributed communication.
#include <algorithm>
#include <unordered_map>

#include "k3_internal.hpp"

namespace mx = mlx::core;
namespace dist = mlx::core::distributed;
using k3::arr;
using k3::put;
using k3::stream;

namespace {

struct Safetensors {
  std::unordered_map<std::string, mx::array> arrays;
  std::vector<std::string> keys;  // sorted
  std::vector<std::pair<std::string, std::string>> metadata;  // sorted by key
};

Safetensors& st_of(const k3_safetensors st) {
  if (st.ctx == nullptr) throw std::invalid_argument("[safetensors] null handle");
  return *static_cast<Safetensors*>(st.ctx);
}

std::optional<dist::Group> group_of(const k3_group g) {
  if (g.ctx == nullptr) return std::nullopt;
  return *static_cast<dist::Group*>(g.ctx);
}

}  // namespace

extern "C" int k3_safetensors_load(k3_safetensors* res, const char* path, const k3_stream s) {
  K3_TRY({
    auto [arrays, meta] = mx::load_safetensors(std::string(path), stream(s));
    auto out = std::make_unique<Safetensors>();
    out->arrays = std::move(arrays);
    for (auto& [k, _] : out->arrays) out->keys.push_back(k);
    std::sort(out->keys.begin(), out->keys.end());
    out->metadata.assign(meta.begin(), meta.end());
    std::sort(out->metadata.begin(), out->metadata.end());
    res->ctx = out.release();
  })
}

extern "C" int k3_safetensors_free(k3_safetensors st) {
  delete static_cast<Safetensors*>(st.ctx);
  return 0;
}

extern "C" int k3_safetensors_len(size_t* res, const k3_safetensors st) {
  K3_TRY(*res = st_of(st).keys.size())
}

extern "C" int k3_safetensors_key(const char** res, const k3_safetensors st, size_t i) {
  K3_TRY(*res = st_of(st).keys.at(i).c_str())
}

extern "C" int k3_safetensors_get(k3_array* res, const k3_safetensors st, const char* key) {
  K3_TRY({
    auto& m = st_of(st).arrays;
    auto it = m.find(key);
    if (it == m.end()) throw std::out_of_range(std::string("[safetensors] no tensor named '") + key + "'");
    put(res, it->second);
  })
}

extern "C" int k3_safetensors_metadata_len(size_t* res, const k3_safetensors st) {
  K3_TRY(*res = st_of(st).metadata.size())
}

extern "C" int k3_safetensors_metadata_entry(const char** key, const char** value, const k3_safetensors st,
                                             size_t i) {
  K3_TRY({
    auto& e = st_of(st).metadata.at(i);
    *key = e.first.c_str();
    *value = e.second.c_str();
  })
}

extern "C" int k3_safetensors_save(const char* path, const char* const* keys, const k3_array* arrays, size_t n,
                                   const char* const* meta_keys, const char* const* meta_values, size_t n_meta) {
  K3_TRY({
    std::unordered_map<std::string, mx::array> m;
    for (size_t i = 0; i < n; ++i) m.insert_or_assign(keys[i], arr(arrays[i]));
    std::unordered_map<std::string, std::string> meta;
    for (size_t i = 0; i < n_meta; ++i) meta[meta_keys[i]] = meta_values[i];
    mx::save_safetensors(std::string(path), std::move(m), std::move(meta));
  })
}

// ---------------------------------------------------------------- distributed

extern "C" int k3_distributed_is_available(bool* res, const char* backend) {
  K3_TRY(*res = backend ? dist::is_available(backend) : dist::is_available())
}

extern "C" int k3_distributed_init(k3_group* res, bool strict, const char* backend) {
  K3_TRY({
    auto g = dist::init(strict, backend ? backend : "any");
    res->ctx = new dist::Group(std::move(g));
  })
}

extern "C" int k3_group_free(k3_group g) {
  delete static_cast<dist::Group*>(g.ctx);
  return 0;
}

extern "C" int k3_group_rank(int* res, const k3_group g) {
  K3_TRY({
    auto grp = group_of(g);
    *res = grp ? grp->rank() : dist::init(false).rank();
  })
}

extern "C" int k3_group_size(int* res, const k3_group g) {
  K3_TRY({
    auto grp = group_of(g);
    *res = grp ? grp->size() : dist::init(false).size();
  })
}

extern "C" int k3_group_split(k3_group* res, const k3_group g, int color, int key) {
  K3_TRY({
    auto grp = group_of(g);
    if (!grp) throw std::invalid_argument("[group_split] a group is required");
    res->ctx = new dist::Group(grp->split(color, key));
  })
}

extern "C" int k3_all_sum(k3_array* res, const k3_array x, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::all_sum(arr(x), group_of(g), stream(s))))
}

extern "C" int k3_all_gather(k3_array* res, const k3_array x, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::all_gather(arr(x), group_of(g), stream(s))))
}

extern "C" int k3_all_max(k3_array* res, const k3_array x, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::all_max(arr(x), group_of(g), stream(s))))
}

extern "C" int k3_all_min(k3_array* res, const k3_array x, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::all_min(arr(x), group_of(g), stream(s))))
}

extern "C" int k3_send(k3_array* res, const k3_array x, int dst, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::send(arr(x), dst, group_of(g), stream(s))))
}

extern "C" int k3_recv(k3_array* res, const int32_t* shape, size_t ndim, k3_dtype dtype, int src,
                       const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::recv(k3::shape(shape, ndim), k3::dtype(dtype), src, group_of(g), stream(s))))
}

extern "C" int k3_recv_like(k3_array* res, const k3_array x, int src, const k3_group g, const k3_stream s) {
  K3_TRY(put(res, dist::recv_like(arr(x), src, group_of(g), stream(s))))
}
