// The nu-scaled SwiGLU on CUDA: 16-byte vector loads and stores where the width allows; the backward
// sums the scale gradients over tokens per block in registers and shared memory, then over blocks in a
// fixed order (deterministic).
#include <algorithm>

#include "common.cuh"

namespace angpt::cuda {
namespace {

constexpr int kColumnThreads = 32;  // threads along columns (each V columns wide) in a backward block
constexpr int kRowThreads = 8;      // threads along tokens in a backward block

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& pack) {
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

template <typename T, int V>
__global__ void forward_kernel(const T* __restrict__ uz, const acc_t<T>* __restrict__ s_u,
                               const acc_t<T>* __restrict__ s_v, acc_t<T> input_factor, acc_t<T> output_factor,
                               T* __restrict__ out, int64_t tokens, int64_t f) {
  using acc = acc_t<T>;
  const int64_t packs_per_row = f / V, total = tokens * packs_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / packs_per_row, c = (i % packs_per_row) * V;
    const Pack<T, V> u = load<T, V>(uz + t * 2 * f + c), z = load<T, V>(uz + t * 2 * f + f + c);
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const acc scaled_u = input_factor * s_u[c + k] * to_acc(u.v[k]);
      const acc scaled_z = input_factor * s_v[c + k] * to_acc(z.v[k]);
      const acc silu = scaled_z / (acc(1) + exp(-scaled_z));
      o.v[k] = from_acc<T>(scaled_u * silu * output_factor);
    }
    store<T, V>(out + t * f + c, o);
  }
}

// Writes the input gradient and, per block row, the partial scale gradients partial[blockIdx.y][2f].
template <typename T, int V>
__global__ void backward_kernel(const T* __restrict__ grad, const T* __restrict__ uz, const acc_t<T>* __restrict__ s_u,
                                const acc_t<T>* __restrict__ s_v, acc_t<T> input_factor, acc_t<T> output_factor,
                                T* __restrict__ grad_uz, acc_t<T>* __restrict__ partial, int64_t tokens, int64_t f) {
  using acc = acc_t<T>;
  __shared__ acc sums[2][kRowThreads][kColumnThreads * V];
  const int64_t c = (blockIdx.x * static_cast<int64_t>(kColumnThreads) + threadIdx.x) * V;
  acc sum_u[V] = {}, sum_z[V] = {};
  if (c < f) {
    acc a_u[V], a_z[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      a_u[k] = input_factor * s_u[c + k];
      a_z[k] = input_factor * s_v[c + k];
    }
    for (int64_t t = blockIdx.y * static_cast<int64_t>(kRowThreads) + threadIdx.y; t < tokens;
         t += static_cast<int64_t>(gridDim.y) * kRowThreads) {
      const Pack<T, V> g = load<T, V>(grad + t * f + c);
      const Pack<T, V> u = load<T, V>(uz + t * 2 * f + c), z = load<T, V>(uz + t * 2 * f + f + c);
      Pack<T, V> du, dz;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const acc u_k = to_acc(u.v[k]), z_k = to_acc(z.v[k]), g_k = to_acc(g.v[k]) * output_factor;
        const acc scaled_u = a_u[k] * u_k, scaled_z = a_z[k] * z_k;
        const acc sigmoid = acc(1) / (acc(1) + exp(-scaled_z));
        const acc d_scaled_u = g_k * scaled_z * sigmoid;
        const acc d_scaled_z = g_k * scaled_u * sigmoid * (acc(1) + scaled_z * (acc(1) - sigmoid));
        du.v[k] = from_acc<T>(d_scaled_u * a_u[k]);
        dz.v[k] = from_acc<T>(d_scaled_z * a_z[k]);
        sum_u[k] += d_scaled_u * u_k;
        sum_z[k] += d_scaled_z * z_k;
      }
      store<T, V>(grad_uz + t * 2 * f + c, du);
      store<T, V>(grad_uz + t * 2 * f + f + c, dz);
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sums[0][threadIdx.y][threadIdx.x * V + k] = sum_u[k];
    sums[1][threadIdx.y][threadIdx.x * V + k] = sum_z[k];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c < f) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc total_u = 0, total_z = 0;
      for (int y = 0; y < kRowThreads; ++y) {
        total_u += sums[0][y][threadIdx.x * V + k];
        total_z += sums[1][y][threadIdx.x * V + k];
      }
      partial[blockIdx.y * 2 * f + c + k] = total_u;
      partial[blockIdx.y * 2 * f + f + c + k] = total_z;
    }
  }
}

// grad_s[c] = input_factor * sum over block rows of partial[row][c], rows in order.
template <typename acc>
__global__ void sum_partials_kernel(const acc* __restrict__ partial, int64_t rows, int64_t f, acc input_factor,
                                    acc* __restrict__ grad_s_u, acc* __restrict__ grad_s_v) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < 2 * f;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc total = 0;
    for (int64_t row = 0; row < rows; ++row) total += partial[row * 2 * f + c];
    (c < f ? grad_s_u[c] : grad_s_v[c - f]) = input_factor * total;
  }
}

