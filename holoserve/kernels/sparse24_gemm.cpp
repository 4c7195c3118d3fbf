// HoloServe's 2:4-sparse INT8 Linears for OpenVINO's CPU plugin (AVX-512 VNNI + VBMI).
//
// A Linear here is y[m, n] = scale[n] * (sum_k q(x)[m, k] * w[k, n] - comp[n]) + bias[n], where
// q(x) = clamp(round(x / x_scale) + 128, 0, 255) is ONNX QuantizeLinear with a uint8 zero point of 128,
// comp[n] = 128 * sum_k w[k, n] removes that zero point exactly in int32, and w is 2:4 sparse along k
// (at most two non-zeros in each aligned group of four). The weights are packed per 32-column tile: for
// each chunk of 8 k (two groups) each column keeps 4 int8 values, and `index` holds the positions of
// their k within the 64-k window the chunk lies in. VPERMB gathers each column's four activation bytes
// from that window and VPDPBUSD multiplies them with the four weights: one instruction does the work of
// two dense ones, and the weights take half the bytes (plus as many for the index).
//
// Two operations, as ONNX nodes of domain "holoserve" whose first input is x and whose other inputs are
// the Linears' initializers (weights, index, comp, scale, bias per Linear); converted to OpenVINO ops
// that take x alone and hold the initializers as constants:
//   Sparse24Gemm -> one output per Linear: Linears sharing one input (Q, K and V), quantized once.
//   Sparse24Ffn -> y: Linear, activation (exact GELU or ReLU), QuantizeLinear at `h_scale`, Linear. The
//     hidden layer stays in uint8 codes in cache.
// And a third, Attention (q, k, v, mask -> softmax attention per head), further below.
//
// Built with -DHOLOSERVE_REFERENCE, the arithmetic below is plain scalar C++ instead (any x86-64 CPU): the same
// operations in the same order (one rounding per fused multiply-add, the same erf polynomial, the same
// rounding to codes), so its outputs equal the AVX-512 build's bit for bit, many times slower. It checks the
// ops, the graph rewrite and the numbers on CPUs that cannot run the AVX-512 build, and that build against it.
#ifndef HOLOSERVE_REFERENCE
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/parallel.hpp>
#include <openvino/frontend/onnx/extension/conversion.hpp>
#include <openvino/op/constant.hpp>
#include <openvino/op/op.hpp>

namespace holoserve {

constexpr int kTile = 32;       // output columns per tile: two 16-lane registers
constexpr int kWindow = 64;     // k per VPERMB table
constexpr int kRows = 8;        // rows per register block: 16 accumulators + 8 windows + 2 operands
constexpr int64_t kRowChunk = 256;  // rows per work item (a chunk's hidden codes stay in L2)
constexpr int kParts = 5;       // inputs per Linear: weights, index, comp, scale, bias

struct Linear {
    const int8_t* w;
    const uint8_t* idx;
    const int32_t* comp;
    const float* scale;
    const float* bias;
    int64_t K, N;
    int64_t tile_bytes() const { return (K / 8) * kTile * 4; }
};

// erf on 32 intervals of |v| in [0, 4), each by its Taylor polynomial of degree 4 about the interval's
// centre c: erf(c + t) = erf(c) + sum_k 2/sqrt(pi) e^(-c^2) (-1)^(k-1) H_(k-1)(c) t^k / k!, with H the
// Hermite polynomials. For |t| <= 1/16 it is within 1.2e-7 of erf in float32; erf(4) rounds to 1. Each
// coefficient's 32 values fill two registers, so a lane takes its own with one two-table permute.
struct ErfTable {
    static constexpr int kDegree = 4, kIntervals = 32;
    static constexpr float kWidth = 4.0f / kIntervals;
    alignas(64) float coef[kDegree + 1][kIntervals];
    ErfTable() {
        const double two_over_sqrt_pi = 1.1283791670955126;
        for (int i = 0; i < kIntervals; ++i) {
            const double c = kWidth * (i + 0.5), g = two_over_sqrt_pi * std::exp(-c * c);
            double hermite[kDegree] = {1.0, 2.0 * c};  // H_0 .. H_(degree-1): H_(n+1) = 2c H_n - 2n H_(n-1)
            for (int n = 1; n + 1 < kDegree; ++n) hermite[n + 1] = 2.0 * c * hermite[n] - 2.0 * n * hermite[n - 1];
            coef[0][i] = static_cast<float>(std::erf(c));
            double factorial = 1.0;
            for (int k = 1; k <= kDegree; ++k) {
                factorial *= k;
                coef[k][i] = static_cast<float>(((k - 1) % 2 ? -g : g) * hermite[k - 1] / factorial);
            }
        }
    }
};
static const ErfTable kErf;

enum Activation { kGelu = 0, kRelu = 1 };

#ifndef HOLOSERVE_REFERENCE

// out = float(acc - comp) * scale + bias for 16 columns
static inline __m512 dequantize(__m512i acc, const Linear& L, int64_t col) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(L.comp + col))),
                           _mm512_loadu_ps(L.scale + col), _mm512_loadu_ps(L.bias + col));
}

// uint8 codes of 16 floats (already divided by the scale): round half to even, saturate, +128
static inline __m128i codes(__m512 v) {
    __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-128)), _mm512_set1_epi32(127));
    return _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128)));
}

