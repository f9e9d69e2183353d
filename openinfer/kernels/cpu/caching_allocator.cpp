// A caching allocator for torch's large CPU tensors: a freed block of 1 MiB or more is kept and
// handed to the next allocation of about its size, instead of going back to the C library.
//
// Why: glibc serves a block that large with mmap (or trims it off the heap top) and returns it
// to the kernel on free, so the next step's activation of the same shape faults in fresh pages,
// each zeroed by the kernel. On the 2-core VMs these figures come from, fresh memory arrives at
// 1.7-5 GB/s: a 100 MB gate/up output of a 4096-token float32 prefill took 42 ms to allocate
// and fill against 6 ms reused, and such blocks made about a fifth of the prefill step
// (benchmarks/bench_cpu_allocator.py). torch's CUDA allocator caches for the same reason; its
// CPU allocator does not.
//
// How: it wraps the allocator it replaces (c10::GetCPUAllocator() at install: torch's default,
// which backs blocks of 2 MiB or more with huge pages, see openinfer/huge_pages.py), so every
// block still comes from there. Sizes of 2 MiB or more are rounded up to whole 2 MiB (a huge
// page), smaller ones to 64 KiB. A free block serves a request of up to its own size and down
// to 4/5 of it (best fit). Free blocks are released, oldest freed first, while they hold more
// than the limit (set_limit; 0 releases them all and caches nothing more), and all of them when
// the wrapped allocator runs out of memory (then it tries once more). Blocks under 1 MiB are
// passed through to the wrapped allocator untouched. Thread-safe (one mutex).
// Installed by openinfer/cpu_allocator.py, in the processes that run a model on CPU.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

constexpr size_t MIN_CACHED = size_t(1) << 20;
constexpr size_t HUGE_PAGE = size_t(2) << 20;
constexpr size_t SMALL_GRAIN = size_t(64) << 10;

class CachingCPUAllocator final : public c10::Allocator {
 public:
  CachingCPUAllocator(c10::Allocator* base, size_t limit) : base_(base), limit_(limit) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < MIN_CACHED) return base_->allocate(n);
    const size_t grain = n >= HUGE_PAGE ? HUGE_PAGE : SMALL_GRAIN;
    const size_t size = (n + grain - 1) / grain * grain;
    c10::DataPtr block;
    size_t block_size = size;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = by_size_.lower_bound(size);
      if (it != by_size_.end() && it->first / 5 * 4 <= size) {
        block_size = it->first;
        block = std::move(it->second->block);
        cached_ -= block_size;
        freed_.erase(it->second);
        by_size_.erase(it);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (!block) {
      try {
        block = base_->allocate(size);
      } catch (const c10::Error&) {  // out of memory: what is kept goes back first, then once more
        release_kept();
        block = base_->allocate(size);
      }
    }
    void* data = block.get();
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(data, Live{std::move(block), block_size});
    return c10::DataPtr(data, data, &free_block, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Kept, or released beyond the limit. A pointer this allocator did not hand out is a block
  // of the wrapped allocator (a small one through raw_allocate): its own deleter frees it.
  void release(void* data) {
    std::vector<c10::DataPtr> dropped;  // freed after the lock is let go
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(data);
      if (it == live_.end()) {
        const c10::DeleterFnPtr base_free = base_->raw_deleter();
        TORCH_CHECK(base_free != nullptr, "caching allocator: a pointer it did not allocate");
        base_free(data);
        return;
      }
      Live entry = std::move(it->second);
      live_.erase(it);
      if (entry.size > limit_) {
        dropped.push_back(std::move(entry.block));
      } else {
        freed_.push_back(Free{std::move(entry.block), entry.size, {}});
        auto last = std::prev(freed_.end());
        last->slot = by_size_.emplace(entry.size, last);
        cached_ += entry.size;
        trim(dropped);
      }
    }
  }

  void set_limit(size_t limit) {
    std::vector<c10::DataPtr> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = limit;
    trim(dropped);
  }

  // Every kept block back to the wrapped allocator (the limit stays).
  void release_kept() {
    std::vector<c10::DataPtr> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t limit = limit_;
    limit_ = 0;
    trim(dropped);
    limit_ = limit;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {int64_t(hits_), int64_t(misses_), int64_t(cached_), int64_t(limit_), int64_t(live_.size())};
  }

  static void free_block(void* data);

 private:
  struct Live {
    c10::DataPtr block;
    size_t size;
  };
  struct Free;
  using SizeIndex = std::multimap<size_t, std::list<Free>::iterator>;
  struct Free {
    c10::DataPtr block;
    size_t size;
    SizeIndex::iterator slot;
  };

  // Oldest freed first, while the free blocks hold more than the limit (mutex held).
  void trim(std::vector<c10::DataPtr>& dropped) {
    while (cached_ > limit_ && !freed_.empty()) {
      Free& oldest = freed_.front();
      cached_ -= oldest.size;
      by_size_.erase(oldest.slot);
      dropped.push_back(std::move(oldest.block));
      freed_.pop_front();
    }
  }

  c10::Allocator* base_;
  size_t limit_;
  std::mutex mutex_;
  std::unordered_map<void*, Live> live_;
  std::list<Free> freed_;  // in the order they were freed
  SizeIndex by_size_;
  size_t cached_ = 0, hits_ = 0, misses_ = 0;
};

// Never destroyed: tensors may be freed during the process's exit, after static destructors ran.
CachingCPUAllocator* installed = nullptr;
std::mutex install_mutex;

void CachingCPUAllocator::free_block(void* data) { installed->release(data); }

}  // namespace

bool install_caching_allocator(int64_t limit_bytes) {
  TORCH_CHECK(limit_bytes >= 0, "install_caching_allocator: a limit of 0 bytes or more");
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed == nullptr) {
    auto* allocator = new CachingCPUAllocator(c10::GetCPUAllocator(), size_t(limit_bytes));
    c10::SetCPUAllocator(allocator, /*priority=*/1);
    if (c10::GetCPUAllocator() != allocator) {  // one of higher priority is in place: leave it
      delete allocator;
      return false;
    }
    installed = allocator;
  } else {
    installed->set_limit(size_t(limit_bytes));
  }
  return true;
}

std::vector<int64_t> caching_allocator_stats() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed == nullptr) return {};
  return installed->stats();
}
