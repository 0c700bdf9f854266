// The CPU's own kernels, as C++ ops that cpu_kernels.py builds at first use and loads:
//   ssd::int4_mm, ssd::int8_mm   y = x W^T with W stored in 4 or 8 bits (quantize.py calls them)
//   ssd::paged_attention_cpu     attention of new tokens over the paged KV cache (kv_cache.py)
//   ssd::int4_layer              a whole int4 decoder layer in one call (model.py's eager step)
// Each computes every row of its output (a token) on its own, by the same instructions in the
// same order whatever the rows beside it and the threads that run it, so a row's result is the
// same bit for bit in a decode step, a verification and a prefill.
//
// The quantized products, for a few rows of x (a decode step, a verification) or many (a prefill).
//
// Why kernels of our own: a decode step reads every weight once, so a product should run at the
// speed memory delivers the weights. torch's int4 CPU kernel converts each 4-bit weight to a float
// and multiplies it by a bfloat16 activation, and on a 2-core Xeon it stays below that speed.
// Here each row of x is turned into 16-bit integers per block of 32 inputs, and the weights
// multiply them as integers: one AVX2 instruction (madd) multiplies 16 pairs of 16-bit integers
// and adds them in pairs into 8 int32 sums, with no conversion of the weights to float.
// (llama.cpp turns x into 8-bit integers, which is faster still but, measured on SmolLM2-135M's
// file, moved 5.6% of its greedy tokens; 16 bits keep x within 1/65534 of each block's largest.)
//
// The math, for one row x and one output n, with blocks b of 32 inputs:
//   the weight  w[n, k] = q[n, k] * s[n, g] + m[n, g]      g: k's group (a block, for int4)
//   the input   x[k] ~= p[k] * d[b]                        p in -32767..32767,
//                                                          d = max |x_k in b| / 32767
//   y[n] = sum_b s[n, g] * d[b] * sum_{k in b} q[n, k] p[k]  +  sum_g m[n, g] * sum_{k in g} x[k]
// The integer sums are exact (int4: at most 32 * 15 * 32767, int8: 32 * 128 * 32767, < 2^31); the
// min's term uses x itself.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per block (GGUF's)
constexpr int64_t TILE = 8;    // outputs per int4 tile
constexpr int MT = 4;          // rows of x multiplied together (each weight unpacked once for them)
#ifdef __AVX512BW__
constexpr int MT_WIDE = 8;     // the same where AVX-512's 32 registers hold their sums (5 rows
                               // as 4 + 1 paid the second piece's unpacking and 1-row form: the
                               // int4 layers' 5-row product 0.85x the time in one piece, 8 0.88x)
#else
constexpr int MT_WIDE = MT;
#endif
constexpr int64_t PREFETCH = 4096;  // bytes of weights read ahead

// The sum of v's 8 lanes, added as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), as sum4 adds.
float sum8(__m256 v) {
  const __m256 pairs = _mm256_hadd_ps(v, v), h = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// The largest of v's 8 lanes.
float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// One row of x as 16-bit integers: p [K], and per block d (its scale) and sum (of x itself).
// A block's 32 inputs are 4 registers: |x|'s largest, the sum (the 4 added lane by lane, then
// across the lanes) and p, rounded to the nearest integer (ties to even) as the CPU converts.
// (Element by element this took 3% of a SmolLM2-135M decode step, in 150 calls.)
void quantize_row(const float* x, int64_t K, int16_t* p, float* d, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / BLOCK; g++) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + g * BLOCK + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float a = max8(amax);
    d[g] = a / 32767;
    sum[g] = sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256 inv = _mm256_set1_ps(a > 0 ? 32767 / a : 0);
    for (int i = 0; i < 4; i += 2) {  // 16 inputs: two registers of 8 int32, packed to 16 bits
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv));
      // packs interleaves the two registers' 128-bit halves: lo0 hi0 lo1 hi1 -> lo0 lo1 hi0 hi1
      const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256((__m256i*)(p + g * BLOCK + 8 * i), p16);
    }
  }
}

// x [M, K] as quantize_row makes each row: p [M, K], d and sum [M, K / 32].
struct Rows16 {
  std::vector<int16_t> p;
  std::vector<float> d, sum;
  explicit Rows16(const at::Tensor& x)
      : p(x.numel()), d(x.numel() / BLOCK), sum(x.numel() / BLOCK) {
    const int64_t K = x.size(1), G = K / BLOCK;
    const float* xp = x.data_ptr<float>();
    for (int64_t r = 0; r < x.size(0); r++)
      quantize_row(xp + r * K, K, &p[r * K], &d[r * G], &sum[r * G]);
  }
};

// [0, n) in pieces of at most Max (rows of x, query heads), each through the code built for its
// size: run(C, i) for [i, i + C), C a compile-time constant (std::integral_constant), so that the
// piece's sums can live in registers.
template <int Max, typename Run>
void in_pieces(int64_t n, Run run) {
  for (int64_t i = 0; i < n; i += Max) {
    const int64_t size = std::min<int64_t>(Max, n - i);
    [&]<int... C>(std::integer_sequence<int, C...>) {  // the one C + 1 == size
      ((size == C + 1 ? run(std::integral_constant<int, C + 1>{}, i) : void()), ...);
    }(std::make_integer_sequence<int, Max>{});
  }
}

