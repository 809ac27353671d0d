// MatmulSumMaxMeanLogSumExp: out[b] = sum_j (x[b] . W[j] + bias[j]), x (B,K), W (N,K).
// (max, mean and logsumexp over the size-1 dim that follow are identities.)
//
// Fast path: out[b] = x[b] . wsum + bsum with wsum = W.sum(0), bsum = bias.sum(), all in
// float64. A "plan" (wsum, bsum, max|W|, max|bias|) is built from the weights by one
// launch of matmul_sum_plan; matmul_sum_rows then reads x once.
//
// The identity is exact only when nothing in torch's chain overflows or is non-finite,
// so matmul_sum_rows bounds every z[b,j] and every partial sum with K*max|x[b]|*max|W|+max|b|
// and computes a row that fails the bound (inf/nan anywhere, or possible overflow) the
// literal way, z[b,j] rounded to T then summed, in the same block: no host sync.
#include "common.cuh"

typedef unsigned long long u64;

// |v| as an integer key whose unsigned order is the order of |v|: non-negative floats
// order like their bit patterns, and every nan (sign cleared) sorts above +inf, so an
// integer max gives max|v| and propagates nan, where fmax would drop it.
__device__ __forceinline__ unsigned abs_key(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ __forceinline__ u64 abs_key(double v) {
  return (u64)__double_as_longlong(v) & 0x7fffffffffffffffull;
}
__device__ __forceinline__ double key_value(unsigned k) { return (double)__uint_as_float(k); }
__device__ __forceinline__ double key_value(u64 k) { return __longlong_as_double((long long)k); }

template <typename K> __device__ __forceinline__ K warp_max_key(K v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const K t = __shfl_xor_sync(0xffffffffu, v, o);
    v = t > v ? t : v;
  }
  return v;
}

// V consecutive elements of T: one 16-byte load, or one scalar load (V == 1, for rows
// that are not 16-byte aligned).
template <typename T, int V> struct Pack { T e[V]; };

template <typename T, int V> __device__ __forceinline__ void load_pack(Pack<T, V>& p, const T* src) {
  if constexpr (V * sizeof(T) == 16) {
    Vec16<T> v;
    v.u = ld_global_nc_v4(src);
#pragma unroll
    for (int e = 0; e < V; ++e) p.e[e] = v.e[e];
  } else {
    static_assert(V == 1, "V must fill 16 bytes or be 1");
    p.e[0] = *src;
  }
}

// V float64 values of the plan (16-byte aligned when V is even).
template <int V> __device__ __forceinline__ void load_f64(double (&d)[V], const double* p) {
  if constexpr (V % 2 == 0) {
#pragma unroll
    for (int h = 0; h < V / 2; ++h) {
      const double2 t = __ldg(reinterpret_cast<const double2*>(p) + h);
      d[2 * h] = t.x;
      d[2 * h + 1] = t.y;
    }
  } else {
    d[0] = __ldg(p);
  }
}

// ---------------------------------------------------------------- plan build

template <typename K> __device__ __forceinline__ K block_max_key(K v, K* scratch) {
  v = warp_max_key(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  K m = 0;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) m = max(m, scratch[i]);
  __syncthreads();
  return m;
}

