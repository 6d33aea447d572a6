/*
 * amx.h: what the AMX paths of the amx build share (bf16_gemm.c: TDPBF16PS; gguf.c: TDPBUSD and
 * TDPBSSD): the tile state Linux must grant a process before its first tile instruction, and the
 * LDTILECFG layout. Include only where __AMX_TILE__ is defined.
 * Source: Intel SDM vol. 1 ch. 18 (AMX: LDTILECFG, TILELOADD) and the Linux kernel's
 * Documentation/arch/x86/xstate.rst (ARCH_REQ_XCOMP_PERM with XFEATURE_XTILEDATA).
 */
#ifndef KVP_AMX_H
#define KVP_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KVP_ARCH_REQ_XCOMP_PERM 0x1023
#define KVP_XFEATURE_XTILEDATA 18

/* 1 once the kernel granted this process the AMX tile state (Linux 5.16+), else 0; asked once per
   library (a race only asks twice; the grant is the process's). */
static int kvp_amx_granted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, KVP_ARCH_REQ_XCOMP_PERM, KVP_XFEATURE_XTILEDATA) == 0;
    return state;
}

/* LDTILECFG's 64-byte operand (palette 1: up to 8 tiles of 16 rows x 64 bytes). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) kvp_tile_config;

#endif /* KVP_AMX_H */