// The lane sums of 4 registers at once (two horizontal adds, then the halves), each added in
// sum8's order, so that an output's sum has the same bits whichever of the two adds it.
__m128 sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The lane sums of 8 registers at once, each again in sum8's order.
__m256 sum8x8(const __m256* a) {
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// ---------------------------------------------------------------------------------------------
// int4, q in 0..15 with a float16 scale and min per block. The layout
// (cpu_kernels.int4_to_cpu_kernel writes it): the outputs in tiles of 8 (one AVX2 register of 8
// int32 sums), and per tile, block and unit u of 8 inputs (4 units a block) 32 bytes, read as 16
// 16-bit words:
//   word 2 r + e (output r of the tile, e = 0, 1) holds, in its nibble j (bits 4 j .. 4 j + 3),
//   input 8 u + 2 j + e of output r.
// So one 32-byte load gives, after shifts and masks, 4 registers (j = 0..3) whose int32 lane r
// is the pair of inputs 8 u + 2 j, 8 u + 2 j + 1 of output r, and madd multiplies each by the
// matching pair of p, broadcast to every lane.
//   packed  uint8   [N / 8, K / 32, 4, 32]
//   sm      float16 [N / 8, K / 32, 2, 8]   (s, then m, of the tile's 8 outputs for block b)

// acc + a . b in each int32 lane: the lane's two 16-bit products, added (exact in int32 here).
// AVX-VNNI does it in one instruction, AVX2 in two (multiply-add, then add); the integer sum, so
// every bit of the output, is the same either way (cpu_kernels.py builds with AVX-VNNI where the
// CPU has it: a 3-row product of SmolLM2-135M's int4 layers in about 0.75x the time, of its
// int8 head 0.96x). A CPU with AVX-512's VNNI and no AVX-VNNI (AMD's Zen 4, Intel's Ice Lake)
// has the same instruction for 256 bits through AVX-512 VL: on a 2-core EPYC, where one row's
// int4 product is bound by its instructions, not by memory, it took the 1-row product of
// SmolLM2-135M's layers in 0.87-0.94x the time (0.79x with the weights in cache).
inline __m256i dot_pairs(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// acc + one block of a row of x for the tile's 8 outputs: the integer sums i times s d (the
// weights' and the row's scales), plus m times the row's sum of x over the block.
inline __m256 add_block(__m256 acc, __m256i i, __m256 s, __m256 m, float d, float xsum) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
  return _mm256_fmadd_ps(m, _mm256_set1_ps(xsum), acc);
}

// Rows [0, R) of x (R <= MT) times the outputs of tiles [t0, t1): y[r, 8 t + i].
template <int R>
void tiles(const int16_t* p, const float* d, const float* sum, int64_t K, const uint8_t* packed,
           const uint16_t* sm, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / BLOCK;
  const __m256i low4 = _mm256_set1_epi16(0x000F);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* wt = packed + t * G * 4 * 32;
    const uint16_t* smt = sm + t * G * 2 * TILE;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      // the block's integer sums, C a row (exact: their order changes no bit). One row takes 4,
      // so that 4 chains of multiply-adds run at once; more rows take 2 each (their rows' chains
      // run beside them, and 4 each would not fit the registers)
      constexpr int C = R == 1 ? 4 : 2;
      __m256i isum[C][R];
      for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) isum[c][r] = _mm256_setzero_si256();
      // Ask for the weights 4 KB ahead: the hardware's prefetcher stops at each 4 KB page, and
      // one core then waits on memory (measured: SmolLM2-135M's 120 int4 layers, one thread,
      // cold in cache, in 0.5x the time of the same loop without these two lines).
      _mm_prefetch((const char*)(wt + g * 128 + PREFETCH), _MM_HINT_T0);
      _mm_prefetch((const char*)(wt + g * 128 + PREFETCH + 64), _MM_HINT_T0);
      for (int u = 0; u < 4; u++) {
        __m256i w = _mm256_loadu_si256((const __m256i*)(wt + (g * 4 + u) * 32));
        __m256i q0 = _mm256_and_si256(w, low4);  // q of inputs 8u + 0, 1 for each output
        __m256i q1, q2;                          // 8u + 2, 3 and 8u + 4, 5
        // One row: 16 q1 and 256 q2, masked where they lie, without a shift (this product is
        // bound by its instructions). Their block sums, 16 and 256 times q's, stay exact in
        // int32 (8 products a lane: 256 * 15 * 32767 * 8 < 2^31) and are divided back below.
        if constexpr (C == 4) {
          q1 = _mm256_and_si256(w, _mm256_slli_epi16(low4, 4));
          q2 = _mm256_and_si256(w, _mm256_slli_epi16(low4, 8));
        } else {
          q1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
          q2 = _mm256_and_si256(_mm256_srli_epi16(w, 8), low4);
        }
        __m256i q3 = _mm256_srli_epi16(w, 12);  // 8u + 6, 7
        for (int r = 0; r < R; r++) {
          int32_t p01, p23, p45, p67;  // pairs of p, as one int32 each
          const int16_t* pu = p + r * K + g * BLOCK + u * 8;
          std::memcpy(&p01, pu, 4);
          std::memcpy(&p23, pu + 2, 4);
          std::memcpy(&p45, pu + 4, 4);
          std::memcpy(&p67, pu + 6, 4);
          isum[0][r] = dot_pairs(isum[0][r], q0, _mm256_set1_epi32(p01));
          isum[1][r] = dot_pairs(isum[1][r], q1, _mm256_set1_epi32(p23));
          isum[2 % C][r] = dot_pairs(isum[2 % C][r], q2, _mm256_set1_epi32(p45));
          isum[3 % C][r] = dot_pairs(isum[3 % C][r], q3, _mm256_set1_epi32(p67));
        }
      }
      __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smt + g * 2 * TILE)));
      __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smt + g * 2 * TILE + TILE)));
      for (int r = 0; r < R; r++) {
        __m256i i;
        if constexpr (C == 4)  // the masked sums are 16 and 256 times theirs, exactly
          i = _mm256_add_epi32(_mm256_add_epi32(isum[0][r], _mm256_srai_epi32(isum[1][r], 4)),
                               _mm256_add_epi32(_mm256_srai_epi32(isum[2][r], 8), isum[3][r]));
        else
          i = _mm256_add_epi32(isum[0][r], isum[1][r]);
        acc[r] = add_block(acc[r], i, s, m, d[r * G + g], sum[r * G + g]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N + t * TILE, acc[r]);
  }
}

#ifdef __AVX512BW__
// More than one row of x (a verification) with AVX-512, which cpu_kernels.py builds where the CPU
// has it. Past one row the product is bound by arithmetic, not by the weights' bytes, so here one
// 64-byte load takes two units (u, u + 1) of the tile, and a permutation of its 32-bit lanes puts
// them side by side: lane 2 i holds unit u's pair of output i, lane 2 i + 1 unit u + 1's. Each
// row's two pairs of p for those (pairs2 lays them side by side) are one 64-bit broadcast, so one
// multiply-add does the work of two of `tiles`, and the unpacking is halved too. At the end of a
// block each output's two lanes are added: the same int32 sums, so the same bits, as `tiles`
// (tests/test_quantize.py compares the builds). One row stays on `tiles`: it waits on memory, and
// its decode step was no faster with 512-bit registers.
inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {  // dot_pairs, 512 bits
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// a and b as the low and high halves of one register, and the high half back (AVX-512 F alone)
__m512 halves(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)),
                                             _mm256_castps_pd(b), 1));
}
__m256 high(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// Rows of p as pairs (int32) in tiles512's order: per block, units (2 v, 2 v + 1), pair j, unit.
std::vector<int32_t> pairs2(const int16_t* p, int64_t M, int64_t K) {
  std::vector<int32_t> out(M * K / 2);
  int32_t* o = out.data();
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < K / BLOCK; g++)
      for (int v = 0; v < 2; v++)
        for (int j = 0; j < 4; j++)
          for (int h = 0; h < 2; h++)
            std::memcpy(o++, p + r * K + g * BLOCK + (2 * v + h) * 8 + 2 * j, 4);
  return out;
}