// One launch builds the whole plan from one read of W and of the bias.
// Block (x, y) with x < ntiles = gridDim.x - 1 sums column tile x (L lanes of V
// elements: 128 bytes wide in the vector path) over row chunk y. THREADS/L row phases;
// each thread adds its U loaded rows in float64, each converted from the accumulation
// type (float32 sums of U rows near W's maximum overflowed; the plan is built once per
// weight change, its time not measured since); the phases are then added in order. With one chunk the block writes plan[cols]; otherwise
// it writes psum[y][cols], and the tile's last block to finish (a counter per tile) adds
// the chunks in order: deterministic. Every block folds its max|W| into one key with
// atomicMax (order-free), and the last block of all writes plan[K+1]. Block (ntiles, 0)
// writes plan[K] = bias.sum() and plan[K+2] = max|bias|; blocks (ntiles, y > 0) exit.
// key_all, blocks_done and tile_done[ntiles] (used only with chunks) are zeroed by the caller.
template <typename T, int V, int L, int THREADS, int U>
__global__ void __launch_bounds__(THREADS)
matmul_sum_plan(const T* __restrict__ w, long long ldw, long long N, long long K,
                long long rows_per_chunk, const T* __restrict__ bias, double* __restrict__ plan,
                double* psum, u64* key_all, unsigned* blocks_done, unsigned* tile_done) {
  typedef typename acc_of<T>::type A;
  typedef decltype(abs_key(A())) Key;
  constexpr int R = THREADS / L, W = L * V;  // row phases, tile width (elements)
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "matmul_sum_plan: whole warps, at most 1024 threads");
  static_assert(L >= 1 && THREADS % L == 0, "matmul_sum_plan: THREADS must be whole row phases of L lanes");
  static_assert(U >= 1, "matmul_sum_plan: U >= 1");
  __shared__ double red[R][W];
  __shared__ double scratch[THREADS / 32];
  __shared__ u64 kscratch[THREADS / 32];
  __shared__ bool s_last;

  const unsigned ntiles = gridDim.x - 1, nchunks = gridDim.y;
  if (blockIdx.x == ntiles) {  // ---- the bias block
    if (blockIdx.y != 0) return;
    constexpr int B8 = 8;
    double bs = 0;
    u64 kb = 0;
    for (long long i = threadIdx.x; bias != nullptr && i < N; i += B8 * THREADS) {
      double v[B8];
#pragma unroll
      for (int u = 0; u < B8; ++u) v[u] = i + u * THREADS < N ? (double)to_acc(bias[i + u * THREADS]) : 0.0;
#pragma unroll
      for (int u = 0; u < B8; ++u)
        if (i + u * THREADS < N) {
          bs += v[u];
          kb = max(kb, abs_key(v[u]));
        }
    }
    bs = block_sum(bs, scratch);
    kb = block_max_key(kb, kscratch);
    if (threadIdx.x == 0) {
      plan[K] = bs;
      plan[K + 2] = key_value(kb);
    }
  } else {  // ---- tile x of W over row chunk y
    const int tx = threadIdx.x % L, ty = threadIdx.x / L;
    const long long t0 = (long long)blockIdx.x * W, c0 = t0 + tx * V;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk, r1 = min(r0 + rows_per_chunk, N);
    double s[V];
#pragma unroll
    for (int e = 0; e < V; ++e) s[e] = 0;
    Key key = 0;
    if (c0 < K) {
      for (long long r = r0 + ty; r < r1; r += U * R) {
        Pack<T, V> p[U] = {};  // zeros: rows past the chunk add nothing
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (r + u * R < r1) load_pack(p[u], w + (r + u * R) * ldw + c0);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          double g = 0;  // (in float32, U rows of W near its maximum overflowed)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const A v = to_acc(p[u].e[e]);
            g += (double)v;
            key = max(key, abs_key(v));
          }
          s[e] += g;
        }
      }
    }
#pragma unroll
    for (int e = 0; e < V; ++e) red[ty][tx * V + e] = s[e];
    const u64 m = block_max_key((u64)abs_key(key_value(key)), kscratch);  // (syncs the block)
    if (threadIdx.x == 0) atomicMax(key_all, m);
    double* dst = nchunks == 1 ? plan : psum + blockIdx.y * K;
    for (int j = threadIdx.x; j < W && t0 + j < K; j += THREADS) {
      double t = 0;
      for (int i = 0; i < R; ++i) t += red[i][j];
      dst[t0 + j] = t;
    }
    if (nchunks > 1) {  // the tile's last block adds its chunks in order
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) s_last = atomicAdd(tile_done + blockIdx.x, 1u) == nchunks - 1;
      __syncthreads();
      if (s_last) {
        __threadfence();
        constexpr int B8 = 8;
        for (int j = threadIdx.x; j < W && t0 + j < K; j += THREADS) {
          double t = 0;
          for (unsigned c = 0; c < nchunks; c += B8) {
            double v[B8];
#pragma unroll
            for (int u = 0; u < B8; ++u) v[u] = c + u < nchunks ? __ldcg(psum + (c + u) * K + t0 + j) : 0.0;
#pragma unroll
            for (int u = 0; u < B8; ++u)
              if (c + u < nchunks) t += v[u];
          }
          plan[t0 + j] = t;
        }
      }
    }
  }
  // The last block of all to count (every tile block and the bias block) writes max|W|.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(blocks_done, 1u) == ntiles * nchunks)
    plan[K + 1] = key_value(atomicMax(key_all, 0ull));
}

// ---------------------------------------------------------------- forward

