// SiLU-and-mul on the CPU: out = silu(x[..., :d]) * x[..., d:], one pass.
//
// vLLM twin: csrc/cpu/activation.cpp (`silu_and_mul`). Read it for the gated MLP's
// middle step in one loop instead of torch's slice, silu, multiply (three dispatches and
// a temporary per call).
//
// Simpler than vLLM: float32 only. The exp below differs from torch's vectorised one in
// the last bits, so results match forward_native to float rounding, not bit for bit.
// Sessions: 06 (kernel fusion). Built by engine/_cpu_ops.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.hpp"

#include <cstdint>

namespace {

// exp(x) in a form the compiler vectorises (std::exp in a loop stays a scalar call):
// x = n*ln2 + r with |r| <= ln2/2, exp(r) by Cephes' degree-6 polynomial, 2^n from the
// exponent bits. Only arithmetic and selects, no calls or branches, so the loop below
// vectorises. Within ~2 ulp of std::exp; x is clamped so that 2^n neither overflows nor
// goes denormal (silu's results out there are 0 or x anyway).
inline float exp_vectorisable(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;  // round(x / ln2)
  float r = x - n * 0.693359375f;  // ln2 in two parts (Cody-Waite), so r is exact
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // the float 2^n
  return p * __builtin_bit_cast(float, bits);
}

void silu_and_mul(torch::Tensor out, torch::Tensor input) {
  TORCH_CHECK(input.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "silu_and_mul: float32 only");
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(), "silu_and_mul: contiguous tensors only");
  const int64_t d = out.size(-1);
  TORCH_CHECK(input.size(-1) == 2 * d, "input's last dim must be twice out's, got ", input.size(-1),
              " and ", d);
  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  TORCH_CHECK(input.numel() == rows * 2 * d, "input and out disagree on the number of rows");
  const float* x = input.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(3 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = x + i * 2 * d;
      const float* up = gate + d;
      float* o = y + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = gate[j] / (1.f + exp_vectorisable(-gate[j])) * up[j];
    }
  });
}

}  // namespace

void register_activation(pybind11::module& m) {
  m.def("silu_and_mul", &silu_and_mul, "out = silu(input[..., :d]) * input[..., d:] (float32)");
}