template <int R>  // R > 1
void tiles512(const int32_t* p2, const float* d, const float* sum, int64_t K,
              const uint8_t* packed, const uint16_t* sm, float* y, int64_t N, int64_t t0,
              int64_t t1) {
  const int64_t G = K / BLOCK;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i mix = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* wt = packed + t * G * 4 * 32;
    const uint16_t* smt = sm + t * G * 2 * TILE;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      __m512i isum[2][R];  // two sums a row, as `tiles` keeps for more than one row
      for (int r = 0; r < R; r++) isum[0][r] = isum[1][r] = _mm512_setzero_si512();
      _mm_prefetch((const char*)(wt + g * 128 + PREFETCH), _MM_HINT_T0);
      _mm_prefetch((const char*)(wt + g * 128 + PREFETCH + 64), _MM_HINT_T0);
      for (int v = 0; v < 2; v++) {
        __m512i w = _mm512_permutexvar_epi32(mix, _mm512_loadu_si512(wt + (g * 4 + 2 * v) * 32));
        __m512i q0 = _mm512_and_si512(w, low4);
        __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(w, 8), low4);
        __m512i q3 = _mm512_srli_epi16(w, 12);
        for (int r = 0; r < R; r++) {
          int64_t pj[4];  // pair j of units 2 v and 2 v + 1, as one int64 each
          std::memcpy(pj, p2 + r * K / 2 + (g * 2 + v) * 8, 32);
          isum[0][r] = dot_pairs(isum[0][r], q0, _mm512_set1_epi64(pj[0]));
          isum[1][r] = dot_pairs(isum[1][r], q1, _mm512_set1_epi64(pj[1]));
          isum[0][r] = dot_pairs(isum[0][r], q2, _mm512_set1_epi64(pj[2]));
          isum[1][r] = dot_pairs(isum[1][r], q3, _mm512_set1_epi64(pj[3]));
        }
      }
      __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smt + g * 2 * TILE)));
      __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smt + g * 2 * TILE + TILE)));
      for (int r = 0; r < R; r++) {
        __m512i i2 = _mm512_add_epi32(isum[0][r], isum[1][r]);
        // lane 2 i + lane 2 i + 1 into the low half of each 64 bits, then those halves: output i
        __m256i i = _mm512_cvtepi64_epi32(_mm512_add_epi32(i2, _mm512_srli_epi64(i2, 32)));
        acc[r] = add_block(acc[r], i, s, m, d[r * G + g], sum[r * G + g]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N + t * TILE, acc[r]);
  }
}
#endif

#if defined(__AMX_INT8__) && defined(__AVX512BW__)
// Several rows of x with AMX, Intel's tile unit (Sapphire Rapids and later), which cpu_kernels.py
// builds where /proc/cpuinfo lists amx_int8. One instruction (TDPBSUD) multiplies a tile A of up
// to 16 rows of 32 signed bytes by a tile B of 16 columns of 32 unsigned bytes and adds the
// products into 16 x 16 int32 sums: up to 7 rows of x cost one multiply a block, where the forms
// above multiply once per row (a prefill's many rows gain; a verification's few did not). A
// tile's bytes are 8 bits, so a row's p = 256 hi + lo becomes two rows of A: lo - 128 and hi,
// both signed; a last row of ones gives each output's sum of q, and
//   sum q p = sum q (lo - 128) + 128 sum q + 256 sum q hi
// is the block's integer sum, exact, the same int32 as `tiles`'; the float epilogue is add_block's
// lane by lane, so every bit is theirs. 2 R + 1 rows fit a tile for R <= 7 rows of x.
//   B, per block and pair of tiles (t, t + 1: 16 outputs): 8 rows of 64 bytes, row 2 u + h holds
//     for each output 4 of its q as bytes, made from the packed layout by a mask (h = 0: each
//     byte's low nibble) or a shift and a mask (h = 1: its high nibble), so output r's 4 bytes in
//     row 2 u + h are its inputs 8 u + AMX_ORDER[4 h + i], which A's rows take in that order.
// Making B is half of the work (AMX has no 4-bit bytes), and what bounds the form: a 4-row product
// of SmolLM2-135M's int4 layers took 13.8 ms on one thread of a 2-core Xeon guest when B was made
// just before each multiply and the sums read just after it (each waits for the other), 9.2 ms
// in VNNI; so here a block's multiplies run on one set of tiles while the next block's B is made
// and the last multiply's sums are read (two sets, tiles 0-2 and 3-5).
// Linux lends the tile registers to a process that asks (arch_prctl, once); where it does not,
// the forms above run.
constexpr int AMX_ORDER[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int AMX_ROWS = 7;  // rows of x a tile takes (2 R + 1 <= 16)
// Fewer rows take the forms above. Measured on a 2-core Xeon guest (SmolLM2-135M's 120 int4
// layers alone, from memory, one thread): 4 rows as fast either way, 5 rows in 8.4 ms against
// 10-14, 8 rows 12-15 against 18.5-19.5, 16 rows 21-28 against 36-38, 64 rows 77-100 against
// 111-119. In a whole forward the gain shrinks or goes: 3 rows slower (13-14 ms against 12-12.5),
// 5 the same, 6 and 8 rows 0-10% faster at best, SSD (whose speculator drafts ~8 rows) the same
// within the guest's drift, while a 64- and a 512-token prefill took 0.7-0.8x and 0.8-0.9x the
// time (docs/benchmarks.md, "AMX tiles"). So prefills and large batches: 16 rows and more.
constexpr int AMX_MIN = 16;

bool amx_granted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// M rows of p as A, in pieces of R rows (R <= AMX_ROWS; the last piece padded with zeros): per
// piece [2 R + 1, K] bytes, lo - 128 of each row, then hi of each, then ones; each block's inputs
// in B's order.
std::vector<int8_t> amx_pieces(const int16_t* p, int64_t M, int R, int64_t K) {
  const int64_t P = (M + R - 1) / R, piece = (2 * R + 1) * K;
  std::vector<int8_t> a(P * piece, 0);
  for (int64_t i = 0; i < P; i++) std::fill_n(a.begin() + i * piece + 2 * R * K, K, 1);
  for (int64_t m = 0; m < M; m++) {
    int8_t* lo = a.data() + m / R * piece + m % R * K;
    for (int64_t k = 0; k < K; k += 8)  // a unit of 8 inputs at a time
      for (int j = 0; j < 8; j++) {
        const int16_t v = p[m * K + k + AMX_ORDER[j]];
        lo[k + j] = static_cast<int8_t>((v & 0xFF) - 128);
        lo[R * K + k + j] = static_cast<int8_t>(v >> 8);
      }
  }
  return a;
}

struct TileConfig {  // what LDTILECFG reads (palette 1): each tile's rows and bytes a row
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// B for tiles a and b and one block: [a's unit u | b's] -> rows 2 u and 2 u + 1 of B
inline void amx_weights(const uint8_t* wa, const uint8_t* wb, uint8_t* b) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < 4; u++) {
    const __m512i w = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(wa + u * 32))),
        _mm256_loadu_si256((const __m256i*)(wb + u * 32)), 1);
    _mm512_store_si512(b + 2 * u * 64, _mm512_and_si512(w, low4));
    _mm512_store_si512(b + (2 * u + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low4));
  }
}

