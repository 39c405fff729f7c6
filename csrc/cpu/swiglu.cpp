// The nu-scaled SwiGLU on the CPU: one read of [u; z] and one write of the activation forward; one read of
// [u; z] and the output gradient and one write of the input gradient backward.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace angpt::cpu {
namespace {

// Rows per parallel task: about 32K elements, so that threads are not woken for tiny inputs.
int64_t grain(int64_t f) { return std::max<int64_t>(1, 32768 / f); }

// input_factor * s (per column), once for all tokens.
template <typename acc>
std::vector<acc> column_scales(const at::Tensor& s, double input_factor) {
  const acc* data = s.data_ptr<acc>();
  std::vector<acc> scaled(s.numel());
  for (int64_t c = 0; c < s.numel(); ++c) scaled[c] = static_cast<acc>(input_factor) * data[c];
  return scaled;
}

template <typename scalar_t>
void forward(const at::Tensor& uz_t, const at::Tensor& s_u, const at::Tensor& s_v, double input_factor,
             double output_factor, at::Tensor& out_t) {
  using acc = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  const int64_t f = s_u.numel(), tokens = f ? out_t.numel() / f : 0;
  const std::vector<acc> a_u = column_scales<acc>(s_u, input_factor), a_z = column_scales<acc>(s_v, input_factor);
  const scalar_t* uz = uz_t.data_ptr<scalar_t>();
  scalar_t* out = out_t.data_ptr<scalar_t>();
  const Vec one(1), k_out(static_cast<acc>(output_factor));
  at::parallel_for(0, tokens, grain(f), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* u = uz + t * 2 * f;
      const scalar_t* z = u + f;
      scalar_t* o = out + t * f;
      for (int64_t c = 0; c < f; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), f - c);
        const Vec scaled_u = Vec::loadu(a_u.data() + c, n) * load(u + c, n);
        const Vec scaled_z = Vec::loadu(a_z.data() + c, n) * load(z + c, n);
        const Vec silu = scaled_z / (one + scaled_z.neg().exp());
        store(o + c, scaled_u * silu * k_out, n);
      }
    }
  });
}

template <typename scalar_t>
void backward(const at::Tensor& grad_t, const at::Tensor& uz_t, const at::Tensor& s_u, const at::Tensor& s_v,
              double input_factor, double output_factor, at::Tensor& grad_uz_t, at::Tensor& grad_s_u,
              at::Tensor& grad_s_v) {
  using acc = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  const int64_t f = s_u.numel(), tokens = f ? grad_t.numel() / f : 0;
  const std::vector<acc> a_u = column_scales<acc>(s_u, input_factor), a_z = column_scales<acc>(s_v, input_factor);
  const scalar_t* uz = uz_t.data_ptr<scalar_t>();
  const scalar_t* grad = grad_t.data_ptr<scalar_t>();
  scalar_t* grad_uz = grad_uz_t.data_ptr<scalar_t>();
  // Per thread: the scale gradients of the tokens so far [sum over u columns; over z columns], and of the
  // current block of tokens; summing in blocks keeps fp32 round-off of long token runs small.
  constexpr int64_t kBlock = 64;
  const int64_t threads = at::get_num_threads();
  std::vector<acc> totals(threads * 2 * f, acc(0)), blocks(threads * 2 * f, acc(0));
  const Vec one(1), k_out(static_cast<acc>(output_factor));
  at::parallel_for(0, tokens, grain(f), [&](int64_t begin, int64_t end) {
    acc* total = totals.data() + at::get_thread_num() * 2 * f;
    acc* block = blocks.data() + at::get_thread_num() * 2 * f;
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* u = uz + t * 2 * f;
      const scalar_t* z = u + f;
      const scalar_t* g = grad + t * f;
      scalar_t* du = grad_uz + t * 2 * f;
      scalar_t* dz = du + f;
      for (int64_t c = 0; c < f; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), f - c);
        const Vec a_u_c = Vec::loadu(a_u.data() + c, n), a_z_c = Vec::loadu(a_z.data() + c, n);
        const Vec u_c = load(u + c, n), z_c = load(z + c, n);
        const Vec scaled_u = a_u_c * u_c, scaled_z = a_z_c * z_c;
        const Vec sigmoid = one / (one + scaled_z.neg().exp());
        const Vec g_c = load(g + c, n) * k_out;
        // d/du: g SiLU(z'); d/dz': g u' sigmoid(z') (1 + z' (1 - sigmoid(z'))).
        const Vec d_scaled_u = g_c * (scaled_z * sigmoid);
        const Vec d_scaled_z = g_c * scaled_u * sigmoid * (one + scaled_z * (one - sigmoid));
        store(du + c, d_scaled_u * a_u_c, n);
        store(dz + c, d_scaled_z * a_z_c, n);
        at::vec::fmadd(d_scaled_u, u_c, Vec::loadu(block + c, n)).store(block + c, n);
        at::vec::fmadd(d_scaled_z, z_c, Vec::loadu(block + f + c, n)).store(block + f + c, n);
      }
      if ((t - begin + 1) % kBlock == 0 || t + 1 == end) {
        for (int64_t c = 0; c < 2 * f; ++c) {
          total[c] += block[c];
          block[c] = acc(0);
        }
      }
    }
  });
  // d/ds = input_factor * sum over tokens of (d/d(scaled)) * (unscaled); threads in a fixed order.
  acc* d_s_u = grad_s_u.data_ptr<acc>();
  acc* d_s_v = grad_s_v.data_ptr<acc>();
  for (int64_t c = 0; c < f; ++c) {
    acc sum_u = 0, sum_z = 0;
    for (int64_t thread = 0; thread < threads; ++thread) {
      sum_u += totals[thread * 2 * f + c];
      sum_z += totals[thread * 2 * f + f + c];
    }
    d_s_u[c] = static_cast<acc>(input_factor) * sum_u;
    d_s_v[c] = static_cast<acc>(input_factor) * sum_z;
  }
}

}  // namespace

void swiglu_forward(const at::Tensor& uz, const at::Tensor& s_u, const at::Tensor& s_v, double input_factor,
                    double output_factor, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, uz.scalar_type(), "angpt_swiglu_forward", [&] {
    forward<scalar_t>(uz, s_u, s_v, input_factor, output_factor, out);
  });
}

void swiglu_backward(const at::Tensor& grad_out, const at::Tensor& uz, const at::Tensor& s_u, const at::Tensor& s_v,
                     double input_factor, double output_factor, at::Tensor& grad_uz, at::Tensor& grad_s_u,
                     at::Tensor& grad_s_v) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, uz.scalar_type(), "angpt_swiglu_backward", [&] {
    backward<scalar_t>(grad_out, uz, s_u, s_v, input_factor, output_factor, grad_uz, grad_s_u, grad_s_v);
  });
}

}  // namespace angpt::cpu
