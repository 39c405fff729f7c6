// Element types, conversions and launch helpers shared by the CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace angpt::cuda {

// Accumulation type: fp32, or fp64 for fp64 tensors.
template <typename T>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulate<T>::type;

// Explicit conversions (torch builds CUDA code with the implicit half/bfloat16 conversions disabled).
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }

inline void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string("angpt CUDA kernels: ") + what + ": " + cudaGetErrorString(error));
  }
}

// Calls body(T{}) with the element type T of `dtype`.
template <typename Body>
void dispatch(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kFloat32: return body(float{});
    case DType::kFloat64: return body(double{});
    case DType::kBFloat16: return body(__nv_bfloat16{});
    case DType::kFloat16: return body(__half{});
  }
  throw std::runtime_error("angpt CUDA kernels: unknown dtype");
}

inline int multiprocessors() {
  int device = 0, count = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count;
}

}  // namespace angpt::cuda