// One block's multiply on tile set S (A in tile 3 S, B in 3 S + 1, the sums in 3 S + 2), the
// sums stored to c. Tile numbers are part of the instruction, hence two copies.
template <int S>
inline void amx_multiply(const int8_t* a, int64_t K, const uint8_t* b, int32_t* c) {
  if constexpr (S == 0) {
    _tile_loadd(0, a, K);
    _tile_loadd(1, b, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 64);
  } else {
    _tile_loadd(3, a, K);
    _tile_loadd(4, b, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(5, c, 64);
  }
}

// add_block for 16 outputs (a pair of tiles) and the first n rows of a piece of R, from one
// block's stored sums c
inline void amx_add_block(__m512* acc, int R, int n, const int32_t* c, const uint16_t* sma,
                          const uint16_t* smb, const float* d, const float* sum, int64_t G) {
  const __m512 s = halves(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sma)),
                          _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)smb)));
  const __m512 m = halves(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sma + 8))),
                          _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smb + 8))));
  const __m512i q128 = _mm512_slli_epi32(_mm512_load_si512(c + 16 * 2 * R), 7);
  for (int r = 0; r < n; r++) {
    const __m512i hi256 = _mm512_slli_epi32(_mm512_load_si512(c + 16 * (R + r)), 8);
    const __m512i i = _mm512_add_epi32(_mm512_add_epi32(_mm512_load_si512(c + 16 * r), q128),
                                       hi256);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, _mm512_set1_ps(d[r * G])),
                             acc[r]);
    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r * G]), acc[r]);
  }
}

// The M rows of x (in pieces of R, as amx_pieces lays them out in a) times the outputs of tiles
// [t0, t1), two at a time (past t1, tile t0's weights, whose sums are not stored): y[m, 8 t + i].
// A block's B, made once, serves every piece; the multiplies alternate between two sets of tiles.
void tiles_amx(const int8_t* a, int64_t M, int R, const float* d, const float* sum, int64_t K,
               const uint8_t* packed, const uint16_t* sm, float* y, int64_t N, int64_t t0,
               int64_t t1) {
  const int64_t G = K / BLOCK, P = (M + R - 1) / R, piece = (2 * R + 1) * K;
  TileConfig cfg;
  for (int S : {0, 3}) {
    cfg.rows[S] = cfg.rows[S + 2] = 2 * R + 1, cfg.colsb[S] = 32, cfg.colsb[S + 2] = 64;
    cfg.rows[S + 1] = 8, cfg.colsb[S + 1] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t b[2][8 * 64];
  alignas(64) int32_t c[2][16 * 16];
  std::vector<__m512> acc(M);
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t tb = t + 1 < t1 ? t + 1 : t0;
    const uint8_t *wa = packed + t * G * 128, *wb = packed + tb * G * 128;
    const uint16_t *sa = sm + t * G * 2 * TILE, *sb = sm + tb * G * 2 * TILE;
    std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
    // the sums of multiply i are read after multiply i + 1 is issued: (piece, block) of the last
    int64_t i = 0, lp = -1, lg = -1;
    auto add_last = [&] {
      const int64_t m = lp * R;
      amx_add_block(&acc[m], R, std::min<int64_t>(R, M - m), c[(i - 1) % 2], sa + lg * 16,
                    sb + lg * 16, d + m * G + lg, sum + m * G + lg, G);
    };
    amx_weights(wa, wb, b[0]);
    for (int64_t g = 0; g < G; g++) {
      for (int l = 0; l < 128; l += 64) {  // a block of a tile is two cache lines
        _mm_prefetch((const char*)(wa + g * 128 + PREFETCH + l), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + g * 128 + PREFETCH + l), _MM_HINT_T0);
      }
      if (g + 1 < G) amx_weights(wa + (g + 1) * 128, wb + (g + 1) * 128, b[(g + 1) % 2]);
      for (int64_t p = 0; p < P; p++, i++) {
        if (i % 2) amx_multiply<1>(a + p * piece + g * BLOCK, K, b[g % 2], c[1]);
        else amx_multiply<0>(a + p * piece + g * BLOCK, K, b[g % 2], c[0]);
        if (lp >= 0) add_last();  // multiply i - 1's, whose sums are in the other set
        lp = p, lg = g;
      }
    }
    add_last();
    for (int64_t m = 0; m < M; m++) {
      _mm256_storeu_ps(y + m * N + t * TILE, _mm512_castps512_ps256(acc[m]));
      if (t + 1 < t1) _mm256_storeu_ps(y + m * N + (t + 1) * TILE, high(acc[m]));
    }
  }
  _tile_release();
}
#endif

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_mm: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_mm: packed must be a contiguous uint8 [N / 8, K / 32, 4, 32]");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous(), "int4_mm: sm must be float16");
  const int64_t M = x.size(0), K = x.size(1), G = K / BLOCK, T = packed.size(0), N = T * TILE;
  TORCH_CHECK(K % BLOCK == 0 && packed.size(1) == G && sm.numel() == N * G * 2,
              "int4_mm: x's inputs do not match the packed weight");
  auto y = at::empty({M, N}, x.options());
  Rows16 rows(x);
  const int16_t* pp = rows.p.data();
  const float *d = rows.d.data(), *sum = rows.sum.data();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* smp = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  // Threads split the tiles (each output is one thread's), so their number cannot change a bit;
  // each takes at least 64 KB of weights: below that, starting one costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / (TILE * K / 2));
#if defined(__AMX_INT8__) && defined(__AVX512BW__)
  if (M >= AMX_MIN && amx_granted()) {  // two tiles at a time, so threads split the pairs
    const std::vector<int8_t> a = amx_pieces(pp, M, AMX_ROWS, K);
    at::parallel_for(0, (T + 1) / 2, (grain + 1) / 2, [&](int64_t u0, int64_t u1) {
      tiles_amx(a.data(), M, AMX_ROWS, d, sum, K, w, smp, yp, N, 2 * u0, std::min(2 * u1, T));
    });
    return y;
  }
#endif
#ifdef __AVX512BW__
  const std::vector<int32_t> p2 = M > 1 ? pairs2(pp, M, K) : std::vector<int32_t>();  // tiles512's