static inline __m512 erf_ps(__m512 v) {
    const __m512 z = _mm512_min_ps(_mm512_abs_ps(v), _mm512_set1_ps(3.99999976f));
    const __m512i idx = _mm512_cvttps_epi32(_mm512_mul_ps(z, _mm512_set1_ps(1.0f / ErfTable::kWidth)));
    const __m512 t = _mm512_sub_ps(_mm512_fnmadd_ps(_mm512_cvtepi32_ps(idx), _mm512_set1_ps(ErfTable::kWidth), z),
                                   _mm512_set1_ps(0.5f * ErfTable::kWidth));
    const auto c = [&](int k) {  // lane l: coef[k][idx[l]], from the coefficient's two 16-value halves
        return _mm512_permutex2var_ps(_mm512_load_ps(kErf.coef[k]), idx, _mm512_load_ps(kErf.coef[k] + 16));
    };
    __m512 p = c(ErfTable::kDegree);
    for (int k = ErfTable::kDegree - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, t, c(k));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(p), _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))));
}

// 32 columns of R rows: acc[i][j] for rows i, columns 16 j of the tile
template <int R, class Store>
static inline void tile_rows(const uint8_t* xq, int64_t K, const int8_t* w, const uint8_t* idx, const Store& store) {
    __m512i acc[R][2];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t kw = 0; kw < K; kw += kWindow) {
        __m512i x[R];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) x[i] = _mm512_loadu_si512(xq + i * K + kw);
        const int8_t* wc = w + (kw / 8) * kTile * 4;
        const uint8_t* ic = idx + (kw / 8) * kTile * 4;
        // every loop unrolled: a rolled one spills the register arrays to the stack
#pragma GCC unroll 8
        for (int c = 0; c < kWindow / 8; ++c) {
#pragma GCC unroll 2
            for (int j = 0; j < 2; ++j) {
                const __m512i id = _mm512_loadu_si512(ic + (c * kTile + 16 * j) * 4);
                const __m512i wv = _mm512_loadu_si512(wc + (c * kTile + 16 * j) * 4);
#pragma GCC unroll 8
                for (int i = 0; i < R; ++i)
                    acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], _mm512_permutexvar_epi8(id, x[i]), wv);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        store(i, 0, acc[i][0]);
        store(i, 1, acc[i][1]);
    }
}

// rows [0, rows) of one 32-column tile `t` of L, codes xq (row stride K), results through `make(m, t)`
template <class Make>
static void tile_column(const uint8_t* xq, int64_t rows, const Linear& L, int64_t t, const Make& make) {
    const int8_t* w = L.w + t * L.tile_bytes();
    const uint8_t* idx = L.idx + t * L.tile_bytes();
    int64_t m = 0;
    for (; m + kRows <= rows; m += kRows) tile_rows<kRows>(xq + m * L.K, L.K, w, idx, make(m));
    const uint8_t* x = xq + m * L.K;
    switch (rows - m) {
        case 7: tile_rows<7>(x, L.K, w, idx, make(m)); break;
        case 6: tile_rows<6>(x, L.K, w, idx, make(m)); break;
        case 5: tile_rows<5>(x, L.K, w, idx, make(m)); break;
        case 4: tile_rows<4>(x, L.K, w, idx, make(m)); break;
        case 3: tile_rows<3>(x, L.K, w, idx, make(m)); break;
        case 2: tile_rows<2>(x, L.K, w, idx, make(m)); break;
        case 1: tile_rows<1>(x, L.K, w, idx, make(m)); break;
        default: break;
    }
}

// bf16 <-> f32 (round to nearest even; the values here are finite)
static inline __m512 load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
}
static inline void store_bf16(uint16_t* p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// float results (f32, or bf16 when OpenVINO runs the graph around it in bf16): y[row, col], row stride ldy
struct StoreFloat {
    const Linear* L;
    void* y;
    int64_t ldy, col0;
    bool bf16;
    inline void operator()(int i, int j, __m512i acc) const {
        const int64_t col = col0 + 16 * j;
        const __m512 v = dequantize(acc, *L, col);
        if (bf16)
            store_bf16(static_cast<uint16_t*>(y) + i * ldy + col, v);
        else
            _mm512_storeu_ps(static_cast<float*>(y) + i * ldy + col, v);
    }
};

// hidden codes: q(act(linear)) at 1 / h_scale into h[row, col] with row stride ldh
struct StoreCodes {
    const Linear* L;
    uint8_t* h;
    int64_t ldh, col0;
    float inv_scale;
    int act;
    inline void operator()(int i, int j, __m512i acc) const {
        const int64_t col = col0 + 16 * j;
        const __m512 v = dequantize(acc, *L, col);
        __m512 u;  // the activation times 1 / h_scale
        if (act == kRelu) {
            u = _mm512_mul_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(inv_scale));
        } else {  // 0.5 v (1 + erf(v / sqrt 2)) / h_scale as w + w erf(v / sqrt 2), w = v (0.5 / h_scale)
            const __m512 w = _mm512_mul_ps(v, _mm512_set1_ps(0.5f * inv_scale));
            u = _mm512_fmadd_ps(w, erf_ps(_mm512_mul_ps(v, _mm512_set1_ps(0.707106781186547524f))), w);
        }
        const __m128i q = codes(u);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i * ldh + col), q);
    }
};

static void quantize_rows(const void* x, bool bf16, uint8_t* q, int64_t M, int64_t K, float x_scale) {
    // ONNX divides by the scale; the reciprocal product differs from it only on exact rounding ties
    const __m512 inv = _mm512_set1_ps(1.0f / x_scale);
    const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
    ov::parallel_for(chunks, [&](int64_t c) {
        const int64_t end = std::min(M, (c + 1) * kRowChunk) * K;
        for (int64_t e = c * kRowChunk * K; e < end; e += 16) {
            const __m512 v = bf16 ? load_bf16(static_cast<const uint16_t*>(x) + e)
                                  : _mm512_loadu_ps(static_cast<const float*>(x) + e);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + e), codes(_mm512_mul_ps(v, inv)));
        }
    });
}

