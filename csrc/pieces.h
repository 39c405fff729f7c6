// The weights handed to the projection kernels, shared by the CPU and CUDA back ends (plain C++).
#pragma once

#include <cmath>
#include <cstdint>

namespace angpt {

// A contiguous run of `numel` elements of a flattened [rows, cols] weight, starting at element `offset`
// (a distributed-optimizer shard may cut rows anywhere). Its vectors are rows (along_rows) or columns;
// the squared norm and the factor of vector i live at index `region + i` of one float64 buffer.
struct Piece {
  void* data;
  int64_t numel;
  int64_t offset;
  int64_t cols;
  int64_t region;
  int64_t along_rows;
};

// The run of elements [begin, end) of a piece that lies in one row, or in several whole rows.
struct RowSegment {
  int64_t row;    // first row
  int64_t col;    // first column
  int64_t rows;   // number of rows (> 1 only for whole rows)
  int64_t width;  // elements per row
  int64_t start;  // index of its first element within the piece
};

// A piece is at most: a partial first row, a run of whole rows, a partial last row.
// Returns how many of `segments` it filled (at most 3).
inline int split_rows(const Piece& piece, RowSegment segments[3]) {
  int count = 0;
  const int64_t end = piece.offset + piece.numel;
  int64_t position = piece.offset;
  while (position < end) {
    const int64_t row = position / piece.cols, col = position % piece.cols;
    RowSegment segment{row, col, 1, 0, position - piece.offset};
    if (col != 0 || end - position < piece.cols) {
      segment.width = (piece.cols - col < end - position) ? piece.cols - col : end - position;
    } else {
      segment.rows = (end - position) / piece.cols;
      segment.width = piece.cols;
    }
    position += segment.rows * segment.width;
    segments[count++] = segment;
  }
  return count;
}

// What a vector with squared norm `sq_norm` is multiplied by: 1 / max(1, norm) to bound it to the unit
// ball (exactly 1 inside it), or 1 / norm to normalize it.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline double projection_factor(double sq_norm, bool bound) {
  const double norm = sqrt(sq_norm);
  if (bound) return 1.0 / (norm > 1.0 ? norm : 1.0);
  return 1.0 / (norm > 1e-30 ? norm : 1e-30);
}

}  // namespace angpt
