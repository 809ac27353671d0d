// gemm_wgmma.cu: the warp-specialized wgmma GEMM (Hopper, sm_90a). The contract: gemm.cuh.
#include "gemm.cuh"

// ---- Hopper tensor cores: warp-specialized wgmma (sm_90a), float32 and 16-bit, aligned rows ----
// (TA / TB: A / B transposed, as in gemm_mma, copied by 4-byte cp.async into the same
// swizzled K-major layout: TF32 wgmma reads K-major operands only from smem. Exception:
// a transposed A loaded by TMA, whose M-major boxes the consumers turn into register
// fragments, see the kernel's comment.)
// 384 threads: warpgroup 0 is the producer, warpgroups 1 and 2 the consumers, each
// owning 64 rows of the BM x BN tile (m64nBNk8 TF32 wgmma, B and mostly A in smem).
// The producer streams 32-float K slices of A and B (bulk tensor copies by one thread,
// TMA, where the layout allows; else cp.async) into a ring of
// STAGES stages in the wgmma 128-byte-swizzle K-major layout (16-byte chunk c of row r
// at r*128 + (c ^ r%8)*16, 8-row groups 1024 B apart); full/empty mbarriers hand the
// stages over, so loads, the 3xTF32 split and the tensor cores overlap without any
// block-wide barrier. setmaxnreg gives the consumers the registers.
//   MODE 1 (TF32), BN = 256: the bulk copies' bytes (TMA: maps of TF32 elements, so the
//     copy engine rounds each operand to TF32) or all 128 producer threads' cp.async
//     arrivals (cp.async.mbarrier.arrive) mark a stage full as soon as it lands; each
//     consumer keeps one slice of wgmma in flight.
//     CL == 2 (a cluster of the CTAs of M tiles 2i, 2i + 1, one N tile): each CTA's
//     producer loads its own A and half of B, multicast to both CTAs, so each CTA
//     reads 2/3 of the operand bytes from L2; a stage is free once the consumers of
//     both CTAs released it (`empty` counts 8 * CL warps), and a producer exits only
//     after its peer's last releases reached its barriers.
//   MODE 3 (float16 / bfloat16, K-major by TMA), BN = 256: MODE 1's pipeline with
//     64-element K slices (the same 128-byte swizzled rows) and m64n256k16 wgmma.
//   MODE 0 (3xTF32), BN = 128: two producer warps copy, or one thread (TMA, maps of
//     FP32 elements: the split needs the raw bits), marking the stage `loaded`;
//     the other two write the rounded TF32 remainders of each landed B slice behind it
//     and mark the stage full, so copies run up to STAGES slices ahead of the split.
//     B's big halves are the raw fp32 bits, which the tensor core truncates. Consumers
//     take A from registers: each loads its warp's fragments of the slice and splits
//     them in place, A's big halves rounded to nearest (split_a). Per slice the tensor
//     core sums big*small + small*big + big*big, and the
//     consumer promotes that sum into an fp32 register accumulator (32 K products at
//     most ever sum in the tensor core: shared/notes/GEMM.md) while the other consumer's wgmma keep
//     the tensor core busy.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CK_WGMMA 1
#else
#define CK_WGMMA 0
#endif

// BM, BN, THREADS, STAGES and the dynamic smem size SMEM are template parameters of
// gemm_wgmma, defined once in Python (gemm.py); only derived constants live here.
namespace wg_cfg {
template <int MODE, int BM, int BN, int STAGES> struct Cfg {
  static constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128;  // one 32-float K slice
  static constexpr int B_SMALL = A_BYTES + B_BYTES;  // MODE 0: B's remainders follow B
  static constexpr int STAGE = B_SMALL + (MODE == 0 ? B_BYTES : 0);
  static constexpr int LOADERS = MODE == 0 ? 64 : 128;  // producer threads issuing copies
  static constexpr int SMEM = STAGES * STAGE + 3 * STAGES * 8 + 1024;  // + barriers, alignment slack
};
}  // namespace wg_cfg

