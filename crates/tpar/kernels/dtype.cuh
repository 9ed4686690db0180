// dtype.cuh: elements and payload words. A payload word holds 1 f32 or 2 f16/bf16 elements
// (little-endian); every sum is taken in f32 and rounded to the dtype once, at the end.
#pragma once

#include "abi.cuh"

__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u32 f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_bits_to_f32(u32 bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ u32 f32_to_bf16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <int DT> struct Lanes;
template <> struct Lanes<TPAR_DTYPE_F32> {
    static const int PER_WORD = 1;
    __device__ static void unpack(u32 w, float* v) { v[0] = __uint_as_float(w); }
    __device__ static u32 pack(const float* v) { return __float_as_uint(v[0]); }
};
template <> struct Lanes<TPAR_DTYPE_F16> {
    static const int PER_WORD = 2;
    __device__ static void unpack(u32 w, float* v) { v[0] = f16_bits_to_f32(w & 0xffff); v[1] = f16_bits_to_f32(w >> 16); }
    __device__ static u32 pack(const float* v) { return f32_to_f16_bits(v[0]) | (f32_to_f16_bits(v[1]) << 16); }
};
template <> struct Lanes<TPAR_DTYPE_BF16> {
    static const int PER_WORD = 2;
    __device__ static void unpack(u32 w, float* v) { v[0] = bf16_bits_to_f32(w & 0xffff); v[1] = bf16_bits_to_f32(w >> 16); }
    __device__ static u32 pack(const float* v) { return f32_to_bf16_bits(v[0]) | (f32_to_bf16_bits(v[1]) << 16); }
};

template <int DT> __device__ __forceinline__ u64 words_for(u64 count) {
    return (count + Lanes<DT>::PER_WORD - 1) / Lanes<DT>::PER_WORD;
}

// Payload word `i` of an element buffer of `count` elements, zero-padded past the end. 16-bit
// elements are read one at a time: tensors need not be 4-byte aligned.
template <int DT> __device__ __forceinline__ u32 load_word(const void* base, u64 i, u64 count) {
    if (DT == TPAR_DTYPE_F32) return ((const u32*)base)[i];
    const unsigned short* h = (const unsigned short*)base;
    u32 lo = h[2 * i];
    u32 hi = (2 * i + 1 < count) ? h[2 * i + 1] : 0u;
    return lo | (hi << 16);
}
template <int DT> __device__ __forceinline__ void store_word(void* base, u64 i, u64 count, u32 w) {
    if (DT == TPAR_DTYPE_F32) { ((u32*)base)[i] = w; return; }
    unsigned short* h = (unsigned short*)base;
    h[2 * i] = (unsigned short)(w & 0xffff);
    if (2 * i + 1 < count) h[2 * i + 1] = (unsigned short)(w >> 16);
}

// Two payload words (elements 2*pair.. of the input) with as few loads as alignment allows.
template <int DT> __device__ __forceinline__ void load_pair(const void* base, u64 pair, u64 count, u64 words,
                                                            u32* w0, u32* w1) {
    const u64 i = 2 * pair;
    const u64 elems_per_pair = 2 * Lanes<DT>::PER_WORD;
    if ((((unsigned long long)base) & 7) == 0 && (pair + 1) * elems_per_pair <= count) {
        uint2 v = ((const uint2*)base)[pair];
        *w0 = v.x;
        *w1 = v.y;
        return;
    }
    *w0 = load_word<DT>(base, i, count);
    *w1 = i + 1 < words ? load_word<DT>(base, i + 1, count) : 0u;
}
template <int DT> __device__ __forceinline__ void store_pair(void* base, u64 pair, u64 count, u64 words, u32 w0,
                                                             u32 w1) {
    const u64 i = 2 * pair;
    const u64 elems_per_pair = 2 * Lanes<DT>::PER_WORD;
    if ((((unsigned long long)base) & 7) == 0 && (pair + 1) * elems_per_pair <= count) {
        ((uint2*)base)[pair] = make_uint2(w0, w1);
        return;
    }
    store_word<DT>(base, i, count, w0);
    if (i + 1 < words) store_word<DT>(base, i + 1, count, w1);
}