// The literal chain for one row: z[j] = x . W[j] + bias[j] as torch's Linear forms it (the
// dot rounded to the accumulation type, where it may overflow, then the bias added there,
// then z rounded to T), summed over j in float64. The dot itself is float64, so an overflow
// of torch's own partial sums (which depends on cuBLAS's order) is not reproduced.
// One warp per output j; warps' sums are added in a fixed order. Called by the whole block.
template <typename T>
__device__ double exact_row_sum(const T* __restrict__ xr, long long K, const T* __restrict__ w,
                                long long ldw, const T* __restrict__ bias, long long N,
                                double* scratch) {
  typedef typename acc_of<T>::type A;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  double zs = 0;
  for (long long j = warp; j < N; j += nw) {
    const T* wr = w + j * ldw;
    double d = 0;
    for (long long k = lane; k < K; k += 32) d = fma((double)to_acc(xr[k]), (double)to_acc(wr[k]), d);
    A z = (A)warp_sum(d);
    if (bias != nullptr) z += to_acc(bias[j]);
    zs += (double)to_acc(from_acc<T>(z));
  }
  return block_sum(lane == 0 ? zs : 0.0, scratch);
}

// R rows per block (wsum is read once from L2 for R rows); each thread issues U*R loads
// of 16 bytes of x, and those of wsum they need, before using any.
// plan = [wsum (K), bsum, max|W|, max|bias|] in float64.
// Row b takes the fast path when z_bound = K*max|x[b]|*max|W| + max|bias| < zlim, where
// zlim (host) keeps every z, every partial sum and the output finite in T and in torch's
// accumulation type; written so that nan fails it.
// Block THREADS, grid cdiv(B, R).
template <typename T, int V, int R, int U, int THREADS>
__global__ void __launch_bounds__(THREADS)
matmul_sum_rows(const T* __restrict__ x, long long ldx, long long B, long long K,
          const double* __restrict__ plan, const T* __restrict__ w, long long ldw,
          const T* __restrict__ bias, long long N, double zlim, T* __restrict__ out) {
  typedef typename acc_of<T>::type A;
  typedef decltype(abs_key(A())) Key;
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "matmul_sum_rows: THREADS must be whole warps, at most 1024");
  static_assert(R >= 1 && U >= 1, "matmul_sum_rows: R >= 1 rows, U >= 1 loads per row in flight");
  constexpr int NW = THREADS / 32;
  __shared__ double s_sum[R][NW];
  __shared__ Key s_key[R][NW];
  __shared__ double scratch[NW];

  const long long row0 = (long long)blockIdx.x * R;
  int nrows = (int)min((long long)R, B - row0);
  double acc[R];
  Key key[R];
#pragma unroll
  for (int r = 0; r < R; ++r) { acc[r] = 0; key[r] = 0; }

  const T* x0 = x + row0 * ldx;
  const long long nv = K / V;
  for (long long base = threadIdx.x; base < nv; base += (long long)U * THREADS) {
    Pack<T, V> p[U][R];
    double ws[U][V];  // wsum's values for them, loaded alongside (not one round trip per u)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * THREADS;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (i < nv && r < nrows) load_pack(p[u][r], x0 + r * ldx + i * V);
      if (i < nv) load_f64<V>(ws[u], plan + i * V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * THREADS;
      if (i < nv) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r < nrows) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const A v = to_acc(p[u][r].e[e]);
              acc[r] = fma((double)v, ws[u][e], acc[r]);
              key[r] = max(key[r], abs_key(v));
            }
          }
        }
      }
    }
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const double s = warp_sum(acc[r]);
    const Key k = warp_max_key(key[r]);
    if (lane == 0) { s_sum[r][warp] = s; s_key[r][warp] = k; }
  }
  __syncthreads();

  const double bsum = plan[K], wmax = plan[K + 1], bmax = plan[K + 2];
  for (int r = 0; r < nrows; ++r) {  // block-uniform: every thread reads the same totals
    double total = 0;
    Key k = 0;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      total += s_sum[r][i];
      k = max(k, s_key[r][i]);
    }
    const double zbound = (double)K * key_value(k) * wmax + bmax;
    if (zbound < zlim) {
      if (threadIdx.x == 0) out[row0 + r] = from_acc<T>(total + bsum);
    } else {
      const double s = exact_row_sum(x0 + r * ldx, K, w, ldw, bias, N, scratch);
      if (threadIdx.x == 0) out[row0 + r] = from_acc<T>(s);
    }
  }
}