// 16-byte chunk c of a K slice (8 chunks per 128-byte row) -> swizzled smem offset.
__device__ __forceinline__ unsigned swz_off(int c) {
  const int r = c >> 3;
  return r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
// Producer thread t of NT copies its chunks t, t+NT, ... of a ROWS-row slice: always
// chunk t%8 of rows t/8 + i*NT/8, whose swizzled offsets are 16*NT bytes apart. (A
// 16-byte chunk is 4 floats or 8 halves; the aligned rows hold whole chunks up to K.)
template <int ROWS, int NT, typename T>
__device__ __forceinline__ void load_swizzled(unsigned dst, const T* __restrict__ g, long long ld,
                                              int rows_left, int k0, int K, int t) {
  static_assert(NT % 64 == 0, "each step must move whole 8-row swizzle groups");
  const int r = t >> 3, k = k0 + (t & 7) * (16 / (int)sizeof(T));
  const T* src = g + (long long)r * ld + k;
  dst += swz_off(t);
#pragma unroll
  for (int i = 0; i < ROWS * 8 / NT; ++i) {
    const bool ok = r + i * (NT / 8) < rows_left && k < K;
    cp_async16(dst + i * 16 * NT, ok ? src : g, ok ? 16 : 0);
    src += (NT / 8) * ld;
  }
}
// B's remainders x - tf32trunc(x) (its big halves are the raw bits, which the tensor
// core truncates), rounded to TF32, of chunks t, t+NT, ... of a landed ROWS-row slice,
// written at the same offsets from dst (elementwise: any chunk order). Rounding B's big
// halves too means writing the slice back: with both operands' rounded by cvt.rna, 10-17%
// of the kernel's time on an H200 (A's alone 4-7%), and no smaller error.
template <int ROWS, int NT>
__device__ __forceinline__ void split_swizzled(unsigned src, unsigned dst, int t) {
#pragma unroll
  for (int i = 0; i < ROWS * 8 / NT; ++i) {
    const unsigned off = (t + i * NT) * 16;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src + off));
    unsigned* e = &v.x;
#pragma unroll
    for (int q = 0; q < 4; ++q) e[q] = to_tf32(__uint_as_float(e[q]) - __uint_as_float(e[q] & TF32_MASK));
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(dst + off), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  }
}

// ---- mbarriers, bulk tensor copies and wgmma (PTX, sm_90) ----------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
#if CK_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Make initialized mbarriers visible to the copy engine (async proxy).
__device__ __forceinline__ void mbar_init_fence() {
#if CK_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Arrive, and expect `bytes` more from bulk copies before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
#if CK_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// A CUtensorMap, encoded by the driver on the host (cupykern/_tma.py) and passed by value.
struct alignas(64) TmaMap {
  unsigned long long w[16];
};
// Fetch map `m` into the copy engine's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch(const TmaMap& m) {
#if CK_WGMMA
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&m)) : "memory");
#endif
}
// The box of map `m` at (column k, row r) into smem at dst (128-byte swizzle: the
// layout swz_off describes); its bytes complete on mbarrier `bar`. Outside the tensor
// the box is zero-filled.
__device__ __forceinline__ void tma_load(unsigned dst, const TmaMap& m, int k, int r, unsigned bar) {
#if CK_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&m)), "r"(k), "r"(r), "r"(bar) : "memory");
#endif
}
// tma_load into the same offsets of every CTA of the cluster in `mask`, completing on
// each one's mbarrier at the offset of `bar`.
__device__ __forceinline__ void tma_load_multicast(unsigned dst, const TmaMap& m, int k, int r, unsigned bar,
                                                   unsigned short mask) {
#if CK_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&m)), "r"(k), "r"(r), "r"(bar), "h"(mask) : "memory");
#endif
}
// Arrive on the mbarrier at this CTA's offset `bar` in cluster CTA `rank` (itself included).
// The arrival releases at CTA scope, as CUTLASS's cluster pipelines do: it orders the
// warp's finished wgmma reads of the stage before the producer's copies into it. A
// cluster-scope release (.release.cluster) made TF32 GEMMs 1.9x slower (H100).
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
#if CK_WGMMA
  asm volatile(
      "{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [r];\n}\n" ::"r"(bar), "r"(rank) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if CK_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
// Arrive once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
#if CK_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if CK_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#endif
}
template <int N> __device__ __forceinline__ void set_max_regs() {
#if CK_WGMMA
  if (N > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
__device__ __forceinline__ void consumer_sync() {  // named barrier over the 256 consumer threads
  asm volatile("bar.sync 1, 256;" ::: "memory");
}

// Shared-memory matrix descriptor: 128B swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void fence_proxy_async() {
#if CK_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// Make the compiler treat the accumulators as live across async wgmma boundaries.
template <int R> __device__ __forceinline__ void wg_fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wg_arrive() {
#if CK_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if CK_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wg_wait() {
#if CK_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Accumulator operand lists: d[0..63] as %0..%63 (and d[64..127] as %64..%127).
#define CK_D8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), \
                 "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define CK_D64(b) CK_D8(b), CK_D8(b + 8), CK_D8(b + 16), CK_D8(b + 24), CK_D8(b + 32), CK_D8(b + 40), \
                  CK_D8(b + 48), CK_D8(b + 56)
#define CK_R64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CK_R128 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// d (+)= A(64x8, smem) * B(BNx8, smem)^T with d holding BN/2 floats; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_tf32(float (&d)[64], unsigned long long da, unsigned long long db,
                                           int scale_d) {
#if CK_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" CK_R64 "}, %64, %65, p, 1, 1;\n}\n"
               : CK_D64(0)
               : "l"(da), "l"(db), "r"(scale_d));
#endif
}
__device__ __forceinline__ void wgmma_tf32(float (&d)[128], unsigned long long da, unsigned long long db,
                                           int scale_d) {
#if CK_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" CK_R128 "}, %128, %129, p, 1, 1;\n}\n"
               : CK_D64(0), CK_D64(64)
               : "l"(da), "l"(db), "r"(scale_d));
#endif
}
// d (+)= A(64x8, registers: the m16n8k8 tf32 fragment per warp) * B(128x8, smem)^T.
__device__ __forceinline__ void wgmma_tf32(float (&d)[64], const unsigned (&a)[4], unsigned long long db,
                                           int scale_d) {
#if CK_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" CK_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
               : CK_D64(0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
#endif
}
// d (+)= A(64x8, registers, as above) * B(256x8, smem)^T.
__device__ __forceinline__ void wgmma_tf32(float (&d)[128], const unsigned (&a)[4], unsigned long long db,
                                           int scale_d) {
#if CK_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" CK_R128 "}, {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
               : CK_D64(0), CK_D64(64)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
#endif
}
// d (+)= A(64x16, smem) * B(256x16, smem)^T for float16 or bfloat16 (BF16) operands, fp32
// sums: one 32-byte K step of the swizzled slices, as wgmma_tf32's 8 floats. The 16-bit
// forms take two more immediates than TF32's after scale-a and scale-b: trans-a and
// trans-b, 0 for the K-major slices here.
#define CK_WGMMA16(TY)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" CK_R128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
               : CK_D64(0), CK_D64(64)                                                            \
               : "l"(da), "l"(db), "r"(scale_d))
