// The bounded-weight projection on CUDA: every piece of every weight in one launch per phase (a table of
// pieces and, per piece, the index of its first block; each block finds its piece by binary search).
// Blocks are 32 x 8 threads: a warp per row for vectors along rows, a 32-column tile for vectors along
// columns, 2048 elements for scaling. Loads are coalesced across each warp.
#include <algorithm>
#include <vector>

#include "common.cuh"

namespace angpt::cuda {
namespace {

constexpr int kWarps = 8;                       // warps (rows) per block, and row threads of a column tile
constexpr int kTile = 32;                       // columns per column tile
constexpr int kScaleElements = 256 * 8;         // elements per block when scaling
constexpr unsigned kFullMask = 0xffffffffu;

__device__ int64_t find_piece(const int64_t* first_block, int64_t count, int64_t block) {
  int64_t low = 0, high = count;  // first_block[low] <= block < first_block[high]
  while (high - low > 1) {
    const int64_t middle = (low + high) / 2;
    (first_block[middle] <= block ? low : high) = middle;
  }
  return low;
}

__device__ __forceinline__ int64_t first_row(const Piece& piece) { return piece.offset / piece.cols; }
__device__ __forceinline__ int64_t last_row(const Piece& piece) {
  return (piece.offset + piece.numel - 1) / piece.cols;
}

// The factor rounded to the element type as PyTorch's `factor.to(dtype)` (bf16 and fp16 through fp32).
template <typename T>
__device__ __forceinline__ T round_factor(double factor) {
  return from_acc<T>(static_cast<acc_t<T>>(factor));
}

// Sum of squares of x[0, n) in double by one warp; every lane gets it.
template <typename T>
__device__ double warp_sq_sum(const T* x, int64_t n) {
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += 32) {
    const double v = to_acc(x[i]);
    sum += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  return sum;
}

template <typename T>
__device__ void warp_scale(T* x, int64_t n, double factor) {
  const T rounded = round_factor<T>(factor);
  if (to_acc(rounded) == acc_t<T>(1)) return;
  for (int64_t i = threadIdx.x; i < n; i += 32) x[i] = from_acc<T>(to_acc(x[i]) * to_acc(rounded));
}

// The elements of row `row` that the piece holds: (pointer, count).
template <typename T>
__device__ __forceinline__ T* row_part(const Piece& piece, int64_t row, int64_t& count) {
  const int64_t begin = max(piece.offset, row * piece.cols);
  const int64_t end = min(piece.offset + piece.numel, (row + 1) * piece.cols);
  count = end - begin;
  return static_cast<T*>(piece.data) + (begin - piece.offset);
}

// Sums over the piece's elements in columns [tile, tile + kTile) of x^2, per column, into column_sums
// (shared, kTile wide); the column of this thread is tile + threadIdx.x.
template <typename T>
__device__ void column_tile_sums(const Piece& piece, int64_t tile, double* column_sums) {
  __shared__ double partial[kWarps][kTile];
  const int64_t c = tile + threadIdx.x;
  double sum = 0;
  if (c < piece.cols) {
    for (int64_t row = first_row(piece) + threadIdx.y; row <= last_row(piece); row += kWarps) {
      const int64_t flat = row * piece.cols + c;
      if (flat >= piece.offset && flat < piece.offset + piece.numel) {
        const double v = to_acc(static_cast<const T*>(piece.data)[flat - piece.offset]);
        sum += v * v;
      }
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0) {
    double total = 0;
    for (int y = 0; y < kWarps; ++y) total += partial[y][threadIdx.x];
    column_sums[threadIdx.x] = total;
  }
  __syncthreads();
}

template <typename T>
__global__ void accumulate_kernel(const Piece* pieces, const int64_t* first_block, int64_t count, double* sums) {
  const int64_t p = find_piece(first_block, count, blockIdx.x);
  const Piece piece = pieces[p];
  const int64_t block = blockIdx.x - first_block[p];
  if (piece.along_rows) {
    const int64_t row = first_row(piece) + block * kWarps + threadIdx.y;
    if (row > last_row(piece)) return;
    int64_t n = 0;
    const T* x = row_part<T>(piece, row, n);
    const double sum = warp_sq_sum(x, n);
    if (threadIdx.x == 0) atomicAdd(sums + piece.region + row, sum);
  } else {
    __shared__ double column_sums[kTile];
    const int64_t tile = block * kTile;
    column_tile_sums<T>(piece, tile, column_sums);
    if (threadIdx.y == 0 && tile + threadIdx.x < piece.cols) {
      atomicAdd(sums + piece.region + tile + threadIdx.x, column_sums[threadIdx.x]);
    }
  }
}

template <typename T>
__global__ void scale_kernel(const Piece* pieces, const int64_t* first_block, int64_t count, const double* factors) {
  const int64_t p = find_piece(first_block, count, blockIdx.x);
  const Piece piece = pieces[p];
  T* x = static_cast<T*>(piece.data);
  const int64_t begin = (blockIdx.x - first_block[p]) * kScaleElements;
  const int64_t end = min(begin + kScaleElements, piece.numel);
  for (int64_t i = begin + threadIdx.y * 32 + threadIdx.x; i < end; i += 256) {
    const int64_t flat = piece.offset + i;
    const int64_t vector = piece.along_rows ? flat / piece.cols : flat % piece.cols;
    const T factor = round_factor<T>(factors[piece.region + vector]);
    if (to_acc(factor) != acc_t<T>(1)) x[i] = from_acc<T>(to_acc(x[i]) * to_acc(factor));
  }
}

template <typename T>
__global__ void project_whole_kernel(const Piece* pieces, const int64_t* first_block, int64_t count, bool bound) {
  const int64_t p = find_piece(first_block, count, blockIdx.x);
  const Piece piece = pieces[p];
  const int64_t block = blockIdx.x - first_block[p];
  T* x = static_cast<T*>(piece.data);
  if (piece.along_rows) {
    // A warp sums its row, then scales it (from cache).
    const int64_t row = block * kWarps + threadIdx.y;
    if (row > last_row(piece)) return;
    T* row_data = x + row * piece.cols;
    warp_scale(row_data, piece.cols, projection_factor(warp_sq_sum(row_data, piece.cols), bound));
  } else {
    __shared__ double column_sums[kTile];
    const int64_t tile = block * kTile, c = tile + threadIdx.x;
    column_tile_sums<T>(piece, tile, column_sums);
    if (c >= piece.cols) return;
    const T factor = round_factor<T>(projection_factor(column_sums[threadIdx.x], bound));
    if (to_acc(factor) == acc_t<T>(1)) return;
    for (int64_t row = threadIdx.y; row <= last_row(piece); row += kWarps) {
      x[row * piece.cols + c] = from_acc<T>(to_acc(x[row * piece.cols + c]) * to_acc(factor));
    }
  }
}

// Blocks a piece needs in the two-phase sums and the one-pass projection: 8 rows or 32 columns each.
int64_t vector_blocks(const Piece& piece) {
  if (!piece.along_rows) return (piece.cols + kTile - 1) / kTile;
  const int64_t rows = (piece.offset + piece.numel - 1) / piece.cols - piece.offset / piece.cols + 1;
  return (rows + kWarps - 1) / kWarps;
}

int64_t scale_blocks(const Piece& piece) { return (piece.numel + kScaleElements - 1) / kScaleElements; }

// Copies the pieces and their first-block indices to the device, launches `launch(pieces, first_block,
// blocks)` on `stream` and frees the table after it (stream-ordered).
template <typename BlocksOf, typename Launch>
void launch_over_pieces(const Piece* host, int64_t count, cudaStream_t stream, BlocksOf blocks_of, Launch launch) {
  std::vector<Piece> pieces;
  std::vector<int64_t> first_block{0};
  for (int64_t i = 0; i < count; ++i) {
    if (host[i].numel == 0) continue;
    pieces.push_back(host[i]);
    first_block.push_back(first_block.back() + blocks_of(host[i]));
  }
  if (pieces.empty()) return;
  const size_t piece_bytes = pieces.size() * sizeof(Piece), index_bytes = first_block.size() * sizeof(int64_t);
  std::vector<char> table(piece_bytes + index_bytes);
  std::copy_n(reinterpret_cast<const char*>(pieces.data()), piece_bytes, table.data());
  std::copy_n(reinterpret_cast<const char*>(first_block.data()), index_bytes, table.data() + piece_bytes);
  char* device_table = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&device_table), table.size(), stream), "cudaMallocAsync");
  // From pageable memory the copy is staged before it returns, so `table` may go out of scope.
  check(cudaMemcpyAsync(device_table, table.data(), table.size(), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  launch(reinterpret_cast<const Piece*>(device_table), reinterpret_cast<const int64_t*>(device_table + piece_bytes),
         static_cast<int64_t>(pieces.size()), static_cast<unsigned>(first_block.back()));
  check(cudaGetLastError(), "projection kernel");
  check(cudaFreeAsync(device_table, stream), "cudaFreeAsync");
}

const dim3 kBlock(32, kWarps);

}  // namespace

void accumulate_sq_norms(DType dtype, const Piece* pieces, int64_t count, double* sums, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_over_pieces(pieces, count, cuda_stream, vector_blocks, [&](auto table, auto first, auto n, unsigned blocks) {
      accumulate_kernel<T><<<blocks, kBlock, 0, cuda_stream>>>(table, first, n, sums);
    });
  });
}

void scale(DType dtype, const Piece* pieces, int64_t count, const double* factors, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_over_pieces(pieces, count, cuda_stream, scale_blocks, [&](auto table, auto first, auto n, unsigned blocks) {
      scale_kernel<T><<<blocks, kBlock, 0, cuda_stream>>>(table, first, n, factors);
    });
  });
}

void project_whole(DType dtype, const Piece* pieces, int64_t count, bool bound, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_over_pieces(pieces, count, cuda_stream, vector_blocks, [&](auto table, auto first, auto n, unsigned blocks) {
      project_whole_kernel<T><<<blocks, kBlock, 0, cuda_stream>>>(table, first, n, bound);
    });
  });
}

}  // namespace angpt::cuda
