// Launchers of the CUDA kernels. Plain C++ (raw pointers, sizes, a stream) so that the .cu files compile
// with nvcc alone, and the torch-facing code, which needs no CUDA headers, calls them.
#pragma once

#include <cstdint>

#include "../pieces.h"

namespace angpt::cuda {

enum class DType : int { kFloat32, kFloat64, kBFloat16, kFloat16 };

// `stream` is a cudaStream_t. Scales and their gradients are in the accumulation type (fp64 for fp64
// inputs, fp32 otherwise); `tokens` rows of [u; z] (2f wide) give `tokens` rows of f outputs.
void swiglu_forward(DType dtype, const void* uz, const void* s_u, const void* s_v, double input_factor,
                    double output_factor, void* out, int64_t tokens, int64_t f, void* stream);

// The backward sums the scale gradients over tokens through a device workspace of at least
// swiglu_backward_workspace_bytes bytes, which the caller allocates (torch's caching allocator, on `stream`)
// so that no allocation happens here and the backward can be captured in a CUDA graph.
int64_t swiglu_backward_workspace_bytes(DType dtype, int64_t tokens, int64_t f);

void swiglu_backward(DType dtype, const void* grad_out, const void* uz, const void* s_u, const void* s_v,
                     double input_factor, double output_factor, void* grad_uz, void* grad_s_u, void* grad_s_v,
                     int64_t tokens, int64_t f, void* workspace, int64_t workspace_bytes, void* stream);

// The projection over a host table of pieces (copied to the device by the launcher), as the CPU kernels
// of the same names. Rows that several pieces of one weight share are summed with atomics.
void accumulate_sq_norms(DType dtype, const Piece* pieces, int64_t count, double* sums, void* stream);
void scale(DType dtype, const Piece* pieces, int64_t count, const double* factors, void* stream);
void project_whole(DType dtype, const Piece* pieces, int64_t count, bool bound, void* stream);

}  // namespace angpt::cuda