template <bool BF16>
__device__ __forceinline__ void wgmma_16(float (&d)[128], unsigned long long da, unsigned long long db,
                                         int scale_d) {
#if CK_WGMMA
  if constexpr (BF16) CK_WGMMA16("bf16");
  else CK_WGMMA16("f16");
#endif
}
#undef CK_WGMMA16
#undef CK_D8
#undef CK_D64
#undef CK_R64
#undef CK_R128

// This warp's 16 rows of a consumer's 64-row A slice (swizzled smem at `a`) as wgmma
// register fragments for the 4 K steps: element (row g + 8*(q&1), k 8*ks + t + 4*(q>>1)).
// Rows g and g+8 share the swizzle phase g, so a warp's 32 loads hit 32 different banks.
__device__ __forceinline__ void load_a(unsigned a, unsigned (&f)[4][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const unsigned row = a + ((threadIdx.x >> 5) & 3) * 16 * 128 + g * 128 + t * 4;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(f[ks][q]) : "r"(row + (q & 1) * 8 * 128 + (((2 * ks + (q >> 1)) ^ g) << 4)));
}
// A's split (split_tf32) of raw fp32 fragments, in place: f keeps the big halves, rounded
// to nearest, so that A's small halves take either sign and the dropped small * small
// (B's small halves share their elements' signs) errs both ways.
__device__ __forceinline__ void split_a(unsigned (&f)[4][4], unsigned (&small)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int q = 0; q < 4; ++q) split_tf32(f[ks][q], f[ks][q], small[ks][q]);
}

// The same fragments from an M-major A slice (transposed A through TMA): the stage holds
// BM / 32 boxes of 32 K rows x 32 M floats, 4096 bytes each, every K row 128 bytes in the
// 128-byte swizzle (16-byte chunk c of row k at chunk c ^ (k % 8)); `row0` is this warp's
// first row of the tile. TF32's tensor map has rounded the elements already; 3xTF32's
// holds the raw bits.
__device__ __forceinline__ void load_a_mn(unsigned a, int row0, unsigned (&f)[4][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int m = row0 + g + 8 * (q & 1), k = 8 * ks + t + 4 * (q >> 1);
      const unsigned addr = a + (m >> 5) * 4096 + k * 128 + ((((m & 31) >> 2) ^ (k & 7)) << 4) + (m & 3) * 4;
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(f[ks][q]) : "r"(addr));
    }
}

