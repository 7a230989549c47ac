/* Unaligned loads and stores of GCC vectors of floats, for kvmesh's CPU kernels: cpu_ops.c and
 * cpu_linear.c each work in vectors of their own widths, read from and written to float arrays
 * with no alignment asked (a memcpy, which the compiler turns into one unaligned move).
 */
#ifndef KVMESH_CPU_VEC_H
#define KVMESH_CPU_VEC_H

#include <string.h>

/* LOAD(p): the vector of type T at p; STORE(p, v): v written at p. */
#define KV_VECTOR_IO(T, LOAD, STORE)                                                               \
    static inline T LOAD(const float *p) {                                                         \
        T v;                                                                                       \
        memcpy(&v, p, sizeof v);                                                                   \
        return v;                                                                                  \
    }                                                                                              \
    static inline void STORE(float *p, T v) { memcpy(p, &v, sizeof v); }

#endif
