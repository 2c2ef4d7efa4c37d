// Rotary position embedding on the CPU, in place on query and key.
//
// vLLM twin: csrc/cpu/pos_encoding.cpp (`rotary_embedding`). Read it for RoPE as one
// loop over tokens and heads: token t rotates feature pairs of every head by the
// angles in row positions[t] of cos_sin_cache ([max_position, rotary_dim], the cos
// half then the sin half). Neox style pairs feature j with j + rotary_dim/2; GPT-J
// style pairs 2j with 2j+1. Features past rotary_dim (partial RoPE) are left alone.
//
// Simpler than vLLM: float32 only. Built with -ffp-contract=off, so each product and
// sum rounds as torch's separate ops do (x1*cos - x2*sin, x2*cos + x1*sin).
// Sessions: 06 (kernel fusion).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.hpp"

namespace {

void rotate(float* x, const float* cos, const float* sin, int64_t half, bool is_neox) {
  if (is_neox) {
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = x[j], x2 = x[j + half];
      x[j] = x1 * cos[j] - x2 * sin[j];
      x[j + half] = x2 * cos[j] + x1 * sin[j];
    }
  } else {
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = x[2 * j], x2 = x[2 * j + 1];
      x[2 * j] = x1 * cos[j] - x2 * sin[j];
      x[2 * j + 1] = x2 * cos[j] + x1 * sin[j];
    }
  }
}

// query: [T, H * head_size] or [T, H, head_size] (rows may be strided, heads contiguous
// within a row); key likewise or undefined; positions: [T] int64.
void rotary_embedding(torch::Tensor positions, torch::Tensor query, c10::optional<torch::Tensor> key,
                      int64_t head_size, torch::Tensor cos_sin_cache, bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == torch::kLong, "positions must be int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous float32 tensor");
  const int64_t rot_dim = cos_sin_cache.size(1), half = rot_dim / 2;
  TORCH_CHECK(rot_dim <= head_size && rot_dim % 2 == 0, "rotary_dim must be even and <= head_size");
  torch::Tensor pos = positions.reshape({-1}).contiguous();
  const int64_t T = pos.size(0);
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " is outside [0, ", max_pos, ")");
  }
  const float* cache = cos_sin_cache.data_ptr<float>();
  auto apply = [&](torch::Tensor& x, const char* name) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, name, " must be float32");
    TORCH_CHECK(x.size(0) == T, name, " has ", x.size(0), " tokens, positions ", T);
    TORCH_CHECK(x.stride(-1) == 1, name, ": the last dim must be contiguous");
    const int64_t row_elems = x.numel() / (T == 0 ? 1 : T);
    TORCH_CHECK(row_elems % head_size == 0, name, "'s row is not a whole number of heads");
    if (x.dim() == 3) TORCH_CHECK(x.stride(1) == head_size, name, ": heads must be contiguous in a row");
    const int64_t heads = row_elems / head_size, row_stride = x.stride(0);
    float* data = x.data_ptr<float>();
    at::parallel_for(0, T, grain_for(heads * head_size), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cache + p[t] * rot_dim;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) rotate(data + t * row_stride + h * head_size, cos, sin, half, is_neox);
      }
    });
  };
  apply(query, "query");
  if (key.has_value() && key->defined()) apply(*key, "key");
}

}  // namespace

void register_pos_encoding(pybind11::module& m) {
  m.def("rotary_embedding", &rotary_embedding, "RoPE on query and key, in place (float32)");
}
