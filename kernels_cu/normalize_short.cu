// Short rows (up to a few KB): a group of G lanes owns a row, so that a warp holds 32 / G
// rows at once instead of a whole CTA holding one. Forward (y = x / d) and the fused
// backward (BWD: dx from x and dy, the formula in Grad) in one kernel.
#include "normalize.cuh"

// One unit of a row a lane holds in registers: a 16-byte vector (VEC) or one element.
template <typename T, bool VEC> struct Unit;
template <typename T> struct Unit<T, true> {
  static constexpr int N = Vec16<T>::N;
  Vec16<T> v;
  __device__ __forceinline__ void load(const T* p) { v.u = ld_global_nc_v4(p); }
  __device__ __forceinline__ T operator[](int j) const { return v.e[j]; }
  template <typename F> __device__ __forceinline__ void store(T* p, F f) const {
    st_global_cs_v4(p, vec_from_acc<T>(f).u);
  }
};
template <typename T> struct Unit<T, false> {
  static constexpr int N = 1;
  T v;
  // L1-allocating: a warp's loads of neighbouring elements share sectors across units
  __device__ __forceinline__ void load(const T* p) { v = *p; }
  __device__ __forceinline__ T operator[](int) const { return v; }
  template <typename F> __device__ __forceinline__ void store(T* p, F f) const { *p = from_acc<T>(f(0)); }
};

// Rows, each of ncols contiguous elements at x + row * xs (dy + row * dys; the output at
// y + row * ys). A group of G lanes owns a row: lane l holds units l, l + G, ... (at most
// UNITS of them), so a warp's loads of one unit index cover 32 / G consecutive rows (one
// contiguous span when the rows are). Each step a warp loads ROWS such sets of rows before
// it reduces any (loads in flight), then scales and stores them; warps walk the steps
// grid-stride. VEC: units are the row's 16-byte vectors, after RowSplit's head scalars; the
// head and tail scalars (fewer than 2 vectors' worth) are read by the group's lanes in turn
// and read again when stored (an L1 hit). Else units are single elements.
// Row sums: a lane's units in order, its scalars, then a butterfly over the group, which
// gives every lane the same bits. Fixed order: deterministic, and the backward (same
// configuration) sees the forward's d. BWD: the rows of x, dy and dx start alike modulo 16
// bytes (the caller checks it); without BWD, dy is unused.
template <int P, typename T, int G, int UNITS, bool VEC, int ROWS, int THREADS, bool BWD>
__global__ void __launch_bounds__(THREADS)
normalize_short_rows(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ y,
                     long long nrows, long long ncols, long long xs, long long dys, long long ys) {
  static_assert(G == 1 || G == 2 || G == 4 || G == 8 || G == 16 || G == 32,
                "normalize_short_rows: G must be a power of two, at most 32");
  static_assert(UNITS >= 1 && ROWS >= 1, "normalize_short_rows: UNITS, ROWS >= 1");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_short_rows: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  typedef Unit<T, VEC> U;
  constexpr int N = U::N, W = 32 / G;  // elements per unit, rows per warp per set
  const int lane = threadIdx.x & 31, grp = lane / G, l = lane % G;
  const long long warp = ((long long)blockIdx.x * THREADS + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * THREADS) >> 5;

  U bx[ROWS][UNITS], bg[BWD ? ROWS : 1][BWD ? UNITS : 1];
  for (long long base = warp * (W * ROWS); base < nrows; base += nwarps * (W * ROWS)) {
    // (every lane runs every step: the butterflies below need the whole warp)
    // Each row's units: VEC, RowSplit's (its vectors from `head`, then the scalars: [0,
    // head) and [tail0, ncols)); else ncols elements. A row past the end has none.
    int head[ROWS], nunits[ROWS], nscalar[ROWS], tail0[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long row = base + r * W + grp;
      head[r] = 0, nunits[r] = 0, nscalar[r] = 0, tail0[r] = 0;
      if (row < nrows) {
        if constexpr (VEC) {
          const RowSplit rs(x + row * xs, ncols);
          head[r] = rs.head, nunits[r] = (int)rs.nvec, nscalar[r] = rs.nscalar, tail0[r] = (int)rs.tail0;
        } else {
          nunits[r] = (int)ncols;
        }
      }
#pragma unroll
      for (int u = 0; u < UNITS; ++u) {
        const int c = u * G + l;
        if (c < nunits[r]) {
          bx[r][u].load(x + row * xs + head[r] + c * N);
          if constexpr (BWD) bg[r][u].load(dy + row * dys + head[r] + c * N);
        }
      }
    }
    auto scalar_pos = [&](int r, int k) { return k < head[r] ? k : tail0[r] + (k - head[r]); };
    A s[ROWS], t[ROWS];  // norm-term and (BWD) dy.x sums
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      s[r] = 0, t[r] = 0;
#pragma unroll
      for (int u = 0; u < UNITS; ++u) {
        if (u * G + l < nunits[r]) {
#pragma unroll
          for (int j = 0; j < N; ++j) {
            const A xv = to_acc(bx[r][u][j]);
            s[r] += norm_term<P, BWD>(xv);
            if constexpr (BWD) t[r] += to_acc(bg[r][u][j]) * xv;
          }
        }
      }
      if constexpr (VEC) {
        const long long row = base + r * W + grp;
        for (int k = l; k < nscalar[r]; k += G) {
          const long long c = scalar_pos(r, k);
          const A xv = to_acc(x[row * xs + c]);
          s[r] += norm_term<P, BWD>(xv);
          if constexpr (BWD) t[r] += to_acc(dy[row * dys + c]) * xv;
        }
      }
#pragma unroll
      for (int o = G / 2; o > 0; o >>= 1) {
        s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
        if constexpr (BWD) t[r] += __shfl_xor_sync(0xffffffffu, t[r], o);
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long row = base + r * W + grp;
      if (row >= nrows) continue;
      auto store_row = [&](auto f) {  // f(x value, dy value) -> output value
        T* yr = y + row * ys + head[r];
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
          const int c = u * G + l;
          if (c < nunits[r])
            bx[r][u].store(yr + c * N, [&](int j) {
              return f(to_acc(bx[r][u][j]), BWD ? to_acc(bg[BWD ? r : 0][BWD ? u : 0][j]) : (A)0);
            });
        }
        if constexpr (VEC) {
          for (int k = l; k < nscalar[r]; k += G) {
            const long long c = scalar_pos(r, k);
            y[row * ys + c] = from_acc<T>(f(to_acc(x[row * xs + c]), BWD ? to_acc(dy[row * dys + c]) : (A)0));
          }
        }
      };
      if constexpr (BWD) {
        const Grad<P, T, A> grad(s[r], t[r], ncols);
        store_row([&](A xv, A gv) { return grad(xv, gv); });
      } else {
        const Scaler<A> scale(row_divisor<P, T>(s[r], ncols));
        store_row([&](A xv, A) { return scale(xv); });
      }
    }
  }
}