#else  // HOLOSERVE_REFERENCE: each AVX-512 step above as scalar code, lane by lane

// out = float(acc - comp) * scale + bias, rounded once as VFMADD does (int32 arithmetic wraps as VPSUBD's)
static inline float dequantize(int32_t acc, const Linear& L, int64_t col) {
    const int32_t a = static_cast<int32_t>(static_cast<uint32_t>(acc) - static_cast<uint32_t>(L.comp[col]));
    return std::fma(static_cast<float>(a), L.scale[col], L.bias[col]);
}

// VCVTPS2DQ (round half to even; NaN and out-of-range give INT32_MIN), clamp to [-128, 127], +128
static inline uint8_t code(float v) {
    int32_t q = INT32_MIN;
    if (v >= -2147483648.0f && v < 2147483648.0f) q = static_cast<int32_t>(std::nearbyint(v));
    return static_cast<uint8_t>(std::min(std::max(q, -128), 127) + 128);
}

// erf_ps's steps: VMINPS returns its second operand unless the first is smaller (NaN included)
static inline float erf_scalar(float v) {
    const float a = std::fabs(v), z = a < 3.99999976f ? a : 3.99999976f;
    const int idx = static_cast<int>(z * (1.0f / ErfTable::kWidth));
    const float t = std::fma(-static_cast<float>(idx), ErfTable::kWidth, z) - 0.5f * ErfTable::kWidth;
    float p = kErf.coef[ErfTable::kDegree][idx];
    for (int k = ErfTable::kDegree - 1; k >= 0; --k) p = std::fma(p, t, kErf.coef[k][idx]);
    uint32_t pb, vb;  // v's sign bit ORed into p, as VPORD does
    std::memcpy(&pb, &p, 4);
    std::memcpy(&vb, &v, 4);
    pb |= vb & 0x80000000u;
    std::memcpy(&p, &pb, 4);
    return p;
}

static inline float load_bf16(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
}
static inline void store_bf16(uint16_t* p, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    *p = static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16);
}

// rows [0, rows) of one 32-column tile `t` of L: each row's 32 sums of u8 x s8 products, as VPERMB (the low
// six bits of each index byte pick a byte of the 64-k window) and VPDPBUSD (four products into an int32)
template <class Make>
static void tile_column(const uint8_t* xq, int64_t rows, const Linear& L, int64_t t, const Make& make) {
    const int8_t* w = L.w + t * L.tile_bytes();
    const uint8_t* idx = L.idx + t * L.tile_bytes();
    for (int64_t m = 0; m < rows; ++m) {
        const uint8_t* x = xq + m * L.K;
        int32_t acc[kTile] = {};
        for (int64_t kw = 0; kw < L.K; kw += kWindow) {
            const int8_t* wc = w + (kw / 8) * kTile * 4;
            const uint8_t* ic = idx + (kw / 8) * kTile * 4;
            for (int c = 0; c < kWindow / 8; ++c)
                for (int n = 0; n < kTile; ++n)
                    for (int b = 0; b < 4; ++b) {
                        const int64_t e = (c * kTile + n) * 4 + b;
                        acc[n] += static_cast<int32_t>(x[kw + (ic[e] & 63)]) * static_cast<int32_t>(wc[e]);
                    }
        }
        const auto store = make(m);
        store(0, 0, acc);
        store(0, 1, acc + 16);
    }
}

// float results (f32 or bf16): y[row, col], row stride ldy
struct StoreFloat {
    const Linear* L;
    void* y;
    int64_t ldy, col0;
    bool bf16;
    inline void operator()(int i, int j, const int32_t* acc) const {
        for (int l = 0; l < 16; ++l) {
            const int64_t col = col0 + 16 * j + l;
            const float v = dequantize(acc[l], *L, col);
            if (bf16)
                store_bf16(static_cast<uint16_t*>(y) + i * ldy + col, v);
            else
                static_cast<float*>(y)[i * ldy + col] = v;
        }
    }
};

// hidden codes: q(act(linear)) at 1 / h_scale into h[row, col] with row stride ldh
struct StoreCodes {
    const Linear* L;
    uint8_t* h;
    int64_t ldh, col0;
    float inv_scale;
    int act;
    inline void operator()(int i, int j, const int32_t* acc) const {
        for (int l = 0; l < 16; ++l) {
            const int64_t col = col0 + 16 * j + l;
            const float v = dequantize(acc[l], *L, col);
            float u;
            if (act == kRelu) {
                u = (v > 0.0f ? v : 0.0f) * inv_scale;  // VMAXPS(v, 0)
            } else {
                const float w = v * (0.5f * inv_scale);
                u = std::fma(w, erf_scalar(v * 0.707106781186547524f), w);
            }
            h[i * ldh + col] = code(u);
        }
    }
};

static void quantize_rows(const void* x, bool bf16, uint8_t* q, int64_t M, int64_t K, float x_scale) {
    const float inv = 1.0f / x_scale;
    const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
    ov::parallel_for(chunks, [&](int64_t c) {
        const int64_t end = std::min(M, (c + 1) * kRowChunk) * K;
        for (int64_t e = c * kRowChunk * K; e < end; ++e) {
            const float v = bf16 ? load_bf16(static_cast<const uint16_t*>(x) + e) : static_cast<const float*>(x)[e];
            q[e] = code(v * inv);
        }
    });
}

#endif  // HOLOSERVE_REFERENCE

