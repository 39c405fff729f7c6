// The bounded-weight projection on the CPU: every piece of every weight in one parallel loop.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <map>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace angpt::cpu {
namespace {

using DoubleVec = at::vec::Vectorized<double>;

constexpr int64_t kTaskElements = 1 << 15;  // about 128 KB of fp32 per parallel task
constexpr int64_t kColumnTile = 256;         // columns whose sums one task keeps (vectors along columns)

// A run of rows of one segment of one piece: the unit of parallel work.
struct Task {
  const Piece* piece;
  RowSegment segment;
};

// Splits a segment into tasks of about kTaskElements each.
void add_tasks(std::vector<Task>& tasks, const Piece& piece, const RowSegment& segment) {
  const int64_t rows_per_task = std::max<int64_t>(1, kTaskElements / segment.width);
  for (int64_t first = 0; first < segment.rows; first += rows_per_task) {
    RowSegment part = segment;
    part.row = segment.row + first;
    part.rows = std::min(rows_per_task, segment.rows - first);
    part.start = segment.start + first * segment.width;
    tasks.push_back({&piece, part});
  }
}

void run_tasks(const std::vector<Task>& tasks, const std::function<void(const Task&)>& body) {
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(tasks[i]);
  });
}

template <typename scalar_t>
scalar_t* elements(const Task& task, int64_t row) {
  return static_cast<scalar_t*>(task.piece->data) + task.segment.start + (row - task.segment.row) * task.segment.width;
}

bool is_whole_row(const RowSegment& segment, const Piece& piece) { return segment.width == piece.cols; }

// Sum of squares of n elements in double, always in the same order, so that a whole row gets the same
// sum in the one-pass and the two-phase paths.
template <typename scalar_t>
double sq_sum(const scalar_t* x, int64_t n) {
  constexpr int64_t W = DoubleVec::size();
  DoubleVec acc[4] = {DoubleVec(0), DoubleVec(0), DoubleVec(0), DoubleVec(0)};  // independent FMA chains
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    for (int k = 0; k < 4; ++k) {
      const DoubleVec v = load_double(x + i + k * W, W);
      acc[k] = at::vec::fmadd(v, v, acc[k]);
    }
  }
  for (; i < n; i += W) {
    const DoubleVec v = load_double(x + i, std::min(W, n - i));
    acc[0] = at::vec::fmadd(v, v, acc[0]);
  }
  __at_align__ double lanes[W];
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
  double sum = 0;
  for (int64_t k = 0; k < W; ++k) sum += lanes[k];
  return sum;
}

// sums[i] += x[i]^2 for n consecutive columns.
template <typename scalar_t>
void add_squares(const scalar_t* x, int64_t n, double* sums) {
  constexpr int64_t W = DoubleVec::size();
  for (int64_t i = 0; i < n; i += W) {
    const int64_t count = std::min(W, n - i);
    const DoubleVec v = load_double(x + i, count);
    at::vec::fmadd(v, v, DoubleVec::loadu(sums + i, count)).store(sums + i, count);
  }
}

// x *= factor rounded to the element type (as PyTorch's `x.mul_(factor.to(x.dtype))`); exactly 1 writes nothing.
template <typename scalar_t>
void scale_run(scalar_t* x, int64_t n, double factor) {
  using Vec = AccVec<scalar_t>;
  const auto rounded = static_cast<acc_t<scalar_t>>(static_cast<scalar_t>(factor));
  if (rounded == acc_t<scalar_t>(1)) return;
  const Vec factor_vec(rounded);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    store(x + i, load(x + i, count) * factor_vec, count);
  }
}

// x[i] *= factors[i] rounded to the element type, for n consecutive columns.
template <typename scalar_t>
void scale_columns(scalar_t* x, int64_t n, const double* factors) {
  using acc = acc_t<scalar_t>;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<scalar_t>(static_cast<acc>(x[i]) * static_cast<acc>(static_cast<scalar_t>(factors[i])));
  }
}

// Adds the squares of the elements of `task` in columns [first, last) to sums[c - first].
template <typename scalar_t>
void add_column_squares(const Task& task, int64_t first, int64_t last, double* sums) {
  const RowSegment& s = task.segment;
  const int64_t begin = std::max(first, s.col), end = std::min(last, s.col + s.width);
  for (int64_t row = s.row; row < s.row + s.rows && begin < end; ++row) {
    add_squares(elements<scalar_t>(task, row) + (begin - s.col), end - begin, sums + (begin - first));
  }
}

// Tasks over column tiles of one weight (the pieces sharing one region): one task owns its columns' sums.
struct ColumnTile {
  std::vector<Task> parts;  // every segment of the weight's pieces, in order
  int64_t region, first, last;
};

std::vector<ColumnTile> column_tiles(const std::vector<Piece>& pieces) {
  std::map<int64_t, std::vector<Task>> by_region;
  std::map<int64_t, int64_t> cols;
  for (const Piece& piece : pieces) {
    if (piece.along_rows) continue;
    RowSegment segments[3];
    const int count = split_rows(piece, segments);
    for (int i = 0; i < count; ++i) by_region[piece.region].push_back({&piece, segments[i]});
    cols[piece.region] = piece.cols;
  }
  std::vector<ColumnTile> tiles;
  for (auto& [region, parts] : by_region) {
    for (int64_t first = 0; first < cols[region]; first += kColumnTile) {
      tiles.push_back({parts, region, first, std::min(first + kColumnTile, cols[region])});
    }
  }
  return tiles;
}

