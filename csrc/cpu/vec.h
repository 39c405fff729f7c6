// Loads and stores between a tensor's element type and ATen's vector of its accumulation type
// (float for bf16/fp16/fp32, double for fp64), with masked tails so that every kernel has one code path.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace angpt::cpu {

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;

template <typename scalar_t>
using AccVec = at::vec::Vectorized<acc_t<scalar_t>>;

// `count` <= AccVec::size() elements widened to the accumulation type; lanes past `count` are zero.
template <typename scalar_t>
inline AccVec<scalar_t> load(const scalar_t* p, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    return AccVec<scalar_t>::loadu(p, count);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<scalar_t>::loadu(p, count));
  }
}

// Rounds to the element type once, and writes the first `count` lanes.
template <typename scalar_t>
inline void store(scalar_t* p, const AccVec<scalar_t>& v, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    v.store(p, count);
  } else {
    at::vec::convert<scalar_t>(v).store(p, count);
  }
}

// `count` <= Vectorized<double>::size() elements widened to double (squares of fp32 are exact in it).
template <typename scalar_t>
inline at::vec::Vectorized<double> load_double(const scalar_t* p, int64_t count) {
  using Vec = at::vec::Vectorized<double>;
  if constexpr (std::is_same_v<scalar_t, double>) {
    return Vec::loadu(p, count);
  } else {
    __at_align__ double widened[Vec::size()] = {};
    if (count == Vec::size()) {
      for (int64_t i = 0; i < Vec::size(); ++i) widened[i] = static_cast<double>(p[i]);  // vectorized by the compiler
    } else {
      for (int64_t i = 0; i < count; ++i) widened[i] = static_cast<double>(p[i]);
    }
    return Vec::loadu(widened);
  }
}

}  // namespace angpt::cpu