static std::vector<uint8_t>& scratch(int slot, size_t bytes) {
    thread_local std::vector<uint8_t> buffers[2];
    if (buffers[slot].size() < bytes) buffers[slot].resize(bytes);
    return buffers[slot];
}

// The weights of the ops' Linears: constants held by the op itself, five per Linear (values, index,
// comp, scale, bias), not graph inputs. OpenVINO's CPU plugin runs an extension op as a reference node,
// whose shape inference with dynamic shapes would wrap every input in a new constant on every call.
using Constants = std::vector<std::shared_ptr<ov::op::v0::Constant>>;

static Linear linear_at(const Constants& c, size_t first) {
    Linear L;
    const auto shape = c[first]->get_shape();  // [N/32, K/8, 32, 4]
    L.w = c[first]->get_data_ptr<int8_t>();
    L.idx = c[first + 1]->get_data_ptr<uint8_t>();
    L.comp = c[first + 2]->get_data_ptr<int32_t>();
    L.scale = c[first + 3]->get_data_ptr<float>();
    L.bias = c[first + 4]->get_data_ptr<float>();
    L.N = static_cast<int64_t>(shape[0]) * kTile;
    L.K = static_cast<int64_t>(shape[1]) * 8;
    return L;
}

static int64_t rows_of(const ov::Shape& shape) {
    int64_t M = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) M *= static_cast<int64_t>(shape[d]);
    return M;
}

static bool float_type(const ov::element::Type& t) { return t == ov::element::f32 || t == ov::element::bf16; }

// shared checks: x's last dimension is the first Linear's K, each Linear's weights are [N/32, K/8, 32, 4]
class Sparse24Base : public ov::op::Op {
public:
    Sparse24Base() = default;
    Sparse24Base(const ov::OutputVector& x, Constants weights) : Op(x), m_weights(std::move(weights)) {}

    bool has_evaluate() const override { return float_type(get_input_element_type(0)); }

protected:
    Constants m_weights;

    // the input x: f32 or bf16, its shape, rows (all dimensions but the last) and width
    struct Input {
        bool bf16;
        ov::Shape shape;
        int64_t M, K;
    };
    static bool read_input(const ov::TensorVector& inputs, Input& in) {
        if (!float_type(inputs[0].get_element_type())) return false;
        in.bf16 = inputs[0].get_element_type() == ov::element::bf16;
        in.shape = inputs[0].get_shape();
        in.M = rows_of(in.shape);
        in.K = static_cast<int64_t>(in.shape.back());
        return true;
    }

    ov::Dimension check_linear(size_t first, const ov::Dimension& k) {
        NODE_VALIDATION_CHECK(this, get_input_size() == 1 && first + kParts <= m_weights.size(),
                              "holoserve 2:4 Linears take one input and five constants per Linear");
        const auto ws = m_weights[first]->get_shape();
        const int64_t N = static_cast<int64_t>(ws.size() == 4 ? ws[0] * kTile : 0);
        NODE_VALIDATION_CHECK(this, ws.size() == 4 && ws[2] == kTile && ws[3] == 4,
                              "holoserve 2:4 weights must be [N/32, K/8, 32, 4]");
        NODE_VALIDATION_CHECK(this, m_weights[first]->get_element_type() == ov::element::i8 &&
                                        m_weights[first + 1]->get_element_type() == ov::element::u8 &&
                                        m_weights[first + 1]->get_shape() == ws &&
                                        m_weights[first + 2]->get_element_type() == ov::element::i32 &&
                                        m_weights[first + 3]->get_element_type() == ov::element::f32 &&
                                        m_weights[first + 4]->get_element_type() == ov::element::f32,
                              "holoserve 2:4 weights are i8, the index u8 (same shape), comp i32, scale and bias f32");
        for (size_t i = 2; i < kParts; ++i)
            NODE_VALIDATION_CHECK(this, ov::shape_size(m_weights[first + i]->get_shape()) == static_cast<size_t>(N),
                                  "holoserve 2:4 comp, scale and bias hold one value per output column");
        const int64_t K = static_cast<int64_t>(ws[1] * 8);
        NODE_VALIDATION_CHECK(this, k.compatible(K) && K % kWindow == 0,
                              "holoserve 2:4 Linear: the input's last dimension is not the weights' K "
                              "(or not a multiple of 64)");
        return ov::Dimension(N);
    }
    ov::PartialShape with_last(ov::PartialShape shape, const ov::Dimension& n) const {
        if (shape.rank().is_static()) shape[shape.size() - 1] = n;
        return shape;
    }
    ov::Dimension last_of(const ov::PartialShape& shape) const {
        return shape.rank().is_static() ? shape[shape.size() - 1] : ov::Dimension::dynamic();
    }
};

class Sparse24Gemm : public Sparse24Base {
public:
    OPENVINO_OP("Sparse24Gemm", "holoserve");

