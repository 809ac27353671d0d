// Shared by the normalize kernels (normalize.cu, normalize_short.cu, normalize_long.cu,
// normalize_resident.cu, normalize_pipelined.cu): y = x / d(row) over the last
// (contiguous) axis, P == 1: d = mean(|x|), P == 2: d = sqrt(sum(x^2)); the backward dx
// from x and dy.
#pragma once
#include "common.cuh"

// A row's norm term. BWD (the backward's own sum for d): nan for an infinite element, so
// that such a row's dx is nan as torch's backward gives it (its x / d^2 is inf / inf),
// while a row of finite elements whose sum overflows keeps d = inf (and dx = 0: Grad).
template <int P, bool BWD = false, typename A> __device__ __forceinline__ A norm_term(A v) {
  if (BWD && fabs(v) == infinity<A>()) return quiet_nan<A>();
  return P == 1 ? fabs(v) : v * v;
}

// The divisor from the row's reduction, rounded to T first as torch does
// (torch computes mean/norm in the accumulation type, then stores it as T).
template <int P, typename T, typename A> __device__ __forceinline__ A row_divisor(A s, long long n) {
  A d = P == 1 ? s / (A)n : sqrt(s);
  return to_acc(from_acc<T>(d));
}

// y = x / d. For ordinary d a reciprocal multiply is within an ulp of the
// division; 0, inf, nan, denormal and huge d (whose reciprocal would flush to
// zero under -ftz) use the true division so special rows match torch exactly.
template <typename A> struct Scaler {
  A d, r;
  bool exact;
  __device__ __forceinline__ explicit Scaler(A d_) : d(d_), r((A)1 / d_) {
    const A lo = sizeof(A) == 4 ? (A)1.2e-38 : (A)2.3e-308;
    const A hi = sizeof(A) == 4 ? (A)8.5e37 : (A)4.4e307;
    exact = !(d >= lo && d <= hi);
  }
  __device__ __forceinline__ A operator()(A x) const { return exact ? x / d : x * r; }
};

// Where a row's 16-byte vectors are: `head` scalar elements before the first
// 16-byte boundary, `nvec` whole vectors, then scalars from `tail0` to the end.
struct RowSplit {
  int head, nscalar;
  long long nvec, tail0;
  template <typename T> __device__ __forceinline__ RowSplit(const T* xr, long long ncols) {
    head = (int)(((16u - ((unsigned)(size_t)xr & 15u)) & 15u) / sizeof(T));
    if (head > ncols) head = (int)ncols;
    nvec = (ncols - head) / (16 / sizeof(T));
    tail0 = head + nvec * (16 / sizeof(T));
    nscalar = head + (int)(ncols - tail0);
  }
  // Position of scalar k < nscalar: [0, head) then [tail0, ncols).
  __device__ __forceinline__ long long scalar_pos(int k) const {
    return k < head ? (long long)k : tail0 + (k - head);
  }
};

// Backward of y = x / d: with s = sum(dy * x) over the row,
//   P == 1: dx = (dy - sign(x) * (s / d / n)) / d
//   P == 2: dx = (dy - x * (s / d / d)) / d
// built from the row's two sums (norm term, dy.x); d rounded to T as the forward rounds it.
// In this order no step overflows for a finite d (|s| / d is at most |dy|'s norm, or n
// times its largest element for P == 1), as torch's backward of x / d does not: written
// dy / d - x * s / d^3, d^3 overflowed from d = 7e12 (float32), and dx lost its second
// term (the whole gradient, for a row of equal elements).
// 16-bit T: dy / d through Scaler (a reciprocal multiply for ordinary d, as the forward
// scales), since eight elements a 16-byte vector made the true division the bound. H200
// GPU time (graph replay), division / reciprocal: 1048576x32 bfloat16 L1 62.1 / 59.4 us,
// 4096x65535 bfloat16 L1 531 / 494, L2 487 / 437. float32 keeps the division: there the
// reciprocal's registers cost occupancy (100000x300 L1: 88 registers against 80, 97.8 /
// 107.2 us) and gained nothing elsewhere (4096x65535 L2 837 / 847).
template <int P, typename T, typename A> struct Grad {
  Scaler<A> inv;
  A c;
  __device__ __forceinline__ Grad(A norm_sum, A dot, long long n)
      : inv(row_divisor<P, T>(norm_sum, n)) {
    const A d = inv.d;
    // d = inf from a sum of finite terms that overflowed: torch's x / d^2 is 0 term by
    // term, where dot / d / d could be inf / inf
    c = d == infinity<A>() ? (A)0 : P == 1 ? dot / d / (A)n : dot / d / d;
  }
  __device__ __forceinline__ A operator()(A xv, A gv) const {
    const A t = P == 1 ? (A)((xv > 0) - (xv < 0)) : xv;  // sign(nan) = 0, as torch.sign
    const A v = gv - t * c;
    return sizeof(T) < 4 ? inv(v) : v / inv.d;
  }
};

// write(f) with f(x value, dy value) -> the output value, for a row whose sums are s (the
// norm terms) and t (dy . x, BWD): dx (Grad) backward, y = x / d forward.
template <int P, typename T, bool BWD, typename A, typename W>
__device__ __forceinline__ void with_row_output(A s, A t, long long ncols, W&& write) {
  if constexpr (BWD) {
    const Grad<P, T, A> grad(s, t, ncols);
    write([&](A xv, A gv) { return grad(xv, gv); });
  } else {
    const Scaler<A> scale(row_divisor<P, T>(s, ncols));
    write([&](A xv, A) { return scale(xv); });
  }
}

// The vectors of item `item`'s chunk (normalize_long.cu's items, the few-rows kernels'
// CTAs): [v0, v1) of its row's 16-byte vectors (RowSplit's grid); chunk 0 also takes the
// row's head and tail scalars. Chunks are VC vectors, each boundary `shift` vectors
// earlier (chunk 0 that many shorter): where the row's first vector lies `shift` vectors
// past a line and VC is whole lines, every chunk but the first starts on a line (the
// caller's VC covers nvec + shift in nchunks chunks). Empty where v0 >= v1.
struct Chunk {
  long long row, k, v0, v1;
  __device__ __forceinline__ Chunk(long long item, long long nchunks, long long vc, long long nvec,
                                   long long shift = 0) {
    row = item / nchunks, k = item % nchunks;
    v0 = k ? k * vc - shift : 0;
    v1 = min((k + 1) * vc - shift, nvec);
  }
  // Loads the UNROLL vectors of x (and, BWD, dy) at v, v + THREADS, ... that lie in the chunk.
  template <int THREADS, int UNROLL, bool BWD, typename T>
  __device__ __forceinline__ void load(Vec16<T> (&b)[UNROLL], Vec16<T> (&g)[BWD ? UNROLL : 1],
                                       const T* xr, const T* gr, int head, long long v) const {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      const long long w = v + (long long)i * THREADS;
      if (w < v1) {
        b[i].u = ld_global_nc_v4(xr + head + w * Vec16<T>::N);
        if constexpr (BWD) g[i].u = ld_global_nc_v4(gr + head + w * Vec16<T>::N);
      }
    }
  }
};
