// AMX tile helpers shared by the CPU kernels (compiled where -march=native has AMX-BF16).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define OI_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace oi_amx {

// Linux gives a process AMX's tile data (8 KiB of state per thread) only once asked; without it
// the first tile instruction faults. Asked once per process; oneDNN asks the same for its GEMMs.
inline bool usable() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// A tile configuration (palette 1): tile t is rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int nrows, int bytes) {
    rows[tile] = uint8_t(nrows);
    colsb[tile] = uint16_t(bytes);
  }
  // Tiles are per thread and other code (oneDNN's GEMMs) configures them its own way on the
  // same threads: load the configuration before every use.
  void load() const { _tile_loadconfig(this); }
};

}  // namespace oi_amx
#endif