// Consumer epilogue, through shared memory (the ring is free once every consumer is past
// its last wgmma): the accumulators go to a BM x BN tile, from which rows leave as whole
// 16-byte vectors, c = epilogue(tile); and, if `part`, one thread per column takes two
// passes down it for the tile's (mean, M2, min, max) of the raw sums. Unrolled per-fragment
// stores and per-slot statistics took ~10x the instructions and missed the instruction
// cache (a third of the GEMM's time at 16384x4096 @ 4096x4096, H200).
// 16-bit T: c = T(epilogue(tile)), as gemm_mma rounds, and the statistics of the sums
// rounded to T (what BatchNorm then normalises: see the file's header).
template <typename T, int BM, int BN>
__device__ __forceinline__ void wg_store(const float (&res)[BN / 2], unsigned char* smem, T* __restrict__ c,
                                         int M, int N, long long ldc, int m0, int n0,
                                         const T* __restrict__ bias, const float* __restrict__ alpha,
                                         const float* __restrict__ beta, float* __restrict__ part) {
  constexpr int LD = BN + 8;       // padded rows: a warp's float2 writes hit 32 distinct banks
  constexpr int TPR = BN / 4;      // threads per row of float4 stores
  constexpr int RPP = 256 / TPR;   // rows per pass of the 256 consumer threads
  static_assert(256 % TPR == 0 && BN <= 256, "wg_store: whole rows per pass, a column per thread");
  float* tile = reinterpret_cast<float*>(smem);
  const int ct = threadIdx.x - 128, lane = ct & 31, cw = ct >> 5;
  {  // accumulator (j, 2h+e): row (cw/4)*64 + (cw%4)*16 + g + 8h, column 8j + 2t + e
    const int g = lane >> 2, t = lane & 3, r0 = (cw >> 2) * 64 + (cw & 3) * 16 + g;
    consumer_sync();
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h, k = 8 * j + 2 * t;
        *reinterpret_cast<float2*>(tile + r * LD + k) = make_float2(res[4 * j + 2 * h], res[4 * j + 2 * h + 1]);
      }
    consumer_sync();
  }

  const int rows = min(BM, M - m0), c4 = 4 * (ct % TPR), col = n0 + c4;
  float ea[4], eb[4];  // epilogue(v) = ea * v + eb per column (ea == 1, eb == 0: v itself)
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const bool in = col + e < N;
    ea[e] = alpha && in ? alpha[col + e] : 1.f;
    eb[e] = !in ? 0.f : alpha ? beta[col + e] : bias ? to_acc(bias[col + e]) : 0.f;
  }
  const bool scaled = alpha || bias;  // (without either, v is stored as is: -0 stays -0)
  // a thread's 4 columns as one store: 16 bytes of float, 8 of 16-bit T (aligned to that)
  constexpr size_t VB = 4 * sizeof(T);
  const bool vec = col + 3 < N && ((reinterpret_cast<size_t>(c) | (size_t)ldc * sizeof(T)) & (VB - 1)) == 0;
  for (int r = ct / TPR; r < rows; r += RPP) {
    const float4 v4 = *reinterpret_cast<const float4*>(tile + r * LD + c4);
    float o[4] = {v4.x, v4.y, v4.z, v4.w};
    if (scaled) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = ea[e] * o[e] + eb[e];  // (ea == 1: exactly v + eb)
    }
    T* p = c + (long long)(m0 + r) * ldc + col;
    if (vec) {
      if constexpr (sizeof(T) == 4) *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]);
      else *reinterpret_cast<uint2*>(p) = make_uint2(pack2(o[0], o[1], T{}), pack2(o[2], o[3], T{}));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col + e < N) p[e] = from_acc<T>(o[e]);
    }
  }

  if (part && ct < BN && n0 + ct < N) {  // two passes down column ct (nan reaches the mean;
    const float* q = tile + ct;          // min / max skip it, as fmin / fmax do)
    const auto at = [&](int r) { return to_acc(from_acc<T>(q[r * LD])); };  // (float: q[r * LD])
    float s = 0.f;
    for (int r = 0; r < rows; ++r) s += at(r);
    const float mean = s / (float)rows;
    float m2 = 0.f, lo = infinity<float>(), hi = -infinity<float>();
    for (int r = 0; r < rows; ++r) {
      const float v = at(r), d = v - mean;
      m2 += d * d;
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    float* out = part + (long long)PART_ROWS * (m0 / BM) * N + n0 + ct;
    out[0] = mean;
    out[N] = m2;
    out[2 * (long long)N] = lo;
    out[3 * (long long)N] = hi;
  }
}

// The TC epilogue (mm's swapped product: no bias, alpha, beta or part): element (m, n) of
// the tile to c[n * ldc + m], straight from the accumulators, so that the ring stays the
// producer's, already loading the next tile. Each warp store covers 8 consecutive m (one
// 32-byte sector) of 4 columns n.
template <typename T, int BN>
__device__ __forceinline__ void wg_store_t(const float (&res)[BN / 2], T* __restrict__ c, int M, int N,
                                           long long ldc, int m0, int n0) {
  const int ct = threadIdx.x - 128, lane = ct & 31, cw = ct >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = m0 + (cw >> 2) * 64 + (cw & 3) * 16 + g;  // as wg_store's accumulator rows
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = r0 + 8 * h, n = n0 + 8 * j + 2 * t + e;
        if (m < M && n < N) c[(long long)n * ldc + m] = from_acc<T>(res[4 * j + 2 * h + e]);
      }
}