    Sparse24Gemm() = default;
    Sparse24Gemm(const ov::OutputVector& x, Constants weights, float x_scale)
        : Sparse24Base(x, std::move(weights)), m_x_scale(x_scale) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const size_t n = m_weights.size() + 1;
        NODE_VALIDATION_CHECK(this, n > 1 && (n - 1) % kParts == 0,
                              "Sparse24Gemm takes x and, per Linear, weights, index, comp, scale, bias");
        const auto& xs = get_input_partial_shape(0);
        for (size_t g = 0; g < (n - 1) / kParts; ++g)
            set_output_type(g, get_input_element_type(0), with_last(xs, check_linear(kParts * g, last_of(xs))));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override {
        return std::make_shared<Sparse24Gemm>(new_args, m_weights, m_x_scale);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("x_scale", m_x_scale);
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        Input in;
        if (!read_input(inputs, in)) return false;
        const auto& [bf16, shape, M, K] = in;
        const size_t groups = m_weights.size() / kParts;
        std::vector<Linear> lin;
        std::vector<int64_t> first_tile{0};
        for (size_t g = 0; g < groups; ++g) {
            lin.push_back(linear_at(m_weights, kParts * g));
            if (lin.back().K != K) return false;
            auto out = shape;
            out.back() = static_cast<size_t>(lin.back().N);
            outputs[g].set_shape(out);
            first_tile.push_back(first_tile.back() + lin.back().N / kTile);
        }
        if (M == 0) return true;
        uint8_t* xq = scratch(0, static_cast<size_t>(M * K)).data();
        quantize_rows(inputs[0].data(), bf16, xq, M, K, m_x_scale);
        const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
        ov::parallel_for2d(chunks, first_tile.back(), [&](int64_t c, int64_t tt) {
            const size_t g = std::upper_bound(first_tile.begin(), first_tile.end(), tt) - first_tile.begin() - 1;
            const Linear& L = lin[g];
            const int64_t t = tt - first_tile[g], m0 = c * kRowChunk, rows = std::min(M, m0 + kRowChunk) - m0;
            char* y = static_cast<char*>(outputs[g].data()) + m0 * L.N * outputs[g].get_element_type().size();
            tile_column(xq + m0 * K, rows, L, t, [&](int64_t m) {
                return StoreFloat{&L, y + m * L.N * (bf16 ? 2 : 4), L.N, t * kTile, bf16};
            });
        });
        return true;
    }

private:
    float m_x_scale = 1.0f;
};

class Sparse24Ffn : public Sparse24Base {
public:
    OPENVINO_OP("Sparse24Ffn", "holoserve");

    Sparse24Ffn() = default;
    Sparse24Ffn(const ov::OutputVector& x, Constants weights, float x_scale, float h_scale,
                const std::string& activation)
        : Sparse24Base(x, std::move(weights)), m_x_scale(x_scale), m_h_scale(h_scale), m_activation(activation) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, m_weights.size() == 2 * kParts,
                              "Sparse24Ffn takes x and two Linears' weights, index, comp, scale, bias");
        NODE_VALIDATION_CHECK(this, m_activation == "gelu" || m_activation == "relu",
                              "Sparse24Ffn's activation is gelu (exact) or relu, not ", m_activation);
        const auto& xs = get_input_partial_shape(0);
        const auto hidden = check_linear(0, last_of(xs));
        set_output_type(0, get_input_element_type(0), with_last(xs, check_linear(kParts, hidden)));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override {
        return std::make_shared<Sparse24Ffn>(new_args, m_weights, m_x_scale, m_h_scale, m_activation);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("x_scale", m_x_scale);
        visitor.on_attribute("h_scale", m_h_scale);
        visitor.on_attribute("activation", m_activation);
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        Input in;
        if (!read_input(inputs, in)) return false;
        const auto& [bf16, shape, M, K] = in;
        const Linear up = linear_at(m_weights, 0), down = linear_at(m_weights, kParts);
        if (up.K != K || down.K != up.N) return false;
        auto out = shape;
        out.back() = static_cast<size_t>(down.N);
        outputs[0].set_shape(out);
        if (M == 0) return true;
        uint8_t* xq = scratch(0, static_cast<size_t>(M * K)).data();
        quantize_rows(inputs[0].data(), bf16, xq, M, K, m_x_scale);
        char* y = static_cast<char*>(outputs[0].data());
        const int64_t row_bytes = down.N * (bf16 ? 2 : 4);
        const int act = m_activation == "relu" ? kRelu : kGelu;
        const float inv_h = 1.0f / m_h_scale;
        // a block of rows at a time, so that its hidden codes stay in cache between the two Linears
        const int64_t block = 2 * kRowChunk, H = up.N;
        uint8_t* h = scratch(1, static_cast<size_t>(std::min(M, block) * H)).data();
        for (int64_t b0 = 0; b0 < M; b0 += block) {
            const int64_t rows = std::min(M, b0 + block) - b0, chunks = (rows + kRowChunk - 1) / kRowChunk;
            ov::parallel_for2d(chunks, up.N / kTile, [&](int64_t c, int64_t t) {
                const int64_t m0 = c * kRowChunk, n = std::min(rows, m0 + kRowChunk) - m0;
                tile_column(xq + (b0 + m0) * K, n, up, t, [&](int64_t m) {
                    return StoreCodes{&up, h + (m0 + m) * H, H, t * kTile, inv_h, act};
                });
            });
            ov::parallel_for2d(chunks, down.N / kTile, [&](int64_t c, int64_t t) {
                const int64_t m0 = c * kRowChunk, n = std::min(rows, m0 + kRowChunk) - m0;
                tile_column(h + m0 * H, n, down, t, [&](int64_t m) {
                    return StoreFloat{&down, y + (b0 + m0 + m) * row_bytes, down.N, t * kTile, bf16};
                });
            });
        }
        return true;
    }

private:
    float m_x_scale = 1.0f, m_h_scale = 1.0f;
    std::string m_activation = "gelu";
};

