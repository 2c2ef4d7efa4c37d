// Paged decode attention on the CPU, reading K/V straight from the block pool.
//
// vLLM twin: csrc/cpu/cpu_attn.cpp (`cpu_attention_with_kv_cache`, with ISA-specific
// micro-kernels in cpu_attn_*.hpp). Read it for what the plain-torch decode in
// engine/v1/attention/backends/cpu_attn.py cannot avoid: torch has no way to read a
// request's blocks where they lie, so it first copies every context into a dense
// tensor (index_select) and then SDPA reads that copy again. On one core the step is
// bound by memory traffic, so reading K/V once instead of three times is the speed-up.
//
// Simpler than vLLM: decode rows only (one query token per request; prefill chunks keep
// the torch path), float32 only, two passes over the context (scores, then a softmax,
// then the V sum) instead of an online softmax over tiles, and the compiler's
// auto-vectorisation instead of hand-written AVX/AMX micro-kernels.
//
// Built at first use by engine/_cpu_ops.py (torch.utils.cpp_extension).
// Sessions: 05 (attention backends).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Blocks sit anywhere in the pool, so the hardware prefetcher stops at each block's
// end: while reading token t, ask for the same token of the request's next block.
inline void prefetch_row(const float* row, int64_t num_floats) {
  for (int64_t j = 0; j < num_floats; j += 16) __builtin_prefetch(row + j, 0, 3);  // 64-byte lines
}

// out, query: [n, H, D] (rows may be strided; the last dim is contiguous).
// key_cache, value_cache: [num_blocks, block_size, H_kv, D], contiguous.
// block_table: [n, W] int32, request i's block ids; seq_lens: [n] int32, its context.
// Query head h reads KV head h / (H / H_kv) (grouped-query attention).
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [n, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache and value_cache must be [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat &&
                  key_cache.scalar_type() == torch::kFloat &&
                  value_cache.scalar_type() == torch::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_table.is_contiguous() && seq_lens.is_contiguous(),
              "the caches, block_table and seq_lens must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "the head dim must be contiguous");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), H_kv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && out.size(0) == n && out.size(1) == H && out.size(2) == D,
              "head sizes disagree");
  TORCH_CHECK(H % H_kv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.size(0) == n && seq_lens.size(0) == n, "one block-table row and seq_len per query");
  const int64_t G = H / H_kv, W = block_table.size(1);

  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t token_stride = H_kv * D, block_stride = block_size * H_kv * D;
  const float scale_f = static_cast<float>(scale);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sl[i] >= 1 && sl[i] <= W * block_size, "seq_lens[", i, "]=", sl[i],
                " is outside [1, ", W * block_size, "]");
  }

  // Token t of a request whose block ids are `blocks`: its row (all KV heads) in `cache`.
  auto token_row = [&](const float* cache, const int32_t* blocks, int64_t t) {
    return cache + static_cast<int64_t>(blocks[t / block_size]) * block_stride + (t % block_size) * token_stride;
  };
  // Requests are independent: split them over torch's intra-op threads.
  int64_t total_len = 0;
  for (int64_t i = 0; i < n; ++i) total_len += sl[i];
  const int64_t per_request = (n == 0 ? 0 : total_len / n) * H * D * 2;  // K and V elements read
  at::parallel_for(0, n, grain_for(per_request), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, L] for the request at hand
    for (int64_t i = begin; i < end; ++i) {
      const int64_t L = sl[i];
      scores.resize(H * L);
      const float* qi = q + i * q_s0;
      const int32_t* blocks = bt + i * W;
      // 1. scores[h, t] = scale * q_h . k_t, one token row (all KV heads) at a time,
      //    so each cache line of K is read once.
      for (int64_t t = 0; t < L; ++t) {
        const float* k_row = token_row(kc, blocks, t);
        if (t + block_size < L) prefetch_row(token_row(kc, blocks, t + block_size), token_stride);
        for (int64_t h = 0; h < H; ++h) {
          const float* k = k_row + (h / G) * D;
          const float* qh = qi + h * q_s1;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qh[d] * k[d];
          scores[h * L + t] = acc * scale_f;
        }
      }
      // 2. softmax over the context, per head (max subtracted for stability).
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      // 3. out_h = sum_t p[h, t] * v_t, again one V row at a time.
      float* oi = o + i * o_s0;
      for (int64_t h = 0; h < H; ++h) std::fill(oi + h * o_s1, oi + h * o_s1 + D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* v_row = token_row(vc, blocks, t);
        if (t + block_size < L) prefetch_row(token_row(vc, blocks, t + block_size), token_stride);
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * L + t];
          const float* v = v_row + (h / G) * D;
          float* oh = oi + h * o_s1;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oh[d] += p * v[d];
        }
      }
    }
  });
}

}  // namespace

void register_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged float32 KV cache (in place into out)");
}