// The backward's grid for packs `width` elements wide: column blocks, and block rows, enough to fill the GPU,
// each summing many tokens (0 without tokens); the partial sums have max(rows, 1) rows.
struct BackwardGrid {
  int64_t columns, rows;
};

BackwardGrid backward_grid(int64_t tokens, int64_t f, int width) {
  // At least one column block: the workspace is sized for the widest packs, which may exceed f.
  const int64_t columns = std::max<int64_t>(1, (f / width + kColumnThreads - 1) / kColumnThreads);
  const int64_t wanted_rows = std::max<int64_t>(1, 8L * multiprocessors() / columns);
  return {columns, std::min<int64_t>({wanted_rows, (tokens + kRowThreads - 1) / kRowThreads, 65535L})};
}

// Elements per 16-byte pack when every row start is 16-byte aligned, else 1.
template <typename T>
int pack_width(int64_t f, std::initializer_list<const void*> pointers) {
  constexpr int wide = 16 / sizeof(T);
  if (f % wide != 0) return 1;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return wide;
}

}  // namespace

void swiglu_forward(DType dtype, const void* uz, const void* s_u, const void* s_v, double input_factor,
                    double output_factor, void* out, int64_t tokens, int64_t f, void* stream) {
  if (tokens == 0 || f == 0) return;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using acc = acc_t<T>;
    const auto launch = [&](auto kernel, int width) {
      const int threads = 256;
      const int64_t packs = tokens * f / width;
      const int blocks = static_cast<int>(std::min<int64_t>((packs + threads - 1) / threads, 32L * multiprocessors()));
      kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(uz), static_cast<const acc*>(s_u), static_cast<const acc*>(s_v),
          static_cast<acc>(input_factor), static_cast<acc>(output_factor), static_cast<T*>(out), tokens, f);
    };
    constexpr int wide = 16 / sizeof(T);
    if (pack_width<T>(f, {uz, out}) == wide) {
      launch(forward_kernel<T, wide>, wide);
    } else {
      launch(forward_kernel<T, 1>, 1);
    }
    check(cudaGetLastError(), "swiglu forward");
  });
}

int64_t swiglu_backward_workspace_bytes(DType dtype, int64_t tokens, int64_t f) {
  if (f == 0) return 0;
  int64_t bytes = 0;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    // The widest packs have the fewest column blocks, so the most block rows.
    const BackwardGrid grid = backward_grid(tokens, f, 16 / sizeof(T));
    bytes = std::max<int64_t>(grid.rows, 1) * 2 * f * static_cast<int64_t>(sizeof(acc_t<T>));
  });
  return bytes;
}

void swiglu_backward(DType dtype, const void* grad_out, const void* uz, const void* s_u, const void* s_v,
                     double input_factor, double output_factor, void* grad_uz, void* grad_s_u, void* grad_s_v,
                     int64_t tokens, int64_t f, void* workspace, int64_t workspace_bytes, void* stream) {
  if (f == 0) return;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using acc = acc_t<T>;
    const auto launch = [&](auto kernel, int width) {
      const dim3 threads(kColumnThreads, kRowThreads);
      const BackwardGrid grid = backward_grid(tokens, f, width);
      const int64_t partial_rows = std::max<int64_t>(grid.rows, 1);
      if (workspace_bytes < partial_rows * 2 * f * static_cast<int64_t>(sizeof(acc))) {
        throw std::runtime_error("angpt CUDA kernels: swiglu backward: workspace too small");
      }
      acc* partial = static_cast<acc*>(workspace);
      if (tokens > 0) {
        kernel<<<dim3(grid.columns, grid.rows), threads, 0, cuda_stream>>>(
            static_cast<const T*>(grad_out), static_cast<const T*>(uz), static_cast<const acc*>(s_u),
            static_cast<const acc*>(s_v), static_cast<acc>(input_factor), static_cast<acc>(output_factor),
            static_cast<T*>(grad_uz), partial, tokens, f);
      } else {
        check(cudaMemsetAsync(partial, 0, 2 * f * sizeof(acc), cuda_stream), "cudaMemsetAsync");
      }
      const int sum_blocks = static_cast<int>(std::min<int64_t>((2 * f + 255) / 256, 4096));
      sum_partials_kernel<acc><<<sum_blocks, 256, 0, cuda_stream>>>(partial, partial_rows, f,
                                                                     static_cast<acc>(input_factor),
                                                                     static_cast<acc*>(grad_s_u),
                                                                     static_cast<acc*>(grad_s_v));
    };
    constexpr int wide = 16 / sizeof(T);
    if (pack_width<T>(f, {grad_out, uz, grad_uz}) == wide) {
      launch(backward_kernel<T, wide>, wide);
    } else {
      launch(backward_kernel<T, 1>, 1);
    }
    check(cudaGetLastError(), "swiglu backward");
  });
}

}  // namespace angpt::cuda