// ---- Attention: softmax(q k^T * scale + mask) v per head, the heads side by side in the last dimension ----
//
// q: [B, Sq, H * D], k and v: [B, S, H * D] (f32 or bf16, one type; Sq is S, or 1 for a [CLS]-row query), mask:
// additive, [B or 1, 1, Sq or 1, S] (f32 or bf16), out: q's type and shape. Scores, softmax and the weighted sum
// run in f32. Per head, K is staged transposed ([D][S], f32, padded to a multiple of 16 keys whose scores are
// masked) and V as [S][D] f32; queries run in blocks of kQueries. The sums of a row and the exponentials take one
// fixed order in both builds, so the reference build equals this one bit for bit.
constexpr int kQueries = 4;       // queries per block: 4 x (keys / 16) score registers, 4 x (D / 16) outputs
constexpr float kExpFloor = -80.0f;  // exp below it is 0 (masked keys); above it the result is a normal float

struct AttentionArgs {
    const void *q, *k, *v, *mask;
    void* out;
    bool bf16, mask_bf16;
    int64_t B, Sq, S, H, D, mask_batch, mask_rows;  // the mask's batch and row counts (1 where broadcast)
    float scale;
    int64_t row(int64_t b, int64_t i) const {  // offset of the mask row of query i in batch b
        return ((mask_batch > 1 ? b : 0) * mask_rows + (mask_rows > 1 ? i : 0)) * S;
    }
};

struct AttentionScratch {
    std::vector<float> kt, v, q, p;  // [D][Sp], [S][D], [kQueries][D], [kQueries][Sp]
    void size(int64_t S, int64_t Sp, int64_t D) {
        kt.resize(static_cast<size_t>(D * Sp));  // padding keys hold whatever was there: their scores are masked
        v.resize(static_cast<size_t>(S * D));
        q.resize(static_cast<size_t>(kQueries * D));
        p.resize(static_cast<size_t>(kQueries * Sp));
    }
};

// this thread's scratch, fetched once per head: thread-local access inside the loops costs a call each time
__attribute__((noinline)) static AttentionScratch& attention_scratch() {
    thread_local AttentionScratch s;
    return s;
}

#ifndef HOLOSERVE_REFERENCE

// exp(x) for the softmax (x <= 0): 2^n p(r), r = x - n ln 2 in two steps (Cephes' constants), p of degree 7
static inline __m512 exp_ps(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

// lanes k + (k + 8), then k + (k + 4), then k + (k + 2), then 0 + 1
static inline float hsum(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

static inline __m512 load_any(const void* p, bool bf16, int64_t i) {
    return bf16 ? load_bf16(static_cast<const uint16_t*>(p) + i) : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}
static inline __m512 load_any_tail(const void* p, bool bf16, int64_t i, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i)), 16));
}

// r[d] <- lane d of every r[l]: a 16 x 16 float transpose in registers
static inline void transpose16(__m512 (&r)[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
// scores of kQueries queries (rows of s.q) against keys [16 j0, 16 (j0 + NV)) into s.p
template <int NV>
static inline void score_block(const AttentionScratch& s, int64_t Sp, int64_t D, float* p, int64_t j0) {
    __m512 acc[kQueries][NV];
    for (int r = 0; r < kQueries; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        __m512 kv[NV];
        for (int c = 0; c < NV; ++c) kv[c] = _mm512_loadu_ps(s.kt.data() + d * Sp + 16 * (j0 + c));
        for (int r = 0; r < kQueries; ++r) {
            const __m512 qv = _mm512_set1_ps(s.q[r * D + d]);
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(qv, kv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < kQueries; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(p + r * Sp + 16 * (j0 + c), acc[r][c]);
}

// out rows of kQueries queries: sum_j p[r][j] v[j] for D = 16 ND
template <int ND>
static inline void weighted_sum(const AttentionScratch& s, int64_t S, int64_t Sp, __m512 (&acc)[kQueries][ND]) {
    for (int r = 0; r < kQueries; ++r)
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; ++j) {
        __m512 vv[ND];
        for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(s.v.data() + j * 16 * ND + 16 * c);
        for (int r = 0; r < kQueries; ++r) {
            const __m512 pv = _mm512_set1_ps(s.p[r * Sp + j]);
            for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
        }
    }
}

template <int ND>
static void attention_head_d(const AttentionArgs& a, AttentionScratch& s, int64_t b, int64_t h) {
    const int64_t S = a.S, Sq = a.Sq, D = 16 * ND, HD = a.H * D, Sp = (S + 15) / 16 * 16, nv = Sp / 16;
    const int64_t base = b * S * HD + h * D, qbase = b * Sq * HD + h * D;
    float* kt = s.kt.data();
    int64_t j = 0;
    for (; j + 16 <= S; j += 16)  // K transposed 16 keys x 16 dimensions at a time
        for (int c = 0; c < ND; ++c) {
            __m512 r[16];
            for (int l = 0; l < 16; ++l) r[l] = load_any(a.k, a.bf16, base + (j + l) * HD + 16 * c);
            transpose16(r);
            for (int l = 0; l < 16; ++l) _mm512_storeu_ps(kt + (16 * c + l) * Sp + j, r[l]);
        }
    for (; j < S; ++j)
        for (int c = 0; c < ND; ++c) {
            alignas(64) float tmp[16];
            _mm512_store_ps(tmp, load_any(a.k, a.bf16, base + j * HD + 16 * c));
            for (int l = 0; l < 16; ++l) kt[(16 * c + l) * Sp + j] = tmp[l];
        }
    for (j = 0; j < S; ++j)
        for (int c = 0; c < ND; ++c)
            _mm512_storeu_ps(s.v.data() + j * D + 16 * c, load_any(a.v, a.bf16, base + j * HD + 16 * c));
    const __mmask16 tail = S % 16 ? static_cast<__mmask16>((1u << (S % 16)) - 1) : static_cast<__mmask16>(0xFFFF);
    for (int64_t i0 = 0; i0 < Sq; i0 += kQueries) {
        for (int r = 0; r < kQueries; ++r) {  // rows past Sq repeat the last query; their outputs are dropped
            const int64_t i = std::min(i0 + r, Sq - 1);
            for (int c = 0; c < ND; ++c)
                _mm512_storeu_ps(s.q.data() + r * D + 16 * c, load_any(a.q, a.bf16, qbase + i * HD + 16 * c));
        }
        int64_t j0 = 0;
        for (; j0 + 4 <= nv; j0 += 4) score_block<4>(s, Sp, D, s.p.data(), j0);
        switch (nv - j0) {
            case 3: score_block<3>(s, Sp, D, s.p.data(), j0); break;
            case 2: score_block<2>(s, Sp, D, s.p.data(), j0); break;
            case 1: score_block<1>(s, Sp, D, s.p.data(), j0); break;
            default: break;
        }
        float inv[kQueries];  // 1 / each row's sum of exponentials, applied to the weighted sums
        for (int r = 0; r < kQueries; ++r) {
            float* p = s.p.data() + r * Sp;
            const int64_t mrow = a.row(b, std::min(i0 + r, Sq - 1));
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < nv; ++c) {
                const __mmask16 m = c + 1 == nv ? tail : static_cast<__mmask16>(0xFFFF);
                const __m512 mk = load_any_tail(a.mask, a.mask_bf16, mrow + 16 * c, m);
                const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m,
                    _mm512_fmadd_ps(_mm512_loadu_ps(p + 16 * c), _mm512_set1_ps(a.scale), mk));
                _mm512_storeu_ps(p + 16 * c, sc);
                mx = _mm512_max_ps(mx, sc);
            }
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = 0; c < nv; ++c) {
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p + 16 * c), top));
                _mm512_storeu_ps(p + 16 * c, e);
                sum = _mm512_add_ps(sum, e);
            }
            inv[r] = 1.0f / hsum(sum);
        }
        __m512 acc[kQueries][ND];
        weighted_sum<ND>(s, S, Sp, acc);
        for (int r = 0; r < kQueries && i0 + r < Sq; ++r)
            for (int c = 0; c < ND; ++c) {
                const int64_t o = qbase + (i0 + r) * HD + 16 * c;
                const __m512 y = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r]));
                if (a.bf16)
                    store_bf16(static_cast<uint16_t*>(a.out) + o, y);
                else
                    _mm512_storeu_ps(static_cast<float*>(a.out) + o, y);
            }
    }
}