#endif
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    in_pieces<MT_WIDE>(M, [&](auto R, int64_t r) {
#ifdef __AVX512BW__
      if constexpr (R() > 1)
        tiles512<R()>(p2.data() + r * K / 2, d + r * G, sum + r * G, K, w, smp, yp + r * N, N,
                      t0, t1);
      else
#endif
        tiles<R()>(pp + r * K, d + r * G, sum + r * G, K, w, smp, yp + r * N, N, t0, t1);
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// int8, q in -128..127 with a float32 scale (and min, where the layer has them) per group of
// `group` inputs (a multiple of 32: 32 for GGUF's Q8_0, all K for one scale a row). The layout is
// quantize.py's own, a row of q after another ([N, K]), so an LM head keeps sharing its rows with
// the embedding that reads them back. A block of 32 weights of one output becomes two registers
// of 16 16-bit integers, which madd multiplies by the block's 32 values of p, read as they lie.

// Outputs [n, n + no) of one row of x: their sums t, plus the min's term where the layer has mins
// (per group h: m * x summed over it, from the row's block sums), into the row's y.
void store_outputs(float* t, int no, int64_t n, const float* sum, const float* mn, int64_t S,
                   int64_t per, float* y) {
  for (int o = 0; o < no; o++) {
    if (mn != nullptr) {
      for (int64_t h = 0; h < S; h++) {
        float xs = 0;
        for (int64_t b = h * per; b < (h + 1) * per; b++) xs += sum[b];
        t[o] += mn[(n + o) * S + h] * xs;
      }
    }
    y[n + o] = t[o];
  }
}

// Ask for the weights of outputs [n, n + no) PREFETCH bytes ahead of their block b, in the order
// they lie: their rows are no * K bytes one after another, which the loops below read at no * 32
// bytes a block, so the requests run along them at that pace. (Requests at each output's own
// row, in the order the loops read, left the product waiting on memory: on a 2-core EPYC the
// head's 1-row product took 3.2-3.7 ms against 1.5-1.7, 3 rows 3.4 against 3.0.)
inline void prefetch_rows(const int8_t* q, int64_t n, int64_t K, int64_t b, int no) {
  for (int64_t l = 0; l < no * BLOCK; l += 64)
    _mm_prefetch((const char*)(q + n * K + b * no * BLOCK + l + PREFETCH), _MM_HINT_T0);
}

// Rows [0, R) of x (R <= MT) times outputs [n0, n1), NO outputs at a time (n1 - n0 a multiple of
// NO): y[r, n]. One row of x takes 4 outputs at a time: 4 independent sums keep the core busy
// while the weights stream in (the head's 1-row product, one thread: 2.5 ms against 3.5 one by
// one), and one reduction serves the 4. More rows take 2 (the head's 2-row product in 0.82x the
// time of one by one, 3 rows 0.95x).
template <int R, int NO>
void rows8(const int16_t* p, const float* d, const float* sum, int64_t K, const int8_t* q,
           const float* s, const float* mn, int64_t group, float* y, int64_t N, int64_t n0,
           int64_t n1) {
  // blocks, blocks a group, groups
  const int64_t G = K / BLOCK, per = group / BLOCK, S = K / group;
  for (int64_t n = n0; n < n1; n += NO) {
    __m256 acc[R][NO];
    for (int r = 0; r < R; r++)
      for (int o = 0; o < NO; o++) acc[r][o] = _mm256_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
      prefetch_rows(q, n, K, b, NO);
      for (int o = 0; o < NO; o++) {
        const int8_t* qb = q + (n + o) * K + b * BLOCK;
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)qb));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(qb + 16)));
        const float sb = s[(n + o) * S + b / per];
        for (int r = 0; r < R; r++) {
          const int16_t* pb = p + r * K + b * BLOCK;
          __m256i i = dot_pairs(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)pb)),
                                w1, _mm256_loadu_si256((const __m256i*)(pb + 16)));
          acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(sb * d[r * G + b]),
                                      acc[r][o]);
        }
      }
    }
    for (int r = 0; r < R; r++) {
      float t[NO];
      if constexpr (NO == 4) _mm_storeu_ps(t, sum4(acc[r]));
      else for (int o = 0; o < NO; o++) t[o] = sum8(acc[r][o]);
      store_outputs(t, NO, n, sum + r * G, mn, S, per, y + r * N);
    }
  }
}

