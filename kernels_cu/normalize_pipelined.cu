// Many long rows, forward, in row groups over the whole chip, two rows in flight a group. A
// cooperative launch, every CTA resident at once (one per SM), in gridDim.x / cpr groups of
// cpr CTAs: group g walks the rows g, g + groups, ... in order, and its CTA k owns chunk k
// of each (line_chunk over cpr chunks), keeping two rows' chunks on chip, in two banks
// (REGS vectors a thread in registers, `held` vectors in shared memory; the rest streamed,
// re-read from L2 when written). For each row it reads its chunk once into one bank,
// summing it, and publishes the sum; then it writes the row before from the other bank,
// whose sums every CTA of the group published a row earlier: so the row-wide exchange
// waits behind a row's reads, where normalize_resident.cu's CTAs wait for it between their
// reads and writes. Rows a few CTAs hold run in many groups at once, whose exchanges
// overlap one another's reads and writes; one group (cpr = gridDim.x) takes rows as long
// as the whole chip holds. Each row's sums are added in a fixed order (one divisor a row,
// the same in every CTA). Each CTA reads and writes only its own chunks (chunk 0 also each
// row's head and tail scalars), so y may be x.
#include "normalize_chip.cuh"

template <int V> struct Bank { static constexpr int value = V; };

template <int P, typename T, int THREADS, int REGS, int UNROLL, int LINE, int BANKS>
__global__ void __launch_bounds__(THREADS, 1)
normalize_pipelined(const T* __restrict__ x, typename acc_of<T>::type* __restrict__ partial,
                    unsigned* __restrict__ arrived, T* __restrict__ y, long long nrows,
                    long long ncols, long long xs, long long ys, long long cpr, long long held) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_pipelined: THREADS must be whole warps, at most 1024");
  static_assert(REGS >= 1 && UNROLL >= 1, "normalize_pipelined: REGS >= 1, UNROLL >= 1");
  static_assert(BANKS == 2, "normalize_pipelined: the walk below alternates two banks (BANKS == 2)");
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  constexpr long long STEP = (long long)THREADS * UNROLL;
  extern __shared__ uint4 kept[];  // BANKS banks of `held` vectors (a multiple of THREADS)
  __shared__ A scratch[THREADS / 32];
  const long long nchunks = cpr, groups = gridDim.x / cpr;  // (the host launches groups * cpr)
  const long long g = blockIdx.x / cpr, k = blockIdx.x % cpr;
  const int tid = threadIdx.x;
  const L2Policy policy;
  V reg[BANKS][REGS];  // (a bank's index is a constant: registers, not local memory)
  // Each thread copies, holds and writes the vectors tid, tid + THREADS, ... of a bank's
  // shared-memory part: a bank is reused without a barrier.
  // UNROLL vectors of a chunk's rest at v, v + THREADS, ... (those in the chunk)
  auto loads = [&](const T* xv0, const Chunk& ch, V (&b)[UNROLL], long long v,
                   unsigned long long priority) {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      const long long w = v + (long long)i * THREADS;
      if (w < ch.v1) b[i].u = load_v4(xv0 + w * N, priority);
    }
  };

  // Row r into bank B: read once, summed, the sum published.
  auto read = [&](long long r, auto bank) {
    constexpr int B = decltype(bank)::value;
    const T* xr = x + r * xs;
    const RowSplit rs(xr, ncols);
    const Chunk ch = line_chunk<LINE>(xr, rs, k, nchunks);
    const T* xv0 = xr + rs.head;
    uint4* buf = kept + B * held;
    const long long smem0 = ch.v0 + (long long)REGS * THREADS, rest0 = smem0 + held;
    for (long long v = tid; v < held && smem0 + v < ch.v1; v += THREADS)
      copy_to_shared(buf + v, xv0 + (smem0 + v) * N, policy.first);
#pragma unroll
    for (int i = 0; i < REGS; ++i) {
      const long long v = ch.v0 + (long long)i * THREADS + tid;
      if (v < ch.v1) reg[B][i].u = load_v4(xv0 + v * N, policy.first);
    }
    A s = 0;
    auto add = [&](const V& b) {
#pragma unroll
      for (int j = 0; j < N; ++j) s += norm_term<P>(to_acc(b.e[j]));
    };
#pragma unroll
    for (int i = 0; i < REGS; ++i)
      if (ch.v0 + (long long)i * THREADS + tid < ch.v1) add(reg[B][i]);
    for (long long v = rest0 + tid; v < ch.v1; v += STEP) {
      V b[UNROLL];
      loads(xv0, ch, b, v, policy.last);
#pragma unroll
      for (int i = 0; i < UNROLL; ++i)
        if (v + (long long)i * THREADS < ch.v1) add(b[i]);
    }
    copies_to_shared_done();  // (only this row's copies are in flight)
    for (long long v = tid; v < held && smem0 + v < ch.v1; v += THREADS) {
      V b;
      b.u = buf[v];
      add(b);
    }
    if (ch.k == 0 && tid < rs.nscalar) s += norm_term<P>(to_acc(xr[rs.scalar_pos(tid)]));
    s = block_sum(s, scratch);
    if (tid == 0) {
      partial[r * nchunks + k] = s;
      __threadfence();
      atomicAdd(arrived + r, 1u);
    }
  };

  // Row r from bank B: the row's sums (every CTA is resident: the launch is cooperative),
  // then its chunk of y: the rest re-read back to front (what L2 still holds), the front
  // from chip.
  auto write = [&](long long r, auto bank) {
    constexpr int B = decltype(bank)::value;
    const T* xr = x + r * xs;
    T* yr = y + r * ys;
    const RowSplit rs(xr, ncols);
    const Chunk ch = line_chunk<LINE>(xr, rs, k, nchunks);
    const T* xv0 = xr + rs.head;
    const uint4* buf = kept + B * held;
    const long long smem0 = ch.v0 + (long long)REGS * THREADS, rest0 = smem0 + held;
    if (tid == 0) {
      while (*(volatile unsigned*)(arrived + r) < (unsigned)nchunks) __nanosleep(64);
      __threadfence();
    }
    __syncthreads();
    A s = 0;
    for (long long c = tid; c < nchunks; c += THREADS) s += __ldcg(partial + r * nchunks + c);
    s = block_sum(s, scratch);
    with_row_output<P, T, false>(s, (A)0, ncols, [&](auto f) {
      auto out = [&](const V& b) {
        return vec_from_acc<T>([&](int j) { return f(to_acc(b.e[j]), (A)0); }).u;
      };
      if (rest0 < ch.v1) {
        for (long long step = (ch.v1 - rest0 + STEP - 1) / STEP - 1; step >= 0; --step) {
          const long long v = rest0 + step * STEP + tid;
          V b[UNROLL];
          loads(xv0, ch, b, v, policy.first);
#pragma unroll
          for (int i = 0; i < UNROLL; ++i) {
            const long long w = v + (long long)i * THREADS;
            if (w < ch.v1) st_global_cs_v4(yr + rs.head + w * N, out(b[i]));
          }
        }
      }
      for (long long v = tid; v < held && smem0 + v < ch.v1; v += THREADS) {
        V b;
        b.u = buf[v];
        st_global_cs_v4(yr + rs.head + (smem0 + v) * N, out(b));
      }
#pragma unroll
      for (int i = 0; i < REGS; ++i) {
        const long long v = ch.v0 + (long long)i * THREADS + tid;
        if (v < ch.v1) st_global_cs_v4(yr + rs.head + v * N, out(reg[B][i]));
      }
      if (ch.k == 0 && tid < rs.nscalar) {
        const long long c = rs.scalar_pos(tid);
        yr[c] = from_acc<T>(f(to_acc(xr[c]), (A)0));
      }
    });
  };

  // This group's rows g, g + groups, ...: its i-th in bank i % 2.
  const long long mine = nrows > g ? (nrows - g + groups - 1) / groups : 0;
  auto row = [&](long long i) { return g + i * groups; };
  if (mine > 0) read(row(0), Bank<0>());
  for (long long i = 0; i < mine; i += 2) {
    if (i + 1 < mine) read(row(i + 1), Bank<1>());
    write(row(i), Bank<0>());
    if (i + 1 < mine) {
      if (i + 2 < mine) read(row(i + 2), Bank<0>());
      write(row(i + 1), Bank<1>());
    }
  }
}
