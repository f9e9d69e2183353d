// Evicting a tensor's bytes from every cache level: the GEMM planner times few-row calls with
// their weight read from memory, as a forward pass reads it (openinfer/kernels/gemm_plan.py).

#include <cstdint>

#include "ops.h"

namespace {

constexpr uintptr_t kLine = 64;

#if defined(__x86_64__)
// CLFLUSHOPT flushes lines in parallel (CLFLUSH one after another: about 2 GB/s here).
__attribute__((target("clflushopt"))) void flush_lines_opt(uintptr_t start, uintptr_t end) {
  for (uintptr_t line = start; line < end; line += kLine) __builtin_ia32_clflushopt(reinterpret_cast<void*>(line));
  __builtin_ia32_sfence();
}

void flush_lines(uintptr_t start, uintptr_t end) {
  for (uintptr_t line = start; line < end; line += kLine) __builtin_ia32_clflush(reinterpret_cast<const void*>(line));
  __builtin_ia32_mfence();
}
#endif

}  // namespace

bool evict_from_cache(int64_t address, int64_t nbytes) {
  const uintptr_t end = static_cast<uintptr_t>(address) + static_cast<uintptr_t>(nbytes);
  const uintptr_t start = static_cast<uintptr_t>(address) & ~(kLine - 1);
#if defined(__x86_64__)
  static const bool has_opt = __builtin_cpu_supports("clflushopt");
  if (has_opt)
    flush_lines_opt(start, end);
  else
    flush_lines(start, end);
  return true;
#elif defined(__aarch64__)
  for (uintptr_t line = start; line < end; line += kLine) asm volatile("dc civac, %0" ::"r"(line) : "memory");
  asm volatile("dsb ish" ::: "memory");
  return true;
#else
  (void)start;
  (void)end;
  return false;
#endif
}
