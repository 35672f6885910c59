/*
 * What the kernels that multiply on AMX tiles share (int8_linear.c, bf16_linear.c): the
 * process's permission to use them, and a thread's tile configuration. A source that includes
 * it defines _DEFAULT_SOURCE before its first include (for syscall()).
 */
#ifndef KILN_AMX_H
#define KILN_AMX_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process AMX's tile registers only once it asks (arch_prctl's ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA); without, a tile instruction faults. Asked once a process (the answer
 * is the same for every thread, and a second asker gets it again). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

/* Loads a configuration of n tiles, tile i of rows[i] rows of colsb[i] bytes, for the calling
 * thread; it holds until the thread releases its tiles (_tile_release). */
static inline void amx_configure(int n, const uint8_t *rows, const uint16_t *colsb) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config = {.palette = 1};
    for (int i = 0; i < n; i++) config.rows[i] = rows[i], config.colsb[i] = colsb[i];
    _tile_loadconfig(&config);
}
#endif
#endif
