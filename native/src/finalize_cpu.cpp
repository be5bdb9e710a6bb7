// The CPU twin of the MoE finalize rows (docs/CONTRACT.md §4; the GPU version is
// sccl_finalize in sparkccl/dataplane/kernels/finalize.cu): for each token row t,
//
//   acc = float(shared[t]);  acc = fmaf(w[t, k], yv(pos[t * topk + k]), acc)  for k = 0..topk-1
//   row[t] = bf16(acc)  (round to nearest even; NaN stays NaN)
//
// with yv = float(y[p, col]) for bf16 y, or float(e4m3 y[p, col]) * scale[p, col / 128] (one
// fp32 multiply, rounded) for e4m3 y. Rows t >= T are zero. std::fmaf is a true fused
// multiply-add (one rounding), the same operation as the GPU's fma.rn.f32, so both give the
// same bits. Test-visible through sparkccl._native.finalize_rows; the Python side
// (sparkccl/dataplane/cpu.py) validates the inputs first.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace sparkccl {
namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN = S.1111.111.
inline float e4m3_to_f32(uint8_t b) {
  const uint32_t s = uint32_t(b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 7;
  uint32_t u;
  if (e == 15 && m == 7) {
    u = s | 0x7FC00000u;
  } else if (e == 0) {
    float f = float(m) * 0.001953125f;  // m * 2^-9, exact
    return s ? -f : f;
  } else {
    u = s | ((e + 120) << 23) | (m << 20);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bf16 term of a row, acc[c] = fmaf(wk, y[c], acc[c]), for the whole row at once: on x86
// also built for x86-64-v3 (AVX2 + FMA) and picked at load time, where the loop becomes
// vfmadd over 8 lanes. A vector FMA rounds each lane once, as fmaf does, so the bits are the
// same; without it every element is a call into libm's fmaf (most of combine's CPU time).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void fma_bf16_row(float* __restrict acc, const uint16_t* __restrict yr, float wk, int64_t H) {
  for (int64_t c = 0; c < H; c += 8)  // (H % 8 == 0; a fixed inner count the compiler vectorizes)
    for (int j = 0; j < 8; ++j) acc[c + j] = std::fmaf(wk, bf16_to_f32(yr[c + j]), acc[c + j]);
}

// Rows [t0, t0 + n) into out (n rows of 2H bytes). Returns how many (row, k) terms had an
// index outside [0, R) (their term is NaN: the caller checked the range before, so 0).
int64_t finalize_rows(uint64_t y, bool fp8, uint64_t scales, uint64_t pos, uint64_t w,
                      uint64_t shared, int64_t T, int64_t topk, int64_t H, int64_t R, int64_t t0,
                      int64_t n, uint64_t out) {
  if (H <= 0 || H % 8) throw std::invalid_argument("finalize_rows: H must be a positive multiple of 8");
  if (fp8 && H % 128) throw std::invalid_argument("finalize_rows: e4m3 needs H % 128 == 0");
  if (topk < 0 || topk > 16) throw std::invalid_argument("finalize_rows: topk must be 0..16");
  if (t0 < 0 || n < 0 || T < 0 || R < 0) throw std::invalid_argument("finalize_rows: negative size");
  if (!out || (n && t0 < T && (!shared || (topk && (!pos || !w || !y)) || (fp8 && topk && !scales))))
    throw std::invalid_argument("finalize_rows: null pointer");
  const auto* yb = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(y));
  const auto* y8 = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(y));
  const auto* sc = reinterpret_cast<const float*>(static_cast<uintptr_t>(scales));
  const auto* ps = reinterpret_cast<const int32_t*>(static_cast<uintptr_t>(pos));
  const auto* ws = reinterpret_cast<const float*>(static_cast<uintptr_t>(w));
  const auto* sh = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(shared));
  auto* o = reinterpret_cast<uint16_t*>(static_cast<uintptr_t>(out));
  const int64_t groups = H / 128;
  std::vector<float> acc(static_cast<size_t>(H));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    uint16_t* row = o + i * H;
    if (t >= T) {
      std::memset(row, 0, size_t(H) * 2);
      continue;
    }
    for (int64_t c = 0; c < H; ++c) acc[c] = bf16_to_f32(sh[t * H + c]);
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t p = ps[t * topk + k];
      const float wk = ws[t * topk + k];
      if (p < 0 || p >= R) {
        ++bad;
        for (int64_t c = 0; c < H; ++c) acc[c] = std::fmaf(wk, NAN, acc[c]);
        continue;
      }
      if (!fp8) {
        fma_bf16_row(acc.data(), yb + p * H, wk, H);
      } else {
        const uint8_t* yr = y8 + p * H;
        const float* sr = sc + p * groups;
        for (int64_t c = 0; c < H; ++c) {
          volatile float yv = e4m3_to_f32(yr[c]) * sr[c / 128];  // rounded to fp32 first
          acc[c] = std::fmaf(wk, yv, acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < H; ++c)  // NaN: the canonical 0x7FFF, as the GPU's
      row[c] = std::isnan(acc[c]) ? uint16_t(0x7FFF) : f32_to_bf16(acc[c]);
  }
  return bad;
}

}  // namespace

void bind_finalize(nb::module_& m) {
  m.def(
      "finalize_rows",
      [](uint64_t y, bool fp8, uint64_t scales, uint64_t pos, uint64_t w, uint64_t shared,
         int64_t T, int64_t topk, int64_t H, int64_t R, int64_t t0, int64_t n, uint64_t out) {
        nb::gil_scoped_release nogil;
        return finalize_rows(y, fp8, scales, pos, w, shared, T, topk, H, R, t0, n, out);
      },
      "y_addr"_a, "fp8"_a, "scales_addr"_a, "pos_addr"_a, "w_addr"_a, "shared_addr"_a, "T"_a,
      "topk"_a, "H"_a, "R"_a, "t0"_a, "n"_a, "out_addr"_a,
      "MoE finalize rows [t0, t0 + n) as bf16 into out (fp32 fmaf chain in k order, rounded "
      "once; rows >= T zero). Returns the number of out-of-range indices met (their term is NaN).");
}

}  // namespace sparkccl
