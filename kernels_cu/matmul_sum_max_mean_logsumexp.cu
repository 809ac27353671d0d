// MatmulSumMaxMeanLogSumExp: out[b] = sum_j (x[b] . W[j] + bias[j]), x (B,K), W (N,K).
// (max, mean and logsumexp over the size-1 dim that follow are identities.)
//
// Fast path: out[b] = x[b] . wsum + bsum with wsum = W.sum(0), bsum = bias.sum(), all in
// float64. A "plan" (wsum, bsum, max|W|, max|bias|) is built from the weights by
// matmul_sum_colsum_partial + matmul_sum_colsum_final; matmul_sum_rows then reads x once.
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

// Pass 1: block (BX, BY) = (32, 8) sums a tile of BX*V columns over one chunk of rows of W.
// Each thread loads U (8) rows at once (one step), adds them in the accumulation type and
// then once into float64 (1/U of the slow 64-bit conversions; the rounding is that
// of float32 on U values), then the BY row phases are added in order: deterministic.
// A step of the block covers BY * U rows (the caller makes chunks a multiple of it).
// Writes psum[chunk][col] and the tile's max|W|.
template <typename T, int V, int BX, int BY, int U>
__global__ void __launch_bounds__(BX * BY)
matmul_sum_colsum_partial(const T* __restrict__ w, long long ldw, long long N, long long K,
                    long long rows_per_chunk, double* __restrict__ psum, double* __restrict__ pmax) {
  typedef typename acc_of<T>::type A;
  typedef decltype(abs_key(A())) Key;
  static_assert(BX == 32, "matmul_sum_colsum_partial: a warp is one row phase ty (blockDim.x == 32)");
  static_assert(BY >= 1 && BX * BY <= 1024, "matmul_sum_colsum_partial: at most 1024 threads");
  static_assert(U >= 1, "matmul_sum_colsum_partial: U >= 1");
  __shared__ double red[BY][BX * V];
  __shared__ Key kred[BY];

  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long c0 = ((long long)blockIdx.x * BX + tx) * V;
  const long long r0 = (long long)blockIdx.y * rows_per_chunk;
  const long long r1 = min(r0 + rows_per_chunk, N);
  double s[V];
#pragma unroll
  for (int e = 0; e < V; ++e) s[e] = 0;
  Key key = 0;
  if (c0 < K) {
    for (long long r = r0 + ty; r < r1; r += U * BY) {
      Pack<T, V> p[U] = {};  // zeros: rows past the chunk add nothing
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * BY < r1) load_pack(p[u], w + (r + u * BY) * ldw + c0);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        A g = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const A v = to_acc(p[u].e[e]);
          g += v;
          key = max(key, abs_key(v));
        }
        s[e] += (double)g;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) red[ty][tx * V + e] = s[e];
  key = warp_max_key(key);  // a warp is one ty (blockDim.x == 32)
  if (tx == 0) kred[ty] = key;
  __syncthreads();
  if (ty == 0 && c0 < K) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      double t = 0;
#pragma unroll
      for (int i = 0; i < BY; ++i) t += red[i][tx * V + e];
      psum[blockIdx.y * K + c0 + e] = t;
    }
  }
  if (tx == 0 && ty == 0) {
    Key m = 0;
    for (int i = 0; i < BY; ++i) m = max(m, kred[i]);
    pmax[(long long)blockIdx.y * gridDim.x + blockIdx.x] = key_value(m);
  }
}

template <typename K> __device__ __forceinline__ K block_max_key(K v, K* scratch) {
  v = warp_max_key(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  K m = 0;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) m = max(m, scratch[i]);
  __syncthreads();
  return m;
}

// Pass 2: plan[k] = sum of psum[c][k] over chunks c in order (blocks 0..gridDim.x-2);
// the last block writes plan[K..K+2] = bias.sum(), max|W|, max|bias| (float64).
// Loads go in batches of 8 so a thread waits for one round trip per batch, not per value.
// Grid cdiv(K, THREADS) + 1, block THREADS.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
matmul_sum_colsum_final(const double* __restrict__ psum, const double* __restrict__ pmax,
                  long long nchunks, long long npmax, long long K, const T* __restrict__ bias,
                  long long N, double* __restrict__ plan) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024,
                "matmul_sum_colsum_final: THREADS must be whole warps, at most 1024 (scratch[32])");
  constexpr int B8 = 8;
  if (blockIdx.x + 1 < gridDim.x) {
    const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < K) {
      double s = 0;
      for (long long c = 0; c < nchunks; c += B8) {
        double v[B8];
#pragma unroll
        for (int u = 0; u < B8; ++u) v[u] = c + u < nchunks ? psum[(c + u) * K + k] : 0.0;
#pragma unroll
        for (int u = 0; u < B8; ++u)
          if (c + u < nchunks) s += v[u];
      }
      plan[k] = s;
    }
    return;
  }
  __shared__ double scratch[32];
  __shared__ u64 kscratch[32];
  const long long step = blockDim.x;
  u64 kw = 0, kb = 0;
  double bs = 0;
  for (long long i = threadIdx.x; i < npmax; i += B8 * step) {
    double v[B8];
#pragma unroll
    for (int u = 0; u < B8; ++u) v[u] = i + u * step < npmax ? pmax[i + u * step] : 0.0;
#pragma unroll
    for (int u = 0; u < B8; ++u) kw = max(kw, abs_key(v[u]));
  }
  if (bias != nullptr) {
    for (long long i = threadIdx.x; i < N; i += B8 * step) {
      double v[B8];
#pragma unroll
      for (int u = 0; u < B8; ++u) v[u] = i + u * step < N ? (double)to_acc(bias[i + u * step]) : 0.0;
#pragma unroll
      for (int u = 0; u < B8; ++u) {
        if (i + u * step < N) {
          bs += v[u];
          kb = max(kb, abs_key(v[u]));
        }
      }
    }
  }
  bs = block_sum(bs, scratch);
  kw = block_max_key(kw, kscratch);
  kb = block_max_key(kb, kscratch);
  if (threadIdx.x == 0) {
    plan[K] = bs;
    plan[K + 1] = key_value(kw);
    plan[K + 2] = key_value(kb);
  }
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
// of 16 bytes before using any.
// plan = [wsum (K), bsum, max|W|, max|bias|] in float64.
// Row b takes the fast path when z_bound = K*max|x[b]|*max|W| + max|bias| < zlim, where
// zlim (host) keeps every z, every partial sum and the output finite in T and in torch's
// accumulation type; written so that nan fails it.
// Block THREADS, grid cdiv(B, R).
template <typename T, int V, int R, int THREADS>
__global__ void __launch_bounds__(THREADS)
matmul_sum_rows(const T* __restrict__ x, long long ldx, long long B, long long K,
          const double* __restrict__ plan, const T* __restrict__ w, long long ldw,
          const T* __restrict__ bias, long long N, double zlim, T* __restrict__ out) {
  typedef typename acc_of<T>::type A;
  typedef decltype(abs_key(A())) Key;
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "matmul_sum_rows: THREADS must be whole warps, at most 1024");
  constexpr int NW = THREADS / 32, U = R == 1 ? 8 : 16 / R;
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
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * THREADS;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (i < nv && r < nrows) load_pack(p[u][r], x0 + r * ldx + i * V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * THREADS;
      if (i < nv) {
        double ws[V];
        load_f64<V>(ws, plan + i * V);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r < nrows) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const A v = to_acc(p[u][r].e[e]);
              acc[r] = fma((double)v, ws[e], acc[r]);
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
