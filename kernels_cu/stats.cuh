// Column statistics shared by the GEMM epilogue and the BatchNorm kernels: a thread's
// two-pass (count, mean, M2) and (min, max) of its values, Chan et al.'s parallel merge,
// and reductions in chunks of threads. (Needs common.cuh.)
#pragma once

// Rows per M tile of the GEMM's partial statistics of each column: mean, M2, min, max
// (part[(PART_ROWS*mt + r)*N + n]); the BatchNorm coefficient kernel reads them.
constexpr int PART_ROWS = 4;

// Chan et al.: merge partial b into the running (n, mean, m2).
// (Into an empty one: b itself, which the formula gives too but for d * d overflowing,
// inf * 0 = nan, where |mean| passes sqrt(A's max).)
template <typename A>
__device__ __forceinline__ void chan_merge(A& n, A& mean, A& m2, A nb, A meanb, A m2b) {
  if (nb == (A)0) return;
  if (n == (A)0) {
    n = nb;
    mean = meanb;
    m2 = m2b;
    return;
  }
  const A nn = n + nb, d = meanb - mean, f = nb / nn;
  mean += d * f;
  m2 += m2b + d * d * n * f;
  n = nn;
}

// Per-thread two-pass (mean, M2) of V values, `valid[i]` marking rows inside M.
template <typename A, int V>
__device__ __forceinline__ void local_stats(const A (&v)[V], const bool (&valid)[V], A& n,
                                            A& mean, A& m2) {
  A s = 0;
  n = 0;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (valid[i]) { s += v[i]; n += 1; }
  mean = n > (A)0 ? s / n : (A)0;
  m2 = 0;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (valid[i]) { const A d = v[i] - mean; m2 += d * d; }
}

// Per-thread min and max of the same values (+inf, -inf if none valid; nan is skipped:
// it reaches the mean anyway).
template <typename A, int V>
__device__ __forceinline__ void local_range(const A (&v)[V], const bool (&valid)[V], A& lo, A& hi) {
  lo = infinity<A>();
  hi = -infinity<A>();
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (valid[i]) { lo = fmin(lo, v[i]); hi = fmax(hi, v[i]); }
}

// Column reductions over a run of tiles in chunks of threads (bn_train_coef, bn_grad_coef,
// bn_grad_eval_coef): a block of THREADS threads is ``chunks`` chunks (a power of 2
// dividing THREADS) of THREADS / chunks consecutive columns, so that a chunk's loads of a
// tile's row coalesce. Chunk k reduces tiles [t0, t1) of column n, a consecutive run of
// ceil(tiles / chunks) (the last ones shorter or empty); combine_chunks then merges the
// chunks' results in a fixed tree (deterministic for a given shape and chunk count).
// Grid cdiv(N, THREADS / chunks).
struct ColumnChunk {
  int k, n, t0, t1;  // chunk, column, run of tiles
  __device__ __forceinline__ ColumnChunk(int threads, int chunks, int tiles) {
    const int cols = threads / chunks, per = (tiles + chunks - 1) / chunks;
    k = threadIdx.x / cols;
    n = blockIdx.x * cols + threadIdx.x % cols;
    t0 = min(k * per, tiles);
    t1 = min(t0 + per, tiles);
  }
};

// Merge the chunks' s (s.merge(other)) into chunk 0's, halving the chunks each step
// (chunk k takes chunk k + half's): a fixed tree, not tile order. Every thread of the block calls
// it, ``shared`` holding THREADS of S; true on chunk 0's threads, whose s is then the
// column's result over every tile. One chunk: s as it is.
template <int THREADS, typename S>
__device__ __forceinline__ bool combine_chunks(S& s, S* shared, int chunks) {
  const int cols = THREADS / chunks, k = threadIdx.x / cols;
  for (int half = chunks / 2; half > 0; half /= 2) {
    if (k >= half && k < 2 * half) shared[threadIdx.x] = s;
    __syncthreads();
    if (k < half) s.merge(shared[threadIdx.x + half * cols]);
    __syncthreads();
  }
  return k == 0;
}
