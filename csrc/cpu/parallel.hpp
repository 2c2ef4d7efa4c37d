// How many items a thread takes at least, so that small calls stay on one thread.
//
// at::parallel_for runs inline when its range is shorter than the grain; otherwise it
// opens an OpenMP region, whose threads then spin for a while waiting for more work.
// At decode sizes a call is microseconds of work, and on a small machine shared by the
// engine and its front end those spinning threads cost more than they save, so the
// grain asks for at least at::internal::GRAIN_SIZE (32768) elements per thread, as
// torch's own elementwise kernels do.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

inline int64_t grain_for(int64_t elements_per_item) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_item));
}