static void attention_head(const AttentionArgs& a, AttentionScratch& s, int64_t b, int64_t h) {
    switch (a.D / 16) {
        case 1: attention_head_d<1>(a, s, b, h); break;
        case 2: attention_head_d<2>(a, s, b, h); break;
        case 3: attention_head_d<3>(a, s, b, h); break;
        default: attention_head_d<4>(a, s, b, h); break;
    }
}

#else  // HOLOSERVE_REFERENCE: the steps above lane by lane

static inline float scalar_at(const void* p, bool bf16, int64_t i) {
    if (!bf16) return static_cast<const float*>(p)[i];
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline float exp_scalar(float x) {
    const bool keep = x >= kExpFloor;
    x = x > kExpFloor ? x : kExpFloor;  // VMAXPS(x, floor)
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = std::fma(-n, 0.693359375f, x);
    r = std::fma(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p, r * r, r) + 1.0f;
    return keep ? std::ldexp(p, static_cast<int>(n)) : 0.0f;
}

static inline float hsum(const float* v) {
    float a[8], b[4];
    for (int k = 0; k < 8; ++k) a[k] = v[k] + v[k + 8];
    for (int k = 0; k < 4; ++k) b[k] = a[k] + a[k + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static void attention_head(const AttentionArgs& a, AttentionScratch& s, int64_t b, int64_t h) {
    const int64_t S = a.S, Sq = a.Sq, D = a.D, HD = a.H * D, Sp = (S + 15) / 16 * 16;
    const int64_t base = b * S * HD + h * D, qbase = b * Sq * HD + h * D;
    for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < D; ++d) {
            s.kt[d * Sp + j] = scalar_at(a.k, a.bf16, base + j * HD + d);
            s.v[j * D + d] = scalar_at(a.v, a.bf16, base + j * HD + d);
        }
    for (int64_t i = 0; i < Sq; ++i) {
        for (int64_t d = 0; d < D; ++d) s.q[d] = scalar_at(a.q, a.bf16, qbase + i * HD + d);
        float* p = s.p.data();
        const int64_t mrow = a.row(b, i);
        float top = -INFINITY;
        for (int64_t j = 0; j < Sp; ++j) {
            float acc = 0.0f;
            for (int64_t d = 0; d < D; ++d) acc = std::fma(s.q[d], s.kt[d * Sp + j], acc);
            p[j] = j < S ? std::fma(acc, a.scale, scalar_at(a.mask, a.mask_bf16, mrow + j)) : -INFINITY;
            top = std::max(top, p[j]);
        }
        float sum[16] = {};
        for (int64_t j = 0; j < Sp; ++j) {
            p[j] = exp_scalar(p[j] - top);
            sum[j % 16] += p[j];
        }
        const float inv = 1.0f / hsum(sum);
        for (int64_t d = 0; d < D; ++d) {
            float acc = 0.0f;
            for (int64_t j = 0; j < S; ++j) acc = std::fma(p[j], s.v[j * D + d], acc);
            acc *= inv;
            const int64_t o = qbase + i * HD + d;
            if (a.bf16)
                store_bf16(static_cast<uint16_t*>(a.out) + o, acc);
            else
                static_cast<float*>(a.out)[o] = acc;
        }
    }
}

#endif  // HOLOSERVE_REFERENCE

static void attention(const AttentionArgs& a) {
    ov::parallel_for(a.B * a.H, [&](int64_t bh) {
        AttentionScratch& s = attention_scratch();
        s.size(a.S, (a.S + 15) / 16 * 16, a.D);
        attention_head(a, s, bh / a.H, bh % a.H);
    });
}

class Attention : public ov::op::Op {
public:
    OPENVINO_OP("Attention", "holoserve");

    Attention() = default;
    Attention(const ov::OutputVector& args, int64_t head_size, float scale)
        : Op(args), m_head_size(head_size), m_scale(scale) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 4, "holoserve Attention takes q, k, v and an additive mask");
        NODE_VALIDATION_CHECK(this, m_head_size > 0 && m_head_size % 16 == 0 && m_head_size <= 64,
                              "holoserve Attention's head_size is a multiple of 16 up to 64, not ", m_head_size);
        const auto& qs = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, qs.rank().compatible(3) && get_input_partial_shape(3).rank().compatible(4),
                              "holoserve Attention: q, k, v are [batch, sequence, heads * head_size], the mask 4-D");
        set_output_type(0, get_input_element_type(0), qs);
    }

    bool has_evaluate() const override {
        return float_type(get_input_element_type(0)) && float_type(get_input_element_type(3));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override {
        return std::make_shared<Attention>(new_args, m_head_size, m_scale);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("head_size", m_head_size);
        visitor.on_attribute("scale", m_scale);
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto type = inputs[0].get_element_type();
        const auto qs = inputs[0].get_shape(), ms = inputs[3].get_shape();
        if (!float_type(type) || !float_type(inputs[3].get_element_type()) || qs.size() != 3 || ms.size() != 4)
            return false;
        const auto ks = inputs[1].get_shape();
        for (int i = 1; i < 3; ++i)
            if (inputs[i].get_element_type() != type || inputs[i].get_shape() != ks) return false;
        AttentionArgs a;
        a.B = static_cast<int64_t>(qs[0]);
        a.Sq = static_cast<int64_t>(qs[1]);
        a.S = static_cast<int64_t>(ks[1]);
        a.D = m_head_size;
        a.H = static_cast<int64_t>(qs[2]) / a.D;
        a.mask_batch = static_cast<int64_t>(ms[0]);
        a.mask_rows = static_cast<int64_t>(ms[2]);
        if (a.H * a.D != static_cast<int64_t>(qs[2]) || ks.size() != 3 || ks[0] != qs[0] || ks[2] != qs[2] ||
            ms[1] != 1 || static_cast<int64_t>(ms[3]) != a.S || (a.mask_batch != 1 && a.mask_batch != a.B) ||
            (a.mask_rows != 1 && a.mask_rows != a.Sq))
            return false;
        outputs[0].set_shape(qs);
        if (a.B == 0 || a.Sq == 0) return true;
        if (a.S == 0) return false;  // softmax over no keys
        a.q = inputs[0].data();
        a.k = inputs[1].data();
        a.v = inputs[2].data();
        a.mask = inputs[3].data();
        a.out = outputs[0].data();
        a.bf16 = type == ov::element::bf16;
        a.mask_bf16 = inputs[3].get_element_type() == ov::element::bf16;
        a.scale = m_scale;
        attention(a);
        return true;
    }

private:
    int64_t m_head_size = 64;
    float m_scale = 1.0f;
};

}  // namespace holoserve