#ifdef __AVX512BW__
// More than one row of x with AVX-512: rows8<R, 2> for P pairs of outputs at a time. A register
// holds an output pair's first (then last) 16 weights of a block as 16-bit integers, output o's
// in 32-bit lanes 8 o .. 8 o + 7, and the row's 16 matching values of p twice (a broadcast), so a
// multiply-add leaves lane 8 o + l holding what rows8's lane l holds for output o: every bit is
// rows8's. (The form before this one took a block's 32 weights of one output in a register and
// moved lanes to add l and l + 8: two shuffles and an add a row and pair. SmolLM2-135M's int8
// head, 4 rows, one thread of a 2-core Xeon: 6.3-6.5 ms, this 4.7-4.8; with MT_WIDE's pieces of 8
// rows and int8_mm's slices, 5 rows 3.6-4.7 ms against 9.1-9.4, 8 rows 5.4-6.8 against 12.4-13.2.)
template <int R, int P>  // R > 1
void rows8x2_512(const int16_t* p, const float* d, const float* sum, int64_t K, const int8_t* q,
                 const float* s, const float* mn, int64_t group, float* y, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t G = K / BLOCK, per = group / BLOCK, S = K / group;
  const auto two = [](const int8_t* a, const int8_t* b) {  // 16 int8 of each -> 32 int16
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
        _mm_loadu_si128((const __m128i*)b), 1));
  };
  for (int64_t n = n0; n < n1; n += 2 * P) {
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < P; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; b++) {
      __m512i lo[P], hi[P];
      __m512 sb[P];
      prefetch_rows(q, n, K, b, 2 * P);
      for (int j = 0; j < P; j++) {
        const int8_t *q0 = q + (n + 2 * j) * K + b * BLOCK, *q1 = q0 + K;
        lo[j] = two(q0, q1);
        hi[j] = two(q0 + 16, q1 + 16);
        sb[j] = halves(_mm256_set1_ps(s[(n + 2 * j) * S + b / per]),
                       _mm256_set1_ps(s[(n + 2 * j + 1) * S + b / per]));
      }
      for (int r = 0; r < R; r++) {
        const int16_t* pb = p + r * K + b * BLOCK;
        const __m512i plo = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)pb));
        const __m512i phi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(pb + 16)));
        const __m512 db = _mm512_set1_ps(d[r * G + b]);
        for (int j = 0; j < P; j++) {
          const __m512i i = dot_pairs(_mm512_madd_epi16(lo[j], plo), hi[j], phi);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sb[j], db), acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int j = 0; j < P; j++) {
        float t[2] = {sum8(_mm512_castps512_ps256(acc[r][j])), sum8(high(acc[r][j]))};
        store_outputs(t, 2, n + 2 * j, sum + r * G, mn, S, per, y + r * N);
      }
  }
}
#endif

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_mm: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_mm: q must be a contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), S = scales.size(1);
  TORCH_CHECK(K % BLOCK == 0 && q.size(1) == K && S > 0 && K % S == 0 && (K / S) % BLOCK == 0,
              "int8_mm: needs inputs and groups in multiples of 32, and x's inputs q's");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N,
              "int8_mm: scales must be a contiguous float32 [N, groups]");
  TORCH_CHECK(!mins || (mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                        mins->sizes() == scales.sizes()),
              "int8_mm: mins must be float32 like scales");
  auto y = at::empty({M, N}, x.options());
  Rows16 rows(x);
  const int16_t* pp = rows.p.data();
  const float *d = rows.d.data(), *sum = rows.sum.data();
  const int64_t G = K / BLOCK;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / K);  // rows: at least 64 KB a thread
  // A slice of outputs at a time goes through every piece of rows (MT rows a piece): the first
  // piece reads the slice's weights (32 KB) from memory, the others from the core's cache. (Whole
  // pieces one after the other read the head once a piece: 5 rows as 4 + 1 took 8.3 ms on one
  // thread of a 2-core Xeon against 5.9 for 4.) Multiples of 4 outputs: no tail inside a slice.
  const int64_t slice = std::max<int64_t>(4, 32768 / K / 4 * 4);
  constexpr int P = 2;  // pairs of outputs at a time in rows8x2_512
  at::parallel_for(0, N, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += slice) {
      const int64_t n1 = std::min(c1, n0 + slice);
      in_pieces<MT_WIDE>(M, [&](auto R, int64_t r) {
        auto run = [&](auto NO, int64_t a, int64_t b) {
          rows8<R(), NO()>(pp + r * K, d + r * G, sum + r * G, K, qp, sp, mp, K / S, yp + r * N,
                           N, a, b);
        };
        // one row of x: 4 outputs at a time, more rows 2 (their sums fill the registers; with
        // AVX-512 2 P), the last few one by one
#ifdef __AVX512BW__
        constexpr int NO = R() == 1 ? 4 : 2 * P;
#else
        constexpr int NO = R() == 1 ? 4 : 2;
#endif
        const int64_t split = n0 + (n1 - n0) / NO * NO;
#ifdef __AVX512BW__
        if constexpr (R() > 1)
          rows8x2_512<R(), P>(pp + r * K, d + r * G, sum + r * G, K, qp, sp, mp, K / S,
                              yp + r * N, N, n0, split);
        else
#endif
          run(std::integral_constant<int, NO>{}, n0, split);
        run(std::integral_constant<int, 1>{}, split, n1);
      });
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Paged attention: the new tokens of a forward attend to their sequences' K and V in the pool
// (kv_cache.py lays it out; kv_cache.paged_attention is the same math through PyTorch's SDPA).
// SDPA needs each sequence's K and V in one tensor, so that path first copies them out of their
// blocks, and for a 1-token step its twenty-odd small ops cost more than the arithmetic (30
// layers of SmolLM2-135M, one thread, 100 tokens of context: 2.05 ms; this op 0.66). Here a
// token's query heads read the keys and values where they lie, up to the token's own position
// (causal attention), and the softmax runs over float32 scores. The keys 8 slots on are asked for
// ahead: a KV head's slots are 1.5 KB apart there, which the hardware's prefetcher does not follow
// (4000 tokens of context: 27 ms for 30 layers, 57 without).
//   q [N, nh, hd], k and v [N, nkv, hd]   the new tokens' (RoPE applied), written into the pool
//   kv [blocks, bs, 2, nkv, hd]           one layer's pool: per slot K, then V
//   slots [N]                             the pool slot (block * bs + offset) of each new K and V
//   table [b, max_blocks]                 each sequence's blocks in order
//   rows [N], positions [N]               each new token's sequence (row of table) and position
// The g = nh / nkv query heads that share a KV head are done together, so each key and value is
// read once for them.

// e^x, 8 at a time: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a polynomial of degree 7 (the
// coefficients of Cephes' expf, within 2 ulp), times 2^n. Below -87.3 (e^x < 1e-38) it gives
// e^-87.3, above 88 infinity (2^n stays a normal float). The softmax's x are <= 0; SiLU's any.
__m256 exp8(__m256 x_) {
  const __m256 hi = _mm256_set1_ps(88.0f);
  const __m256 x = _mm256_min_ps(_mm256_max_ps(x_, _mm256_set1_ps(-87.3f)), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), inf,
                          _mm256_cmp_ps(x_, hi, _CMP_GT_OQ));
}

