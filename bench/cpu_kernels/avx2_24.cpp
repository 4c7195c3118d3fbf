// A 2:4 INT8 GEMM for AVX2 (no AVX-512, no VNNI): the probe of whether HoloServe's 2:4 kernels would pay on
// such CPUs (bench/cpu_kernels/avx2_probe.py; docs/results/2026-11-29-avx2-24-probe.md).
//
// y[m, n] = sum_k (x[m, k] - 128) * w[k, n], x uint8 codes, w int8 and 2:4 along k. Exact: AVX2 has no
// instruction that adds u8 x s8 products in 32 bits, and VPMADDUBSW adds each pair in 16 bits, which
// saturates for full-range weights; so the codes are widened to int16 (x - 128 fits) and VPMADDWD adds each
// pair of int16 products in 32 bits. A 2:4 group keeps two weights, so one pair of products is one group:
// for every group the activations of its 6 possible position pairs are laid out as int16 pairs, 8 rows per
// register, and each column multiplies the pair its mask picks with its two weights. Vectorised over rows;
// 32 rows x 2 columns of accumulators; groups taken in blocks whose activation pairs stay in L1.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kRowRegs = 4, kRows = 8 * kRowRegs, kCols = 2, kGroupBlock = 96;
constexpr int kPairA[6] = {0, 0, 0, 1, 1, 2}, kPairB[6] = {1, 2, 3, 2, 3, 3};

struct Entry {
    int32_t pair;     // group * 6 + which of the 6 position pairs
    int32_t weights;  // the two int16 weights, as one 32-bit lane
};

// x codes [kRows][K] -> pairs[g][p][r][8 rows] of int16 (x - 128) pairs
void interleave(const uint8_t* x, int64_t K, int16_t* pairs) {
    for (int64_t g = 0; g < K / 4; ++g)
        for (int p = 0; p < 6; ++p)
            for (int i = 0; i < kRows; ++i) {
                const uint8_t* row = x + i * K + 4 * g;
                int16_t* d = pairs + ((g * 6 + p) * kRows + i) * 2;
                d[0] = static_cast<int16_t>(row[kPairA[p]] - 128);
                d[1] = static_cast<int16_t>(row[kPairB[p]] - 128);
            }
}

// groups [g0, g1) of kCols columns into acc (kCols x kRows int32), added to it unless `first`
void block(const int16_t* pairs, int64_t g0, int64_t g1, const Entry* e, int32_t* acc, bool first) {
    __m256i a[kCols][kRowRegs];
    for (int c = 0; c < kCols; ++c)
        for (int r = 0; r < kRowRegs; ++r)
            a[c][r] = first ? _mm256_setzero_si256()
                            : _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + (c * kRowRegs + r) * 8));
    const char* base = reinterpret_cast<const char*>(pairs);
    for (int64_t g = g0; g < g1; ++g) {
        const Entry* eg = e + g * kCols;
#pragma GCC unroll 2
        for (int c = 0; c < kCols; ++c) {
            const __m256i w = _mm256_set1_epi32(eg[c].weights);
            const char* p = base + static_cast<int64_t>(eg[c].pair) * (kRowRegs * 32);
#pragma GCC unroll 4
            for (int r = 0; r < kRowRegs; ++r)
                a[c][r] = _mm256_add_epi32(a[c][r], _mm256_madd_epi16(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(p + r * 32)), w));
        }
    }
    for (int c = 0; c < kCols; ++c)
        for (int r = 0; r < kRowRegs; ++r)
            _mm256_store_si256(reinterpret_cast<__m256i*>(acc + (c * kRowRegs + r) * 8), a[c][r]);
}

template <class T>
T* aligned(size_t n) {
    return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
}

}  // namespace

extern "C" {

// Packs w [K, N] (int8, 2:4 along K; K % 4 == 0, N % 2 == 0), then computes y [M, N] int32 from x [M, K]
// `reps` times; returns the seconds of the fastest run, packing excluded, or -1 where w is not 2:4.
double sparse24_avx2(const uint8_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int32_t* y, int reps) {
    const int64_t G = K / 4, colblocks = N / kCols;
    std::vector<Entry> entries(static_cast<size_t>(colblocks * G * kCols));
    for (int64_t n = 0; n < N; ++n)
        for (int64_t g = 0; g < G; ++g) {
            int pos[2] = {0, 1}, found = 0;
            for (int j = 0; j < 4; ++j)
                if (w[(4 * g + j) * N + n] != 0) {
                    if (found == 2) return -1.0;
                    pos[found++] = j;
                }
            if (found == 1) pos[1] = pos[0] == 3 ? 2 : pos[0] + 1;
            if (pos[0] > pos[1]) std::swap(pos[0], pos[1]);
            int p = 0;
            while (kPairA[p] != pos[0] || kPairB[p] != pos[1]) ++p;
            const uint16_t wa = static_cast<uint16_t>(static_cast<int16_t>(w[(4 * g + pos[0]) * N + n]));
            const uint16_t wb = static_cast<uint16_t>(static_cast<int16_t>(w[(4 * g + pos[1]) * N + n]));
            entries[static_cast<size_t>(((n / kCols) * G + g) * kCols + n % kCols)] =
                Entry{static_cast<int32_t>(g * 6 + p), static_cast<int32_t>(wa | (uint32_t(wb) << 16))};
        }
    const int64_t Mp = (M + kRows - 1) / kRows * kRows;
    uint8_t* xp = aligned<uint8_t>(static_cast<size_t>(kRows * K));
    int16_t* pairs = aligned<int16_t>(static_cast<size_t>(G * 6 * kRows * 2));
    int32_t* acc = aligned<int32_t>(static_cast<size_t>(N * kRows));
    double best = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t m0 = 0; m0 < Mp; m0 += kRows) {
            const int64_t rows = std::min<int64_t>(kRows, M - m0);
            std::memcpy(xp, x + m0 * K, static_cast<size_t>(rows * K));
            std::memset(xp + rows * K, 128, static_cast<size_t>((kRows - rows) * K));  // padding rows: zeros
            interleave(xp, K, pairs);
            for (int64_t g0 = 0; g0 < G; g0 += kGroupBlock)
                for (int64_t cb = 0; cb < colblocks; ++cb)
                    block(pairs, g0, std::min(G, g0 + kGroupBlock), entries.data() + cb * G * kCols,
                          acc + cb * kCols * kRows, g0 == 0);
            for (int64_t i = 0; i < rows; ++i)  // column-blocked accumulators -> rows of y
                for (int64_t n = 0; n < N; ++n)
                    y[(m0 + i) * N + n] = acc[((n / kCols) * kCols + n % kCols) * kRows + i];
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::free(xp);
    std::free(pairs);
    std::free(acc);
    return best;
}

}  // extern "C"