// SMEM == STAGES * STAGE + 3 * STAGES * 8 + 1024 with
// STAGE == BM * 128 + BN * 128 + (MODE == 0 ? BN * 128 : 0) (wg_cfg::Cfg::SMEM).
// BOX > 0 (TMA): one producer thread loads each slice of A and B by bulk tensor copies
// of BOX rows x 32 floats through the tensor maps ma (M x K) and mb (N x K) instead of
// the loaders' cp.async (a and b are then unused); BOX == 0: the maps are ignored.
// TA with TMA: ma maps A's storage (K rows x M columns), loaded in boxes of 32 x 32; the
// consumers take A's fragments from shared memory into registers (wgmma reads only
// K-major TF32 operands from shared memory; 3xTF32 takes A from registers anyway), so
// dx = dy @ W runs without a copy of W's transpose (gemm.py computes its transpose,
// W^T dy^T, with W^T as A, and with TC stores that product's transpose: c (N x M) gets
// element (m, n) at c[n * ldc + m]; no epilogue; a split K's slabs are N x M too).
// TC is persistent: CTA i takes tiles i, i + gridDim.x, ... (gemm.py launches one per SM;
// a stack's tiles run on, matrix by matrix: tile t is tile t % tiles of matrix t / tiles),
// and its epilogue (wg_store_t) leaves the ring alone, so the producer loads the next
// tile's slices meanwhile. dW = dz^T @ x (K = the batch, 1024; 256 MB of output) spent a
// sixth of its time on per-tile epilogues and pipeline fills as one CTA per tile; this
// recovers a sixth of that (H100 "high", 1024x8192: 0.404 -> 0.394 ms), the epilogue
// itself still stalling the tensor core. Any other kernel is one tile per CTA: its
// epilogue reuses the ring.
// T: float (MODE 0, 1), or half_t / bf16_t (MODE 3, gemm_mma's 16-bit mode): KS is then
// 64 elements (a slice row is 128 bytes whatever the type) and each of its 4 K steps one
// m64n256k16 wgmma. 16-bit comes K-major by TMA only (transposed operands stay on
// gemm_mma); with split K its slabs hold the raw float sums (splitk_reduce rounds); and
// otherwise it runs MODE 1's pipeline, clusters included.
template <typename T, int MODE, bool TA, bool TB, bool TC, int BOX, int CL, int BM, int BN, int THREADS,
          int STAGES, int SMEM, int KS>