// One token and one KV head h: y [g, hd] for its g query heads q [g, hd], over keys 0..L-1 of the
// sequence whose blocks are `blocks`. sc: room for g * Lp scores, Lp = L rounded up to 8.
template <int G>
void attend(const float* q, int64_t hd, const float* pool, const int64_t* blocks, int64_t bs,
            int64_t nkv, int64_t h, int64_t L, float* sc, float* y) {
  const int64_t slot = 2 * nkv * hd, Lp = (L + 7) / 8 * 8;  // floats a slot
  const float scale = 1 / std::sqrt((float)hd);
  // scores: 8 keys at a time (where head_dim is a multiple of 8), each head's 8 dot products in 8
  // registers of lane sums, added across their lanes by sum8x8; the keys left one by one, the G
  // heads' sums side by side. A score is added in the same order either way.
  for (int64_t j0 = 0; j0 < L; j0 += bs) {
    const float* kb = pool + blocks[j0 / bs] * bs * slot + h * hd;
    const int64_t end = std::min(L, j0 + bs);
    int64_t j = j0;
    for (; hd % 8 == 0 && j + 8 <= end; j += 8) {
      const float* key = kb + (j - j0) * slot;
      for (int k = 0; k < 8; k++)  // the keys 8 slots on, one cache line at a time
        for (int64_t c = 0; c < hd; c += 16)
          _mm_prefetch((const char*)(key + (8 + k) * slot + c), _MM_HINT_T0);
      for (int e = 0; e < G; e++) {
        __m256 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < hd; i += 8) {
          const __m256 q8 = _mm256_loadu_ps(q + e * hd + i);
          for (int k = 0; k < 8; k++)
            acc[k] = _mm256_fmadd_ps(q8, _mm256_loadu_ps(key + k * slot + i), acc[k]);
        }
        _mm256_storeu_ps(sc + e * Lp + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
      }
    }
    for (; j < end; j++) {
      const float* key = kb + (j - j0) * slot;
      for (int64_t c = 0; c < hd; c += 16)
        _mm_prefetch((const char*)(key + 8 * slot + c), _MM_HINT_T0);
      __m256 acc[G];
      for (int e = 0; e < G; e++) acc[e] = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= hd; i += 8) {
        const __m256 kv8 = _mm256_loadu_ps(key + i);
        for (int e = 0; e < G; e++)
          acc[e] = _mm256_fmadd_ps(_mm256_loadu_ps(q + e * hd + i), kv8, acc[e]);
      }
      for (int e = 0; e < G; e++) {
        float t = sum8(acc[e]);
        for (int64_t r = i; r < hd; r++) t += q[e * hd + r] * key[r];
        sc[e * Lp + j] = t * scale;
      }
    }
  }
  for (int e = 0; e < G; e++) {  // softmax of each head's scores
    float* s = sc + e * Lp;
    float m = s[0];
    for (int64_t j = 1; j < L; j++) m = s[j] > m ? s[j] : m;
    for (int64_t j = L; j < Lp; j++) s[j] = m;  // padding: e^0, zeroed below
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 8) {
      __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
      if (j + 8 > L) {  // the last 8: padding lanes to 0
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i real = _mm256_cmpgt_epi32(_mm256_set1_epi32(L - j), lane);
        p = _mm256_and_ps(p, _mm256_castsi256_ps(real));
      }
      _mm256_storeu_ps(s + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    const float inv = 1 / sum8(sum);
    for (int64_t j = 0; j < L; j++) s[j] *= inv;
  }
  // y = the probabilities times the values: a head at a time, 64 of its outputs in 8 registers
  // while the keys go by (each output summed over the keys in order)
  const int64_t vec = hd / 8 * 8;
  for (int e = 0; e < G; e++) {
    float* ye = y + e * hd;
    for (int64_t c0 = 0; c0 < vec; c0 += 64) {
      const int n8 = (int)std::min<int64_t>(8, (vec - c0) / 8);
      __m256 acc[8];
      for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const float* vb = pool + blocks[j0 / bs] * bs * slot + (nkv + h) * hd + c0;
        for (int64_t j = j0; j < std::min(L, j0 + bs); j++) {
          const float* value = vb + (j - j0) * slot;
          if (e == 0)
            for (int64_t c = 0; c < std::min<int64_t>(64, hd - c0); c += 16)
              _mm_prefetch((const char*)(value + 8 * slot + c), _MM_HINT_T0);
          const __m256 pe = _mm256_set1_ps(sc[e * Lp + j]);
          for (int c = 0; c < n8; c++)
            acc[c] = _mm256_fmadd_ps(pe, _mm256_loadu_ps(value + 8 * c), acc[c]);
        }
      }
      for (int c = 0; c < n8; c++) _mm256_storeu_ps(ye + c0 + 8 * c, acc[c]);
    }
    for (int64_t i = vec; i < hd; i++) {  // the outputs past the last 8
      float t = 0;
      for (int64_t j = 0; j < L; j++)
        t += sc[e * Lp + j] * pool[(blocks[j / bs] * bs + j % bs) * slot + (nkv + h) * hd + i];
      ye[i] = t;
    }
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                               at::Tensor& kv, const at::Tensor& slots, const at::Tensor& table,
                               const at::Tensor& rows, const at::Tensor& positions) {
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "paged_attention_cpu: kv must be a contiguous float32 [blocks, bs, 2, nkv, hd]");
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const int64_t N = q.size(0), nh = q.size(1), hd = q.size(2), nkv = kv.size(3);
  const int64_t bs = kv.size(1), g = nh / nkv, width = table.size(1);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && kv.size(4) == hd && nh % nkv == 0 &&
                  k.size(0) == N && k.size(1) == nkv && k.size(2) == hd && v.sizes() == k.sizes(),
              "paged_attention_cpu: q [N, nh, hd], k and v [N, nkv, hd] float32, as the pool");
  for (const at::Tensor* t : {&slots, &table, &rows, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention_cpu: slots, table, rows and positions must be contiguous int64");
  float* pool = kv.data_ptr<float>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *tb = table.data_ptr<int64_t>();
  const int64_t *rw = rows.data_ptr<int64_t>(), *ps = positions.data_ptr<int64_t>();
  // First every new K and V into its slot: a token reads those of the tokens before it.
  int64_t work = 0;
  for (int64_t i = 0; i < N; i++) {
    TORCH_CHECK(0 <= sl[i] && sl[i] < kv.size(0) * bs && 0 <= rw[i] && rw[i] < table.size(0) &&
                    0 <= ps[i] && ps[i] < width * bs,
                "paged_attention_cpu: a slot, row or position outside the pool or table");
    float* s = pool + sl[i] * 2 * nkv * hd;
    std::memcpy(s, k.data_ptr<float>() + i * nkv * hd, nkv * hd * sizeof(float));
    std::memcpy(s + nkv * hd, v.data_ptr<float>() + i * nkv * hd, nkv * hd * sizeof(float));
    work += (ps[i] + 1) * nh * hd;
  }
  // Then ask for every slot that each sequence's last new token reads (the others read fewer of
  // the same), all heads' K and V, as they lie: whole blocks, one after another, which the
  // hardware streams in, where each head's passes below read 256 bytes of every 1.5 KB
  // (SmolLM2-135M, one thread, 30 layers: 0.50 ms against 0.70 at 100 tokens of context, 4.9
  // against 6.4 at 1000).
  for (int64_t i = 0; i < N; i++) {
    if (i + 1 < N && rw[i + 1] == rw[i]) continue;
    const int64_t L = ps[i] + 1, per_block = bs * 2 * nkv * hd;
    const int64_t* blocks = tb + rw[i] * width;
    for (int64_t j0 = 0; j0 < L; j0 += bs) {
      const char* b = (const char*)(pool + blocks[j0 / bs] * per_block);
      const int64_t bytes = std::min(bs, L - j0) * 2 * nkv * hd * (int64_t)sizeof(float);
      for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(b + c, _MM_HINT_T0);
    }
  }
  auto y = at::empty({N, nh, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the (token, KV head) pairs, each at least some 16K multiply-adds (below that,
  // starting one costs more than it saves; at 64K a decode step's 3 KV heads stayed on one thread
  // up to about 200 tokens of context: SmolLM2-135M's 30 layers at 100 tokens, two threads, 0.55
  // to 0.80 ms against 0.63 to 0.99); a pair is one thread's, so no bit depends on them.
  const int64_t grain = std::max<int64_t>(1, 16384 * N * nkv / std::max<int64_t>(work, 1));
  at::parallel_for(0, N * nkv, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> sc;
    for (int64_t w = w0; w < w1; w++) {
      const int64_t i = w / nkv, h = w % nkv, L = ps[i] + 1;
      sc.resize(g * ((L + 7) / 8 * 8));
      const float* qh = qp + (i * nh + h * g) * hd;
      float* yh = yp + (i * nh + h * g) * hd;
      const int64_t* blocks = tb + rw[i] * width;
      // the g query heads, at most 8 at a time (the registers of their sums)
      in_pieces<8>(g, [&](auto G, int64_t e) {
        attend<G()>(qh + e * hd, hd, pool, blocks, bs, nkv, h, L, sc.data(), yh + e * hd);
      });
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// A whole decoder layer in one call: a float32 Llama layer whose four products are int4 in
// int4_mm's layout, for the eager CPU step (model.Block.forward calls it where Block.one_call
// holds its weights). From Python a layer is some 40 small torch operations, each a dispatch and
// an allocation; here it is one, and what is left is the products and attention. model.py's
// Block.forward, step by step in its order:
//   h = rms_norm(x) w1;  q | k | v = h Wqkv^T;  q, k = rope(q), rope(k)
//   y = attention (paged_attention_cpu, which writes k and v into the pool);  x = x + y Wo^T
//   h = rms_norm(x) w2;  gate | up = h Wgu^T;  x = x + (silu(gate) * up) Wdown^T
// Each row (token) on its own, so a row's bits do not depend on the rows beside it. They agree
// with the Python layer's to float rounding (sums in another order).

// out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, for the N rows of x [N, H]
void rms_norm_rows(const float* x, const float* w, int64_t N, int64_t H, float eps, float* out) {
  for (int64_t i = 0; i < N; i++) {
    const float* xi = x + i * H;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= H; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xi + j),
                                                     _mm256_loadu_ps(xi + j), acc);
    float ss = sum8(acc);
    for (; j < H; j++) ss += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(ss / H + eps);
    for (j = 0; j < H; j++) out[i * H + j] = xi[j] * r * w[j];
  }
}

// RoPE in place on the first `heads` heads of each row of qkv [N, width] (q's heads, then k's):
// x * cos + (x2, x1) * sin, where sin carries its first half negated (model.rope_cos_sin)
void rope_rows(float* qkv, int64_t N, int64_t width, int64_t heads, int64_t hd, const float* cos,
               const float* sin) {
  std::vector<float> t(hd);
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < N; i++)
    for (int64_t h = 0; h < heads; h++) {
      float* x = qkv + i * width + h * hd;
      const float *c = cos + i * hd, *s = sin + i * hd;
      for (int64_t j = 0; j < hd; j++)
        t[j] = x[j] * c[j] + x[j < half ? j + half : j - half] * s[j];
      std::memcpy(x, t.data(), hd * sizeof(float));
    }
}

// a[j] = silu(gate[j]) * up[j] for j < I, 8 at a time (the last few through a padded copy), with
// exp8: std::exp, one element at a time, took 5 ns an element (this, 0.8-1.1), and SiLU's 1,536 a
// row and layer were 3% of SmolLM2-135M's decode step. Every build runs these AVX2 instructions,
// so every form of the kernels computes the same bits.
void silu_mul(const float* gate, const float* up, int64_t I, float* a) {
  const auto eight = [](const float* g, const float* u, float* out) {
    const __m256 x = _mm256_loadu_ps(g);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                    exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(out, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
  };
  int64_t j = 0;
  for (; j + 8 <= I; j += 8) eight(gate + j, up + j, a + j);
  if (j < I) {
    float g[8] = {}, u[8] = {}, out[8];
    std::memcpy(g, gate + j, (I - j) * sizeof(float));
    std::memcpy(u, up + j, (I - j) * sizeof(float));
    eight(g, u, out);
    std::memcpy(a + j, out, (I - j) * sizeof(float));
  }
}

// w: the input norm's weight, Wqkv (packed, sm), Wo (packed, sm), the post-attention norm's
// weight, Wgu (packed, sm), Wdown (packed, sm). x [N, H] -> the layer's output [N, H].
at::Tensor int4_layer(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_,
                      at::TensorList w, double eps, int64_t nh, int64_t nkv, at::Tensor& kv,
                      const at::Tensor& slots, const at::Tensor& table, const at::Tensor& rows,
                      const at::Tensor& positions) {
  TORCH_CHECK(w.size() == 10, "int4_layer: w is 2 norms' weights and 4 products' (packed, sm)");
  const at::Tensor x = x_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  const int64_t N = x.size(0), H = x.size(1), hd = kv.size(4);
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  cos.size(0) == N && cos.size(1) == hd && sin.sizes() == cos.sizes() &&
                  w[0].numel() == H && w[5].numel() == H,
              "int4_layer: x [N, H], cos and sin [N, head_dim] float32, norms of H");
  const float e = static_cast<float>(eps);
  auto h = at::empty({N, H}, x.options());
  rms_norm_rows(x.data_ptr<float>(), w[0].data_ptr<float>(), N, H, e, h.data_ptr<float>());
  at::Tensor qkv = int4_mm(h, w[1], w[2]);  // [N, (nh + 2 nkv) hd]
  const int64_t width = qkv.size(1);
  TORCH_CHECK(width == (nh + 2 * nkv) * hd, "int4_layer: Wqkv's outputs are not q, k and v's");
  rope_rows(qkv.data_ptr<float>(), N, width, nh + nkv, hd, cos.data_ptr<float>(),
            sin.data_ptr<float>());
  const at::Tensor q = qkv.narrow(1, 0, nh * hd).view({N, nh, hd});
  const at::Tensor k = qkv.narrow(1, nh * hd, nkv * hd).view({N, nkv, hd});
  const at::Tensor v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({N, nkv, hd});
  const at::Tensor y = paged_attention_cpu(q, k, v, kv, slots, table, rows, positions);
  const at::Tensor o = int4_mm(y.view({N, nh * hd}), w[3], w[4]);  // [N, H]
  auto out = at::empty({N, H}, x.options());
  float* xo = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *op = o.data_ptr<float>();
  for (int64_t j = 0; j < N * H; j++) xo[j] = xp[j] + op[j];
  rms_norm_rows(xo, w[5].data_ptr<float>(), N, H, e, h.data_ptr<float>());
  const at::Tensor gu = int4_mm(h, w[6], w[7]);  // [N, 2 I]
  const int64_t I = gu.size(1) / 2;
  auto a = at::empty({N, I}, x.options());
  float* ap = a.data_ptr<float>();
  const float* g = gu.data_ptr<float>();
  for (int64_t i = 0; i < N; i++) silu_mul(g + i * 2 * I, g + i * 2 * I + I, I, ap + i * I);
  const at::Tensor d = int4_mm(a, w[8], w[9]);  // [N, H]
  const float* dp = d.data_ptr<float>();
  for (int64_t j = 0; j < N * H; j++) xo[j] += dp[j];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor sm) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor q, Tensor scales, Tensor? mins) -> Tensor");
  m.def("paged_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, Tensor slots, "
        "Tensor table, Tensor rows, Tensor positions) -> Tensor");
  m.def("int4_layer(Tensor x, Tensor cos, Tensor sin, Tensor[] w, float eps, int nh, int nkv, "
        "Tensor(a!) kv, Tensor slots, Tensor table, Tensor rows, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd, CPU, m) {
  m.impl("int4_mm", int4_mm);
  m.impl("int8_mm", int8_mm);
  m.impl("paged_attention_cpu", paged_attention_cpu);
  m.impl("int4_layer", int4_layer);
}