template <typename scalar_t>
void accumulate_impl(const std::vector<Piece>& pieces, double* sums) {
  // Vectors along rows: a whole row lies in one piece, so its sum has one writer; rows that pieces cut
  // are summed afterwards, in piece order.
  std::vector<Task> whole, cut;
  for (const Piece& piece : pieces) {
    if (!piece.along_rows) continue;
    RowSegment segments[3];
    const int count = split_rows(piece, segments);
    for (int i = 0; i < count; ++i) {
      if (is_whole_row(segments[i], piece)) {
        add_tasks(whole, piece, segments[i]);
      } else {
        cut.push_back({&piece, segments[i]});
      }
    }
  }
  const auto add_row_sums = [&](const Task& task) {
    for (int64_t row = task.segment.row; row < task.segment.row + task.segment.rows; ++row) {
      sums[task.piece->region + row] += sq_sum(elements<scalar_t>(task, row), task.segment.width);
    }
  };
  run_tasks(whole, add_row_sums);
  for (const Task& task : cut) add_row_sums(task);

  const std::vector<ColumnTile> tiles = column_tiles(pieces);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const ColumnTile& tile = tiles[i];
      double* tile_sums = sums + tile.region + tile.first;
      std::vector<double> partial(tile.last - tile.first, 0.0);
      for (const Task& part : tile.parts) add_column_squares<scalar_t>(part, tile.first, tile.last, partial.data());
      for (int64_t c = 0; c < tile.last - tile.first; ++c) tile_sums[c] += partial[c];
    }
  });
}

template <typename scalar_t>
void scale_impl(const std::vector<Piece>& pieces, const double* factors) {
  std::vector<Task> tasks;
  for (const Piece& piece : pieces) {
    RowSegment segments[3];
    const int count = split_rows(piece, segments);
    for (int i = 0; i < count; ++i) add_tasks(tasks, piece, segments[i]);
  }
  run_tasks(tasks, [&](const Task& task) {
    const Piece& piece = *task.piece;
    const RowSegment& s = task.segment;
    for (int64_t row = s.row; row < s.row + s.rows; ++row) {
      if (piece.along_rows) {
        scale_run(elements<scalar_t>(task, row), s.width, factors[piece.region + row]);
      } else {
        scale_columns(elements<scalar_t>(task, row), s.width, factors + piece.region + s.col);
      }
    }
  });
}

template <typename scalar_t>
void project_whole_impl(const std::vector<Piece>& pieces, bool bound) {
  // Vectors along rows: each row is summed and scaled while it is in cache.
  std::vector<Task> row_tasks;
  std::vector<Piece> column_pieces;
  for (const Piece& piece : pieces) {
    if (piece.along_rows) {
      add_tasks(row_tasks, piece, {0, 0, piece.numel / piece.cols, piece.cols, 0});
    } else {
      column_pieces.push_back(piece);
      column_pieces.back().region = column_pieces.size();  // whole weights: one region (group) each
    }
  }
  run_tasks(row_tasks, [&](const Task& task) {
    for (int64_t row = task.segment.row; row < task.segment.row + task.segment.rows; ++row) {
      scalar_t* x = elements<scalar_t>(task, row);
      scale_run(x, task.segment.width, projection_factor(sq_sum(x, task.segment.width), bound));
    }
  });
  // Vectors along columns: a tile of columns is summed over all rows, then scaled (from cache).
  const std::vector<ColumnTile> tiles = column_tiles(column_pieces);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const ColumnTile& tile = tiles[i];
      std::vector<double> factors(tile.last - tile.first, 0.0);
      for (const Task& part : tile.parts) add_column_squares<scalar_t>(part, tile.first, tile.last, factors.data());
      for (double& factor : factors) factor = projection_factor(factor, bound);
      for (const Task& part : tile.parts) {
        for (int64_t row = part.segment.row; row < part.segment.row + part.segment.rows; ++row) {
          scale_columns(elements<scalar_t>(part, row) + tile.first, tile.last - tile.first, factors.data());
        }
      }
    }
  });
}

#define ANGPT_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

}  // namespace

void accumulate_sq_norms(const std::vector<Piece>& pieces, at::ScalarType dtype, double* sums) {
  ANGPT_DISPATCH(dtype, "angpt_accumulate_sq_norms", [&] { accumulate_impl<scalar_t>(pieces, sums); });
}

void scale(const std::vector<Piece>& pieces, at::ScalarType dtype, const double* factors) {
  ANGPT_DISPATCH(dtype, "angpt_scale", [&] { scale_impl<scalar_t>(pieces, factors); });
}

void project_whole(const std::vector<Piece>& pieces, at::ScalarType dtype, bool bound) {
  ANGPT_DISPATCH(dtype, "angpt_project_whole", [&] { project_whole_impl<scalar_t>(pieces, bound); });
}

}  // namespace angpt::cpu
