// The Python module of the CPU kernels: one registration function per source file.
//
// vLLM twin: csrc/cpu/torch_bindings.cpp (which registers `torch.ops._C` ops; ours is a
// plain pybind11 module loaded by engine/_cpu_ops.py).
// Sessions: 05, 06. Built by engine/_cpu_ops.py.

#include <torch/extension.h>

void register_attention(pybind11::module& m);
void register_layernorm(pybind11::module& m);
void register_activation(pybind11::module& m);
void register_pos_encoding(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_attention(m);
  register_layernorm(m);
  register_activation(m);
  register_pos_encoding(m);
}