__global__ void __launch_bounds__(THREADS, 1)
CK_CLUSTER_DIMS(CL)
gemm_wgmma(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int M, int N,
           int K, int kchunk, long long lda, long long ldb, long long ldc, const T* __restrict__ bias,
           const float* __restrict__ alpha, const float* __restrict__ beta, float* __restrict__ part,
           const __grid_constant__ TmaMap ma, const __grid_constant__ TmaMap mb, long long sa,
           long long sb, long long sc, int count, long long sa_o, long long sb_o, int inner) {
#ifdef __CUDA_ARCH__  // (NVRTC compiles device code only; an nvcc host pass has no arch)
  // Dependent on MODE, so it fires only where gemm_wgmma is instantiated.
  static_assert(CK_WGMMA || MODE < 0, "gemm_wgmma needs sm_90a (wgmma, setmaxnreg)");
#endif
  using namespace wg_cfg;
  typedef Cfg<MODE, BM, BN, STAGES> C;
  static_assert(MODE == 0 || MODE == 1 || MODE == 3, "gemm_wgmma: MODE 0 (3xTF32), 1 (TF32) or 3 (16-bit)");
  static_assert((MODE == 3) == (sizeof(T) == 2), "gemm_wgmma: MODE 3 is for 16-bit T, 0 and 1 for float");
  static_assert(THREADS == 384, "gemm_wgmma: one producer and two consumer warpgroups (384 threads)");
  static_assert(BM == 128, "gemm_wgmma: two consumer warpgroups of 64 rows (BM == 128)");
  static_assert(BN == (MODE == 0 ? 128 : 256), "gemm_wgmma: wgmma m64nBNk8 (k16) with BN == 128 (MODE 0) or 256");
  static_assert(STAGES >= 2, "gemm_wgmma: the ring needs STAGES >= 2");
  static_assert(KS * sizeof(T) == 128, "gemm_wgmma: a K slice (the tensor maps' box width, "
                "split K's chunk multiple) is one 128-byte swizzled row of T");
  constexpr bool TMA = BOX > 0;
  static_assert(MODE != 3 || (TMA && !TA && !TB), "gemm_wgmma: 16-bit operands K-major, by TMA");
  static_assert(!TMA || !TB, "gemm_wgmma: TMA loads a K-major B (and A either way: a transposed one from registers)");
  constexpr bool A_MN = TMA && TA;  // A: M-major boxes by TMA, fragments loaded to registers
  static_assert(!TC || A_MN, "gemm_wgmma: TC is mm's swapped product (a transposed A by TMA)");
  static_assert(!TMA || (BM % BOX == 0 && BN % BOX == 0 && BOX % 8 == 0 && BOX <= 256),
                "gemm_wgmma: TMA boxes of whole 8-row swizzle groups tile BM and BN (at most 256 rows)");
  static_assert(CL == 1 || (CL == 2 && MODE != 0 && TMA && (BN / 2) % BOX == 0),
                "gemm_wgmma: clusters of 2 CTAs multicast halves of B slices (TF32 or 16-bit, TMA)");
  static_assert(SMEM == C::SMEM,
                "gemm_wgmma: SMEM must be STAGES * STAGE + 3 * STAGES * 8 + 1024, "
                "STAGE = BM * 128 + BN * 128 + (MODE == 0 ? BN * 128 : 0)");
  static_assert(SMEM <= 227 * 1024, "gemm_wgmma: more dynamic smem than an SM has (227 KB)");
  static_assert(BM * (BN + 8) * 4 <= STAGES * C::STAGE, "gemm_wgmma: the epilogue's tile reuses the ring");
  constexpr int R = BN / 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle pattern is anchored to 1024-byte boundaries of the address.
  const unsigned s0 = (smem_addr(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (s0 - smem_addr(smem_raw));
  const unsigned full0 = s0 + STAGES * C::STAGE, empty0 = full0 + STAGES * 8, loaded0 = empty0 + STAGES * 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // A stack of `count` products (gemm_kernels.batched_call): blockIdx.y is the matrix
  // (TC: each tile's, see above). Matrix y of A starts (y / inner) * sa_o + (y % inner) * sa
  // elements after the first one's (two levels of batch strides: attention's (batch, head)
  // views of one projection; one level: inner == count; 0: one matrix broadcast), B's
  // likewise, C's y * sc. TMA's maps span the whole stack: matrix y's first element is
  // the map's row off / ld, column off % ld, the column added to the K coordinate (A_MN:
  // to the M coordinate). A tile's rows past M (N) read the next matrix's rows or
  // columns, or zeros past the map, and reach only the output rows (columns) past M (N),
  // which the stores mask. Where a matrix starts past column 0, or A_MN's K rows lie
  // in the map's rows, K is a multiple of KS (the host checks it), so that no slice reads
  // another matrix's K. A stack takes no split K; a single product passes sa = sb = sc =
  // sa_o = sb_o = 0, count = inner = 1.
  const int tiles = ((M + BM - 1) / BM) * ((N + BN - 1) / BN);  // a matrix's
  const auto matrix_of = [&](int tile) -> long long { return TC ? tile / tiles : blockIdx.y; };
  const auto offset = [&](long long y, long long s, long long s_o) { return y / inner * s_o + y % inner * s; };
  if constexpr (!TC) {  // (TC: TMA coordinates and c per tile)
    a += offset(blockIdx.y, sa, sa_o);
    b += offset(blockIdx.y, sb, sb_o);
    c += blockIdx.y * sc;
  }
  // Split K: TMA addresses the whole tensor from kbase; kchunk is a multiple of the
  // K slice KS (gemm.py, _split), so no slice reaches the next chunk. (16-bit: this
  // chunk's slab of float sums in the workspace c. TC: slabs of the stored N x M.)
  const int kbase = blockIdx.z * kchunk;
  float* const slab = reinterpret_cast<float*>(c) + (long long)blockIdx.z * M * ldc;
  split_k<TA, TB>(a, b, c, TC ? N : M, K, lda, ldb, ldc, kchunk);
  const int ktiles = (K + KS - 1) / KS;
  // this CTA's tiles: [blockIdx.x, end) in steps of gridDim.x (TC), else blockIdx.x alone;
  // a slice's stage and barrier phase follow the CTA's running count of slices
  const int end = TC ? tiles * count : blockIdx.x + 1;
  const int total = (end - blockIdx.x + gridDim.x - 1) / gridDim.x * ktiles;  // slices
  const auto origin = [&](int tile, int& m0, int& n0) { grouped_tile<BM, BN>(M, N, m0, n0, tile % tiles); };
  if (tid == 0) {
    if constexpr (TMA) {
      tma_prefetch(ma);
      tma_prefetch(mb);
    }
    const int landers = TMA ? 1 : C::LOADERS;  // arrivals that mark a slice landed
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, MODE == 0 ? 128 - C::LOADERS : landers);
      // MODE 0: every consumer thread (each reads A from smem itself); MODE 1: every
      // consumer warp (only its wgmma read the stage, complete at wgmma.wait_group).
      mbar_init(empty0 + 8 * s, MODE == 0 ? THREADS - 128 : 8 * CL);
      mbar_init(loaded0 + 8 * s, landers);
    }
    mbar_init_fence();
  }
  if constexpr (CL > 1) {  // the peer's barriers are initialised before any copy or arrival reaches them
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
  }
  const unsigned rank = cluster_ctarank();
  // Release stage s: each consumer warp arrives on the stage's `empty` barrier of every
  // CTA of the cluster (the producers' copies into it multicast to all of them).
  const auto release = [&](int s) {
    if constexpr (CL > 1) {
      if (lane < CL) mbar_arrive_cluster(empty0 + 8 * s, lane);
    } else if (lane == 0) {
      mbar_arrive(empty0 + 8 * s);
    }
  };

  if (warp < 4) {  // ---- producer warpgroup
    set_max_regs<56>();
    if (TMA && tid < C::LOADERS) {  // one thread: stage s free -> bulk copies -> `loaded` or `full`
      if (tid == 0) {
        const unsigned landed0 = MODE == 0 ? loaded0 : full0;
        for (int tile = blockIdx.x, it = 0; tile < end; tile += gridDim.x)
        for (int kt = 0, m0, n0, ra, rb, ca, cb; kt < ktiles; ++kt, ++it) {
          if (kt == 0) {  // the tile's matrix: its first elements' map rows and columns
            origin(tile, m0, n0);
            const long long oa = offset(matrix_of(tile), sa, sa_o), ob = offset(matrix_of(tile), sb, sb_o);
            ra = (int)(oa / lda), ca = (int)(oa % lda);
            rb = (int)(ob / ldb), cb = (int)(ob % ldb);
          }
          const int s = it % STAGES;
          if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned st = s0 + s * C::STAGE, bar = landed0 + 8 * s;
          mbar_arrive_expect_tx(bar, C::A_BYTES + C::B_BYTES);  // whole boxes, zero-filled or not
          if constexpr (A_MN) {  // boxes of 32 M (the map's columns) x the slice's 32 K rows
#pragma unroll
            for (int r = 0; r < BM; r += 32) tma_load(st + r * 128, ma, ca + m0 + r, ra + kbase + kt * KS, bar);
          } else {
#pragma unroll
            for (int r = 0; r < BM; r += BOX) tma_load(st + r * 128, ma, ca + kbase + kt * KS, ra + m0 + r, bar);
          }
          if constexpr (CL > 1) {  // this CTA's 1/CL of B, to every CTA of the cluster (same n0)
#pragma unroll
            for (int r = rank * (BN / CL); r < (rank + 1) * (BN / CL); r += BOX)
              tma_load_multicast(st + C::A_BYTES + r * 128, mb, cb + kbase + kt * KS, rb + n0 + r, bar, (1 << CL) - 1);
          } else {
#pragma unroll
            for (int r = 0; r < BN; r += BOX) tma_load(st + C::A_BYTES + r * 128, mb, cb + kbase + kt * KS, rb + n0 + r, bar);
          }
        }
        // The peers' consumers arrive on this CTA's barriers until their last slices:
        // wait for those arrivals (the last STAGES slices' releases) before exiting.
        if constexpr (CL > 1)
          for (int it = max(total - STAGES, 0); it < total; ++it)
            mbar_wait(empty0 + 8 * (it % STAGES), (it / STAGES) & 1);
      }
    } else if (tid < C::LOADERS) {  // loaders: stage s free -> copies issued -> `loaded` (3xTF32) or `full`
      int m0, n0;  // one tile (TC loads by TMA)
      origin(blockIdx.x, m0, n0);
      const T* ga = a + (TA ? m0 : (long long)m0 * lda);
      const T* gb = b + (TB ? n0 : (long long)n0 * ldb);
      const unsigned landed0 = MODE == 0 ? loaded0 : full0;
      const auto swizzled = [](int r, int k) { return (unsigned)(swz_off(r * 8 + (k >> 2)) + (k & 3) * 4); };
      for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt % STAGES;
        if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) + 1) & 1);
        const unsigned st = s0 + s * C::STAGE;
        if constexpr (TA) load_transposed<BM, C::LOADERS>(st, ga, lda, M - m0, kt * KS, K, tid, swizzled);
        else load_swizzled<BM, C::LOADERS>(st, ga, lda, M - m0, kt * KS, K, tid);
        if constexpr (TB) load_transposed<BN, C::LOADERS>(st + C::A_BYTES, gb, ldb, N - n0, kt * KS, K, tid, swizzled);
        else load_swizzled<BN, C::LOADERS>(st + C::A_BYTES, gb, ldb, N - n0, kt * KS, K, tid);
        mbar_arrive_cp_async(landed0 + 8 * s);
      }
      cp_async_commit();  // exit only once this thread's copies (and their arrivals) are done
      cp_async_wait<0>();
    } else if constexpr (MODE == 0) {  // splitters: slice landed -> remainders written -> `full`
      const int t = tid - C::LOADERS;
      for (int tile = blockIdx.x, it = 0; tile < end; tile += gridDim.x)
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % STAGES;
        mbar_wait(loaded0 + 8 * s, (it / STAGES) & 1);
        const unsigned st = s0 + s * C::STAGE;
        split_swizzled<BN, 128 - C::LOADERS>(st + C::A_BYTES, st + C::B_SMALL, t);
        fence_proxy_async();
        mbar_arrive(full0 + 8 * s);
      }
    }
    return;
  }

  // ---- consumer warpgroups
  set_max_regs<224>();
  const int cw = warp - 4, cwg = cw >> 2;
  float acc[R], pro[MODE == 0 ? R : 1];

  constexpr int AF = MODE == 0 || A_MN ? 4 : 1;  // A fragments in registers, per K step
  // One K slice. Where A comes from registers, each slice waits for its own wgmma
  // (wait<0>) before the next slice loads fragments: ptxas serialises every wgmma of a
  // kernel that writes a wgmma's register operands while any wgmma is in flight (C7513;
  // dx = dy @ W "high" ran at 0.84x cuBLAS TF32 so, with two alternating register sets).
  // The other consumer warpgroup's wgmma keep the tensor core busy meanwhile.
  auto slice = [&](int it, int kt) {  // the CTA's slice `it`, slice kt of its tile
    const int s = it % STAGES;
    mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
    // cp.async (generic proxy) writes -> wgmma (async proxy) reads. TF32's TMA writes need
    // none (1-2% at 16384x4096x4096 and 8192^3); 3xTF32 keeps it (its splitters fence
    // their own writes, but dropping it here timed 3-5% slower).
    if constexpr (!TMA || MODE == 0) fence_proxy_async();
    const unsigned st = s0 + s * C::STAGE;
    const unsigned a_big = st + cwg * 64 * 128, b_big = st + C::A_BYTES;
    unsigned ab[AF][4], as[MODE == 0 ? 4 : 1][4];  // A's fragments; MODE 0: their small parts
    if constexpr (A_MN) load_a_mn(st, cwg * 64 + (cw & 3) * 16, ab);
    else if constexpr (MODE == 0) load_a(a_big, ab);
    if constexpr (MODE == 0) split_a(ab, as);
    wg_fence_regs(acc);
    wg_arrive();
    // 4 K steps of 8 floats (16 halves) = 32 bytes of the swizzled row. 3xTF32 sums the slice's
    // small products first, while the running sum is ~2^-10 of the result, then the 4
    // big ones: each wgmma truncates its addends toward zero at the scale of the running
    // sum, so only those 4 drift at the result's scale (measured: 3x less same-sign drift
    // than interleaving, 1.7x SGEMM's max error instead of 2.4x, at the same speed).
    // Centring the sum as gemm_mma does costs 40% here, and promoting after each pair
    // of big wgmmas 15% with no gain in max error.
    if constexpr (MODE == 0) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wgmma_tf32(acc, as[ks], wg_desc(b_big + ks * 32), ks > 0);
        wgmma_tf32(acc, ab[ks], wg_desc(st + C::B_SMALL + ks * 32), 1);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_tf32(acc, ab[ks], wg_desc(b_big + ks * 32), 1);
    } else if constexpr (A_MN) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_tf32(acc, ab[ks], wg_desc(b_big + ks * 32), kt > 0 || ks > 0);
    } else if constexpr (MODE == 3) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        wgmma_16<is_bf16<T>::value>(acc, wg_desc(a_big + ks * 32), wg_desc(b_big + ks * 32), kt > 0 || ks > 0);
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        wgmma_tf32(acc, wg_desc(a_big + ks * 32), wg_desc(b_big + ks * 32), kt > 0 || ks > 0);
    }
    wg_commit();
    if (MODE == 0) {
      wg_wait<0>();
      wg_fence_regs(acc);
      mbar_arrive(empty0 + 8 * s);  // after this thread's own reads of the stage
#pragma unroll
      for (int i = 0; i < R; ++i) pro[i] += acc[i];  // promotion; the next slice overwrites acc
    } else if (A_MN) {
      wg_wait<0>();  // (see above)
      release(s);
    } else {
      wg_wait<1>();  // slice kt-1 is done: its stage may be reused
      if (kt > 0) release((it - 1) % STAGES);
    }
  };
  for (int tile = blockIdx.x, it = 0; tile < end; tile += gridDim.x) {
    int m0, n0;
    origin(tile, m0, n0);
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < (MODE == 0 ? R : 1); ++i) pro[i] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt, ++it) slice(it, kt);
    wg_wait<0>();
    wg_fence_regs(acc);
    if (MODE != 0 && !A_MN && ktiles > 0) release((it - 1) % STAGES);  // (the producers' exit waits for it)
    const auto store = [&](const float (&res)[R]) {
      if constexpr (TC) {
        wg_store_t<T, BN>(res, c + matrix_of(tile) * sc, M, N, ldc, m0, n0);
      } else if constexpr (MODE == 3) {  // (gemm.py passes no epilogue or part to a split)
        if (gridDim.z > 1) wg_store<float, BM, BN>(res, smem, slab, M, N, ldc, m0, n0, nullptr, nullptr, nullptr, nullptr);
        else wg_store<T, BM, BN>(res, smem, c, M, N, ldc, m0, n0, bias, alpha, beta, part);
      } else {
        wg_store<T, BM, BN>(res, smem, c, M, N, ldc, m0, n0, bias, alpha, beta, part);
      }
    };
    if constexpr (MODE == 0) store(pro);
    else store(acc);
  }
}
