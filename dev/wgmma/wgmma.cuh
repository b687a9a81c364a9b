// The warpgroup-product pieces of the dev/wgmma kernels (probe.cu, attn_fwd.cu), put in front
// of each by probe.py's compile_cubin: the 128-byte-swizzled shared-memory layout, the matrix
// descriptor, wgmma.mma_async m64n64k16 (bf16 operands, fp32 accumulators) with A from shared
// memory or registers, and its fence / commit / wait. sm_90a.
//
// The 128-byte swizzle (Swizzle<3,4,3>): a tile of rows of 128 bytes, the 16-byte chunk c of
// row r stored at chunk c ^ (r & 7); 1024-byte aligned. Descriptor (PTX ISA, "Matrix
// Descriptor Format"): bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45
// stride byte offset >> 4, 62-63 swizzle (1: 128-byte).
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Element (r, c) of a [64][64] bf16 tile of 128-byte rows, swizzled: its byte offset.
__device__ __forceinline__ u32 sw128(int r, int c) {
    const u32 chunk = (u32)(c >> 3), within = (u32)(c & 7) * 2;
    return (u32)r * 128 + ((chunk ^ (u32)(r & 7)) << 4) + within;
}

#define WG_D32(d)                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),            \
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),         \
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_REGS32                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d += A B, A and B from shared memory (descriptors), both K-major.
__device__ __forceinline__ void wg_ss(float* d, u64 da, u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : WG_D32(d)
                 : "l"(da), "l"(db));
}
// d += A B, A from registers, B from shared memory, K-major (TB = 0) or MN-major (TB = 1).
template <int TB>
__device__ __forceinline__ void wg_rs(float* d, const u32* a, u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, %37;\n"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB));
}

__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
