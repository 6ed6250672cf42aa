// AMX tile state shared by the kernels that use AMX tiles (amx.cpp: matrix products;
// prompt_attention.cpp: a prompt chunk's attention).
//
// Source: Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2, LDTILECFG
// (AMX-TILE); Linux's arch_prctl ARCH_REQ_XCOMP_PERM for the tile data state.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>

namespace specdec {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Every tile 16 rows of 64 bytes (A: 16 rows x 32 bfloat16; B: 16 k pairs x 16 outputs;
// C: 16 rows x 16 float32).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

}  // namespace specdec
#endif
