// CPU multi-tensor AdamW (csrc/cpu) against a scalar reference written here
// from docs/design.md ("Rounding contract", "Master weights and remainders").  The
// reference evaluates the formula in adamw_element's operation order, so every
// instruction set must reproduce it bit for bit.
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "csrc/cpu/adamw_cpu.h"

namespace muon_ext {
namespace cpu {
namespace {

uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Conversions for the reference come from c10 (torch's `.to(dtype)`) and the
// rules in docs/design.md ("Rounding contract"), never from the headers under test.
float upcast16(ScalarKind k, uint16_t h) {
  return k == ScalarKind::kBFloat16 ? u2f(uint32_t(h) << 16) : float(c10::Half(h, c10::Half::from_bits()));
}
uint16_t rne16(ScalarKind k, float x) { return k == ScalarKind::kBFloat16 ? c10::BFloat16(x).x : c10::Half(x).x; }

const char* kind_name(ScalarKind k) {
  return k == ScalarKind::kFloat32 ? "f32" : k == ScalarKind::kBFloat16 ? "bf16" : "f16";
}
const char* master_name(MasterMode m) {
  return m == MasterMode::kNone ? "None" : m == MasterMode::kFP32 ? "FP32" : "Remainder";
}

struct Combo {
  ScalarKind param, grad;
  MasterMode master;
};

void PrintTo(const Combo& c, std::ostream* os) {
  *os << "param " << kind_name(c.param) << ", grad " << kind_name(c.grad) << ", master " << master_name(c.master);
}

// One tensor's buffers; only the vectors its combo uses are non-empty.
struct HostTensor {
  Combo combo;
  int64_t n = 0;
  std::vector<float> p32, g32, master32, m, v;
  std::vector<uint16_t> p16, g16;
  std::vector<int16_t> rem;
  float step = 0;

  AdamWTensor view() {
    AdamWTensor t;
    t.param = combo.param == ScalarKind::kFloat32 ? static_cast<void*>(p32.data()) : p16.data();
    t.grad = combo.grad == ScalarKind::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.master = combo.master == MasterMode::kFP32       ? static_cast<void*>(master32.data())
               : combo.master == MasterMode::kRemainder ? static_cast<void*>(rem.data())
                                                        : nullptr;
    t.step = &step;
    t.numel = n;
    return t;
  }

  float read_master(int64_t i) const {
    switch (combo.master) {
      case MasterMode::kFP32: return master32[i];
      case MasterMode::kRemainder: return u2f((uint32_t(p16[i]) << 16) + uint32_t(int32_t(rem[i])));
      case MasterMode::kNone: break;
    }
    return combo.param == ScalarKind::kFloat32 ? p32[i] : upcast16(combo.param, p16[i]);
  }

  // The remainder rule where remainders are stored, torch's RNE elsewhere.
  void write_master(int64_t i, float p) {
    if (combo.master == MasterMode::kRemainder) {
      const uint32_t b = f2u(p);
      p16[i] = uint16_t((b >> 16) + ((b & 0xFFFFu) >= 0x8000u));
      rem[i] = int16_t(uint16_t(b & 0xFFFFu));
      return;
    }
    if (combo.master == MasterMode::kFP32) master32[i] = p;
    if (combo.param == ScalarKind::kFloat32) {
      p32[i] = p;
    } else {
      p16[i] = rne16(combo.param, p);
    }
  }

  float read_grad(int64_t i) const {
    return combo.grad == ScalarKind::kFloat32 ? g32[i] : upcast16(combo.grad, g16[i]);
  }

  void set_grad(int64_t i, float g) {
    if (combo.grad == ScalarKind::kFloat32) {
      g32[i] = g;
    } else {
      g16[i] = rne16(combo.grad, g);
    }
  }
};

HostTensor make_tensor(const Combo& c, int64_t n, float step, std::mt19937& rng) {
  HostTensor t;
  t.combo = c;
  t.n = n;
  t.step = step;
  t.m.resize(n);
  t.v.resize(n);
  if (c.param == ScalarKind::kFloat32) t.p32.resize(n); else t.p16.resize(n);
  if (c.grad == ScalarKind::kFloat32) t.g32.resize(n); else t.g16.resize(n);
  if (c.master == MasterMode::kFP32) t.master32.resize(n);
  if (c.master == MasterMode::kRemainder) t.rem.resize(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    t.write_master(i, i % 13 == 0 ? 0.0f : 0.5f * normal(rng));  // FP32 masters are not BF16-representable
    t.m[i] = 0.01f * normal(rng);
    const float s = 0.03f * normal(rng);
    t.v[i] = i % 11 == 0 ? 0.0f : s * s;
  }
  return t;
}

void fill_grads(std::vector<HostTensor>& ts, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (HostTensor& t : ts) {
    for (int64_t i = 0; i < t.n; ++i) {
      const float g = i % 17 == 0 ? 0.0f : i % 29 == 0 ? 1e-40f : scale * normal(rng);
      t.set_grad(i, g);
    }
  }
}

AdamWBatch make_batch(const Combo& c, std::vector<HostTensor>& ts) {
  AdamWBatch b;
  b.param_kind = c.param;
  b.grad_kind = c.grad;
  b.master_mode = c.master;
  for (HostTensor& t : ts) b.tensors.push_back(t.view());
  return b;
}

// beta^n by binary exponentiation in double, the sequence of multiplications
// make_adamw_coeffs documents (library pow differs between glibc and CUDA).
double reference_pow(double base, float step) {
  double result = 1.0;
  for (auto n = static_cast<unsigned long long>(step); n != 0; n >>= 1, base *= base) {
    if (n & 1) result *= base;
  }
  return result;
}

// AdamW as docs/design.md writes it ("Rounding contract"), in adamw_element's
// order; the reciprocal bias corrections are computed in double and rounded
// once, as make_adamw_coeffs documents.
void reference_step(std::vector<HostTensor>& ts, const AdamWHyper& h, float lr, float inv_scale) {
  const float one_minus_b1 = 1.0f - h.beta1, one_minus_b2 = 1.0f - h.beta2;
  for (HostTensor& t : ts) {
    t.step += 1.0f;
    const float inv_bc1 = h.bias_correction ? float(1.0 / (1.0 - reference_pow(h.beta1, t.step))) : 1.0f;
    const float inv_bc2 = h.bias_correction ? float(1.0 / (1.0 - reference_pow(h.beta2, t.step))) : 1.0f;
    for (int64_t i = 0; i < t.n; ++i) {
      float p = t.read_master(i);
      float g = t.read_grad(i) * inv_scale;
      if (!h.adam_w_mode) g = g + h.weight_decay * p;
      float& m = t.m[i];
      float& v = t.v[i];
      m = h.beta1 * m + one_minus_b1 * g;
      v = h.beta2 * v + one_minus_b2 * (g * g);
      float upd = (m * inv_bc1) / (std::sqrt(v * inv_bc2) + h.eps);
      if (h.adam_w_mode) upd = upd + h.weight_decay * p;
      p = p - lr * upd;
      t.write_master(i, p);
    }
  }
}

template <typename T>
::testing::AssertionResult same_bits(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size differs";
  if (got.empty() || std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) {
    return ::testing::AssertionSuccess();
  }
  size_t i = 0;
  while (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) ++i;
  uint32_t a = 0, b = 0;
  std::memcpy(&a, &got[i], sizeof(T));
  std::memcpy(&b, &want[i], sizeof(T));
  char buf[96];
  std::snprintf(buf, sizeof(buf), "[%zu]: got 0x%0*X, want 0x%0*X", i, int(2 * sizeof(T)), a, int(2 * sizeof(T)), b);
  return ::testing::AssertionFailure() << what << " differs first at " << buf;
}

::testing::AssertionResult same_state(const HostTensor& got, const HostTensor& want) {
  for (auto r : {same_bits("param f32", got.p32, want.p32), same_bits("param 16-bit", got.p16, want.p16),
                 same_bits("FP32 master", got.master32, want.master32), same_bits("remainder", got.rem, want.rem),
                 same_bits("exp_avg", got.m, want.m), same_bits("exp_avg_sq", got.v, want.v),
                 same_bits("step", std::vector<float>{got.step}, std::vector<float>{want.step})}) {
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

std::vector<Combo> supported_combos() {
  std::vector<Combo> out;
  for (ScalarKind g : {ScalarKind::kFloat32, ScalarKind::kBFloat16, ScalarKind::kFloat16}) {
    out.push_back({ScalarKind::kFloat32, g, MasterMode::kNone});
    for (MasterMode m : {MasterMode::kNone, MasterMode::kFP32, MasterMode::kRemainder}) {
      out.push_back({ScalarKind::kBFloat16, g, m});
    }
    for (MasterMode m : {MasterMode::kNone, MasterMode::kFP32}) out.push_back({ScalarKind::kFloat16, g, m});
  }
  return out;
}

class AdamWCpu : public ::testing::TestWithParam<Combo> {};

TEST_P(AdamWCpu, MatchesScalarReferenceBitExact) {
  const Combo c = GetParam();
  // Sizes around the vector width, the 512-element staging block and the
  // 16384-element work item; the batch mixes them with an empty tensor.
  const std::vector<std::vector<int64_t>> layouts = {
      {0}, {1}, {7}, {4097}, {65537}, {3, 0, 65537, 1, 4097, 16384, 16385, 7, 513}};
  // A schedule of (lr, inv_scale): a grad scaler's power of two, no scaler, and an arbitrary factor.
  const float lrs[] = {1e-2f, 3e-3f, 2.5e-2f};
  const float inv_scales[] = {1.0f / 1024, 1.0f, 0.3f};
  for (CpuCapability cap : available_capabilities()) {
    for (bool adam_w : {true, false}) {
      for (bool bias_correction : {true, false}) {
        const AdamWHyper hyper{0.9f, 0.999f, 1e-8f, adam_w ? 0.1f : 0.05f, adam_w, bias_correction};
        for (const auto& layout : layouts) {
          std::mt19937 rng(uint32_t(layout.size() * 7919 + layout[0]));
          std::vector<HostTensor> kernel;
          for (size_t k = 0; k < layout.size(); ++k) {
            kernel.push_back(make_tensor(c, layout[k], float((k * 37) % 5 == 0 ? 0 : k * 37), rng));
          }
          std::vector<HostTensor> ref = kernel;
          for (int s = 0; s < 3; ++s) {
            fill_grads(kernel, rng, 1.0f / inv_scales[s] * 0.01f);
            for (size_t k = 0; k < kernel.size(); ++k) ref[k].g32 = kernel[k].g32, ref[k].g16 = kernel[k].g16;
            const AdamWHyper& h = hyper;
            adamw_step(make_batch(c, kernel), h, lrs[s], inv_scales[s], cap);
            reference_step(ref, h, lrs[s], inv_scales[s]);
            for (size_t k = 0; k < kernel.size(); ++k) {
              ASSERT_TRUE(same_state(kernel[k], ref[k]))
                  << capability_name(cap) << (adam_w ? " AdamW" : " L2") << " bias_correction=" << bias_correction
                  << " layout[0]=" << layout[0] << " (" << layout.size() << " tensors) tensor " << k
                  << " numel " << layout[k] << " step " << s + 1;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCombos, AdamWCpu, ::testing::ValuesIn(supported_combos()),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           return std::string("param_") + kind_name(info.param.param) + "_grad_" +
                                  kind_name(info.param.grad) + "_master_" + master_name(info.param.master);
                         });

// The three ways to hold an FP32 master must follow one trajectory when they
// start from the same BF16-representable values (fresh remainder zero).
TEST(AdamWCpuMasters, SameTrajectoryForFP32ParamFP32MasterAndRemainder) {
  const int64_t n = 4097;
  const Combo own{ScalarKind::kFloat32, ScalarKind::kFloat32, MasterMode::kNone};
  const Combo fp32{ScalarKind::kBFloat16, ScalarKind::kFloat32, MasterMode::kFP32};
  const Combo remainder{ScalarKind::kBFloat16, ScalarKind::kFloat32, MasterMode::kRemainder};
  for (CpuCapability cap : available_capabilities()) {
    for (bool adam_w : {true, false}) {
      SCOPED_TRACE(std::string(capability_name(cap)) + (adam_w ? " AdamW" : " L2"));
      std::mt19937 rng(99);
      std::vector<HostTensor> a{make_tensor(own, n, 0, rng)};
      for (float& p : a[0].p32) p = u2f(f2u(p) & 0xFFFF0000u);  // BF16-representable start
      std::vector<HostTensor> b{make_tensor(fp32, n, 0, rng)};
      std::vector<HostTensor> r{make_tensor(remainder, n, 0, rng)};
      for (HostTensor* t : {&b[0], &r[0]}) {
        t->m = a[0].m;
        t->v = a[0].v;
        for (int64_t i = 0; i < n; ++i) t->p16[i] = uint16_t(f2u(a[0].p32[i]) >> 16);
      }
      b[0].master32 = a[0].p32;
      std::fill(r[0].rem.begin(), r[0].rem.end(), int16_t(0));
      const AdamWHyper h{0.9f, 0.95f, 1e-8f, 0.1f, adam_w, true};
      const float lr = 1e-2f;
      for (int s = 0; s < 20; ++s) {
        fill_grads(a, rng, 0.1f);
        b[0].g32 = r[0].g32 = a[0].g32;
        adamw_step(make_batch(own, a), h, lr, 0.5f, cap);
        adamw_step(make_batch(fp32, b), h, lr, 0.5f, cap);
        adamw_step(make_batch(remainder, r), h, lr, 0.5f, cap);
        std::vector<float> reconstructed(n);
        for (int64_t i = 0; i < n; ++i) reconstructed[i] = r[0].read_master(i);
        ASSERT_TRUE(same_bits("FP32 master vs FP32 param", b[0].master32, a[0].p32)) << "step " << s + 1;
        ASSERT_TRUE(same_bits("remainder master vs FP32 param", reconstructed, a[0].p32)) << "step " << s + 1;
        ASSERT_TRUE(same_bits("exp_avg_sq", r[0].v, a[0].v)) << "step " << s + 1;
      }
    }
  }
}

// Every instruction set must give DEFAULT's bits, also on inputs the
// reference test avoids: subnormals, huge values, overflow to inf, NaN.
TEST(AdamWCpuIsa, ExtremeInputsMatchDefault) {
  const auto caps = available_capabilities();
  if (caps.size() < 2) GTEST_SKIP() << "only DEFAULT is available";
  const Combo combos[] = {{ScalarKind::kFloat32, ScalarKind::kFloat32, MasterMode::kNone},
                          {ScalarKind::kBFloat16, ScalarKind::kBFloat16, MasterMode::kRemainder},
                          {ScalarKind::kBFloat16, ScalarKind::kFloat16, MasterMode::kFP32},
                          {ScalarKind::kFloat16, ScalarKind::kFloat16, MasterMode::kNone}};
  const float specials[] = {0.0f, -0.0f, 1e-45f, -1e-40f, 1e-30f, 3e38f, -3e38f, 65504.0f, 1e20f, INFINITY, NAN};
  for (const Combo& c : combos) {
    std::mt19937 rng(7);
    std::vector<HostTensor> base{make_tensor(c, 1000, 4, rng)};
    std::uniform_int_distribution<int> pick(0, 10);
    for (int64_t i = 0; i < base[0].n; i += 3) {
      base[0].write_master(i, specials[pick(rng)]);
      base[0].m[i] = specials[pick(rng)];
      base[0].v[i] = std::fabs(specials[pick(rng)]);
    }
    fill_grads(base, rng, 1.0f);
    for (int64_t i = 1; i < base[0].n; i += 5) base[0].set_grad(i, specials[pick(rng)]);
    const AdamWHyper h{0.9f, 0.999f, 1e-8f, 0.01f, true, true};
    const float lr = 1e-3f;
    std::vector<std::vector<HostTensor>> out;
    for (CpuCapability cap : caps) {
      out.push_back(base);
      adamw_step(make_batch(c, out.back()), h, lr, 1.0f, cap);
    }
    for (size_t k = 1; k < caps.size(); ++k) {
      EXPECT_TRUE(same_state(out[k][0], out[0][0]))
          << capability_name(caps[k]) << " vs DEFAULT, param " << kind_name(c.param) << " master "
          << master_name(c.master);
    }
  }
}

TEST(AdamWCpuDispatch, DefaultIsAlwaysAvailable) {
  const auto caps = available_capabilities();
  ASSERT_FALSE(caps.empty());
  EXPECT_EQ(caps.front(), CpuCapability::kDefault);
  EXPECT_EQ(best_capability(), caps.back());
}

TEST(AdamWCpuDispatch, UnsupportedCombinationsThrow) {
  const Combo bad[] = {{ScalarKind::kFloat32, ScalarKind::kFloat32, MasterMode::kFP32},
                       {ScalarKind::kFloat32, ScalarKind::kFloat32, MasterMode::kRemainder},
                       {ScalarKind::kFloat16, ScalarKind::kFloat32, MasterMode::kRemainder}};
  const AdamWHyper h{0.9f, 0.999f, 1e-8f, 0.01f, true, true};
    const float lr = 1e-3f;
  for (const Combo& c : bad) {
    AdamWBatch batch;
    batch.param_kind = c.param;
    batch.grad_kind = c.grad;
    batch.master_mode = c.master;
    EXPECT_THROW(adamw_step(batch, h, lr, 1.0f, CpuCapability::kDefault), c10::Error)
        << kind_name(c.param) << " + " << master_name(c.master);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace muon_ext

// Each squaring doubles the relative error of the one before, so beta^t by
// binary exponentiation is within ~t * 2^-53 of the library pow (below 1e-9 for
// every step a float counter can hold): far below FP32 resolution, so the FP32
// reciprocal bias correction is the correctly rounded 1 / (1 - beta^t) or one ulp off.
TEST(AdamWBiasCorrection, SquaringAgreesWithLibraryPow) {
  for (float beta : {0.9f, 0.95f, 0.99f, 0.999f, 0.9999f}) {
    for (float step = 1.0f; step < 2.0e6f; step = step < 64.0f ? step + 1.0f : step * 1.37f) {
      const float t = std::floor(step);
      const double exact = std::pow(double(beta), double(t));
      const double squared = muon_ext::pow_by_squaring(double(beta), t);
      ASSERT_NEAR(squared, exact, 1e-9 * exact) << "beta " << beta << " step " << t;
      const float inv = muon_ext::inverse_bias_correction(beta, t, true);
      const float rounded = float(1.0 / (1.0 - exact));
      ASSERT_LE(std::fabs(inv - rounded), std::nextafter(rounded, 1e30f) - rounded) << "beta " << beta << " step " << t;
    }
  }
  EXPECT_EQ(muon_ext::inverse_bias_correction(0.9f, 5.0f, false), 1.0f);
}
