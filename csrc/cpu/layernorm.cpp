// RMSNorm and fused residual-add + RMSNorm on the CPU, one pass per row.
//
// vLLM twin: csrc/cpu/layernorm.cpp (`rms_norm`, `fused_add_rms_norm`). Read it for why
// these exist at all: at decode a row is a few hundred floats, so the torch version's
// cost is its ~7 op dispatches per call, not arithmetic; one C++ call does the row's
// sum of squares and the scaling in two loops.
//
// Simpler than vLLM: float32 only, and the compiler's vectorisation instead of
// hand-written vector types. The sum of squares is accumulated in another order than
// torch's, so results differ from forward_native by float rounding (~1e-7 relative).
// Sessions: 06 (kernel fusion). Built by engine/_cpu_ops.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.hpp"

#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dim must be contiguous");
}

// Rows of a tensor viewed as [rows, hidden] with a row stride (views of wider tensors work).
struct Rows {
  float* data;
  int64_t num, hidden, stride;
};

Rows as_rows(torch::Tensor& t) {
  const int64_t hidden = t.size(-1);
  const int64_t num = hidden == 0 ? 0 : t.numel() / hidden;
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2 || t.is_contiguous(),
              "tensors of more than 2 dims must be contiguous");
  const int64_t stride = t.dim() == 2 ? t.stride(0) : hidden;
  return {t.data_ptr<float>(), num, hidden, stride};
}

// The weight's data, or nullptr for a norm without one (after checking it fits the rows).
const float* weight_data(const c10::optional<torch::Tensor>& weight, int64_t hidden) {
  if (!weight.has_value() || !weight->defined()) return nullptr;
  check_rows(*weight, "weight");
  TORCH_CHECK(weight->numel() == hidden, "weight must have ", hidden, " elements, got ", weight->numel());
  return weight->data_ptr<float>();
}

// y = x * r * w (or x * r without a weight), one row.
inline void scale_row(float* y, const float* x, float r, const float* w, int64_t hidden) {
  if (w != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) y[j] = (x[j] * r) * w[j];
  } else {
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) y[j] = x[j] * r;
  }
}

inline float inv_rms(const float* x, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < hidden; ++j) sum += x[j] * x[j];
  return 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
}

// out = input * rsqrt(mean(input^2) + eps) * weight   (weight may be undefined: no scale)
void rms_norm(torch::Tensor out, torch::Tensor input, c10::optional<torch::Tensor> weight,
              double epsilon) {
  check_rows(out, "out");
  check_rows(input, "input");
  TORCH_CHECK(out.sizes() == input.sizes(), "out and input must have the same shape");
  Rows in = as_rows(input), o = as_rows(out);
  const float* w = weight_data(weight, in.hidden);
  const float eps = static_cast<float>(epsilon);
  at::parallel_for(0, in.num, grain_for(in.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = in.data + i * in.stride;
      scale_row(o.data + i * o.stride, x, inv_rms(x, in.hidden, eps), w, in.hidden);
    }
  });
}

// In place: residual += input; input = rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor input, torch::Tensor residual,
                        c10::optional<torch::Tensor> weight, double epsilon) {
  check_rows(input, "input");
  check_rows(residual, "residual");
  TORCH_CHECK(input.sizes() == residual.sizes(), "input and residual must have the same shape, got ",
              input.sizes(), " and ", residual.sizes());
  Rows x = as_rows(input), res = as_rows(residual);
  const float* w = weight_data(weight, x.hidden);
  const float eps = static_cast<float>(epsilon);
  at::parallel_for(0, x.num, grain_for(x.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = x.data + i * x.stride;
      float* ri = res.data + i * res.stride;
#pragma omp simd
      for (int64_t j = 0; j < x.hidden; ++j) ri[j] += xi[j];
      scale_row(xi, ri, inv_rms(ri, x.hidden, eps), w, x.hidden);
    }
  });
}

}  // namespace

void register_layernorm(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row into out (float32)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += input; input = RMSNorm(residual), in place (float32)");
}
