#include "rope_kernels.h"

#include <cstring>

#include "../../cpu/bfloat16.h"

namespace verl_ops {
namespace cpu {

namespace {

// A value that went through memory: the compiler cannot contract the product that made it into a
// fused multiply-add with the next sum (targets with FMA would otherwise round differently).
template <typename T>
inline T materialise(T v) {
  volatile T t = v;
  return t;
}

// float and double: computed in their own type.
template <typename T>
struct Native {
  using Store = T;
  using Acc = T;
  static Acc load(Store v) { return v; }
  static Store store(Acc v) { return v; }
  static Acc round(Acc v) { return materialise(v); }
};

// A 16-bit type computed in float, every product rounded to the stored type (as Megatron's
// elementwise ops in that dtype do).
template <typename S, float (*Widen)(S), S (*Narrow)(float)>
struct Half {
  using Store = S;
  using Acc = float;
  static Acc load(Store v) { return Widen(v); }
  static Store store(Acc v) { return Narrow(v); }
  static Acc round(Acc v) { return Widen(Narrow(v)); }
};

inline float f16_to_float(_Float16 h) { return static_cast<float>(h); }
inline _Float16 float_to_f16(float f) { return static_cast<_Float16>(f); }

using F32 = Native<float>;
using F64 = Native<double>;
using F16 = Half<_Float16, f16_to_float, float_to_f16>;
using BF16 = Half<uint16_t, bf16_to_float, float_to_bf16>;

template <typename D>
void rope_rows(const core::RopeProblem& p, const void* x_, const void* cos_, const void* sin_,
               const int64_t* positions, void* out_) {
  using S = typename D::Store;
  using A = typename D::Acc;
  const S* x = static_cast<const S*>(x_);
  const S* cs = static_cast<const S*>(cos_);
  const S* sn = static_cast<const S*>(sin_);
  S* out = static_cast<S*>(out_);
  const int64_t half = p.dim / 2;
  const auto rnd = [](A v) { return D::round(v); };
  for (int64_t r = 0; r < p.rows; ++r) {
    const S* c = cs + positions[r] * p.dim;
    const S* s = sn + positions[r] * p.dim;
    for (int64_t h = 0; h < p.heads; ++h) {
      const S* xi = x + r * p.row_stride + h * p.head_stride;
      S* oi = out + r * p.out_row_stride + h * p.out_head_stride;
      for (int64_t k = 0; k < half; ++k) {
        int64_t i0, i1, o0, o1;
        core::rope_pair_offsets(p, k, &i0, &i1, &o0, &o1);
        A r0, r1;
        core::rope_pair<A>(p.backward, D::load(xi[i0]), D::load(xi[i1]), D::load(c[k]), D::load(s[k]),
                           D::load(c[k + half]), D::load(s[k + half]), rnd, &r0, &r1);
        oi[o0] = D::store(r0);
        oi[o1] = D::store(r1);
      }
    }
  }
}

}  // namespace

void mla_rope(const core::RopeProblem& p, int dtype, const void* x, const void* cos, const void* sin,
              const int64_t* positions, void* out) {
  switch (dtype) {
    case 0: rope_rows<F32>(p, x, cos, sin, positions, out); break;
    case 1: rope_rows<F64>(p, x, cos, sin, positions, out); break;
    case 2: rope_rows<F16>(p, x, cos, sin, positions, out); break;
    default: rope_rows<BF16>(p, x, cos, sin, positions, out); break;
  }
}

}  // namespace cpu
}  // namespace verl_ops
