/* AMX tiles for the kernels that multiply on them (built where -march has AMX-TILE and AMX-BF16,
 * or, for the tests, emulated in C with STRATA_EMULATE_AMX: amx_emulation.h).
 * Every tile these kernels use is 16 rows of 64 bytes: 16 x 16 float32 sums, or 16 x 32
 * bfloat16 values (as the first operand of tdpbf16ps, or as 16 pairs of rows of the second:
 * row p holds, for each of 16 columns, the values of rows 2p and 2p + 1). */
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define AMX_TILES 1
#elif defined(STRATA_EMULATE_AMX)
#include "amx_emulation.h"
#define AMX_TILES 1
#endif

#if defined(AMX_TILES)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { TILE_ROWS = 16, TILE_ROW_BYTES = 64 };

/* Linux hands AMX's tile state to a process only when asked (arch_prctl); 1 if granted. */
static inline int amx_permitted(void)
{
#if defined(STRATA_EMULATE_AMX)
    return 1; /* the emulated tiles are ordinary memory */
#else
    static int permitted = -1;
    if (permitted < 0) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return permitted;
#endif
}

/* All eight tiles 16 x 64 bytes, for the calling thread (each thread configures its own). */
static inline void configure_tiles(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = TILE_ROWS;
        config.bytes_per_row[t] = TILE_ROW_BYTES;
    }
    _tile_loadconfig(&config);
}
#endif
