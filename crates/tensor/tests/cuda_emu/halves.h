// bf16 and IEEE half conversions of the emulated CUDA libraries (device.h for the kernels,
// libraries.cpp for cuBLASLt): round to nearest even. NaN is left to the callers, which
// differ in the NaN they write (the kernels' cvt.rn gives a canonical one).
#pragma once
#include <stdint.h>
#include <string.h>

namespace xt_halves {

inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

inline float from_bits32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline bool is_nan(float f) { return (bits(f) & 0x7fffffffu) > 0x7f800000u; }

// f32 (not NaN) -> bf16.
inline uint16_t to_bf16(float f) {
    uint32_t u = bits(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// f32 (not NaN) -> IEEE half.
inline uint16_t to_f16(float f) {
    const uint32_t x = bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // rounds to >= 65536: infinity
    if (a < 0x38800000u) {                                  // below 2^-14: subnormal or zero
        if (a < 0x33000000u) return (uint16_t)sign;         // below half the smallest subnormal
        const uint32_t m = (a & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(a >> 23) + 1 + 13; // to the 2^-24 unit
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = (a >> 13) - (112u << 10);
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

inline float bf16_to_float(uint16_t h) { return from_bits32((uint32_t)h << 16); }

inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f; // m * 2^-24
        return sign ? -v : v;
    }
    if (e == 31) return from_bits32(sign | 0x7f800000u | (m << 13));
    return from_bits32(sign | ((e + 112u) << 23) | (m << 13));
}

} // namespace xt_halves
