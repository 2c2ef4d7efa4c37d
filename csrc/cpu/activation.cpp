// SiLU-and-mul on the CPU: out = silu(x[..., :d]) * x[..., d:], one pass.
//
// vLLM twin: csrc/cpu/activation.cpp (`silu_and_mul`). Read it for the gated MLP's
// middle step in one loop instead of torch's slice, silu, multiply (three dispatches and
// a temporary per call).
//
// Simpler than vLLM: float32 only. std::exp may differ from torch's vectorised exp in
// the last bit, so results match forward_native to float rounding, not bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

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
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = x + i * 2 * d;
      const float* up = gate + d;
      float* o = y + i * d;
      for (int64_t j = 0; j < d; ++j) o[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
    }
  });
}

}  // namespace

void register_activation(pybind11::module& m) {
  m.def("silu_and_mul", &silu_and_mul, "out = silu(input[..., :d]) * input[..., d:] (float32)");
}
