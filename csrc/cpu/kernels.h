// The CPU kernels (ATen parallel_for over threads, at::vec vectors within a thread).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "../pieces.h"

namespace angpt::cpu {

// out = output_factor * (input_factor s_u u) * SiLU(input_factor s_v z) for uz = [u; z] along the last dim.
void swiglu_forward(const at::Tensor& uz, const at::Tensor& s_u, const at::Tensor& s_v, double input_factor,
                    double output_factor, at::Tensor& out);

// The gradients of uz, s_u and s_v (summed over tokens in the accumulation type); SiLU is recomputed.
void swiglu_backward(const at::Tensor& grad_out, const at::Tensor& uz, const at::Tensor& s_u, const at::Tensor& s_v,
                     double input_factor, double output_factor, at::Tensor& grad_uz, at::Tensor& grad_s_u,
                     at::Tensor& grad_s_v);

// Adds each piece's partial squared vector norms to `sums` (float64), deterministically.
void accumulate_sq_norms(const std::vector<Piece>& pieces, at::ScalarType dtype, double* sums);

// Multiplies each vector of each piece by its factor in `factors` (float64, rounded to the element type
// first, as PyTorch would); vectors whose factor is exactly 1 are not written.
void scale(const std::vector<Piece>& pieces, at::ScalarType dtype, const double* factors);

// Bounds (or normalizes) every vector of whole weights in one pass over each.
void project_whole(const std::vector<Piece>& pieces, at::ScalarType dtype, bool bound);

}  // namespace angpt::cpu