namespace holoserve {

// The ONNX node's inputs are x and the Linears' initializers: the op keeps the initializers' constants
// and takes x alone.
template <class Op>
static ov::OutputVector convert(const ov::frontend::NodeContext& ctx) {
    Constants weights;
    for (size_t i = 1; i < ctx.get_input_size(); ++i) {
        auto c = ov::as_type_ptr<ov::op::v0::Constant>(ctx.get_input(static_cast<int>(i)).get_node_shared_ptr());
        if (!c) OPENVINO_THROW("holoserve ", Op::get_type_info_static().name, ": input ", i, " must be a constant");
        weights.push_back(c);
    }
    const ov::OutputVector x{ctx.get_input(0)};
    const float x_scale = ctx.get_attribute<float>("x_scale");
    if constexpr (std::is_same_v<Op, Sparse24Ffn>)
        return std::make_shared<Op>(x, weights, x_scale, ctx.get_attribute<float>("h_scale"),
                                    ctx.get_attribute<std::string>("activation"))->outputs();
    else
        return std::make_shared<Op>(x, weights, x_scale)->outputs();
}

// q, k, v and the mask are graph values
static ov::OutputVector convert_attention(const ov::frontend::NodeContext& ctx) {
    const ov::OutputVector args{ctx.get_input(0), ctx.get_input(1), ctx.get_input(2), ctx.get_input(3)};
    return std::make_shared<Attention>(args, ctx.get_attribute<int64_t>("head_size"),
                                       ctx.get_attribute<float>("scale"))->outputs();
}

}  // namespace holoserve

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>(
    {std::make_shared<ov::frontend::onnx::ConversionExtension>("Sparse24Gemm", "holoserve",
                                                               holoserve::convert<holoserve::Sparse24Gemm>),
     std::make_shared<ov::frontend::onnx::ConversionExtension>("Sparse24Ffn", "holoserve",
                                                               holoserve::convert<holoserve::Sparse24Ffn>),
     std::make_shared<ov::frontend::onnx::ConversionExtension>("Attention", "holoserve",
                                                               holoserve::convert_attention)}));
