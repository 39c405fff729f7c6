// Python bindings of the fused kernels: argument checks, allocation, and dispatch to the CPU kernels or
// (in builds with ANGPT_WITH_CUDA) the CUDA launchers. Device-generic torch code only: the CUDA stream is
// reached through c10's device-guard interface, so this file needs no CUDA headers.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
// at::Tensor <-> Python; half the compile time of torch/extension.h, which brings all of libtorch's C++ API.
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"
#include "cuda/kernels.h"
#include "pieces.h"

namespace angpt {
namespace {

#ifdef ANGPT_WITH_CUDA
cuda::DType cuda_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kFloat16;
    default: TORCH_CHECK(false, "angpt kernels: unsupported dtype ", dtype);
  }
}

void* current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}
#endif

// Runs `on_cpu` or `on_cuda` for tensors on `device`.
template <typename OnCpu, typename OnCuda>
void dispatch(const at::Device& device, OnCpu on_cpu, OnCuda on_cuda) {
  if (device.is_cpu()) {
    on_cpu();
    return;
  }
#ifdef ANGPT_WITH_CUDA
  if (device.is_cuda()) {
    c10::DeviceGuard guard(device);
    on_cuda(cuda_dtype, current_stream(device));
    return;
  }
#endif
  TORCH_CHECK(false, "angpt kernels: no kernels for device ", device, " in this build");
}

void check_swiglu(const at::Tensor& uz, const at::Tensor& s_u, const at::Tensor& s_v) {
  TORCH_CHECK(at::isFloatingType(uz.scalar_type()), "scaled_swiglu: uz must be floating point, got ", uz.scalar_type());
  TORCH_CHECK(s_u.dim() == 1 && s_u.sizes() == s_v.sizes(), "scaled_swiglu: s_u and s_v must be vectors of one size");
  TORCH_CHECK(uz.dim() >= 1 && uz.size(-1) == 2 * s_u.numel(),
              "scaled_swiglu: the last dim of uz (", uz.size(-1), ") must be twice the size of s_u (", s_u.numel(),
              ")");
  const auto acc = at::toOpMathType(uz.scalar_type());
  TORCH_CHECK(s_u.scalar_type() == acc && s_v.scalar_type() == acc, "scaled_swiglu: scales must be ", acc,
              " for ", uz.scalar_type(), " inputs");
  TORCH_CHECK(s_u.device() == uz.device() && s_v.device() == uz.device(),
              "scaled_swiglu: tensors on different devices");
}

std::vector<int64_t> output_sizes(const at::Tensor& uz, int64_t f) {
  std::vector<int64_t> sizes(uz.sizes().begin(), uz.sizes().end());
  sizes.back() = f;
  return sizes;
}

at::Tensor swiglu_forward(const at::Tensor& uz_in, const at::Tensor& s_u_in, const at::Tensor& s_v_in,
                          double input_factor, double output_factor) {
  check_swiglu(uz_in, s_u_in, s_v_in);
  const at::Tensor uz = uz_in.contiguous(), s_u = s_u_in.contiguous(), s_v = s_v_in.contiguous();
  const int64_t f = s_u.numel();
  at::Tensor out = at::empty(output_sizes(uz, f), uz.options());
  dispatch(
      uz.device(), [&] { cpu::swiglu_forward(uz, s_u, s_v, input_factor, output_factor, out); },
      [&](auto to_cuda, void* stream) {
        cuda::swiglu_forward(to_cuda(uz.scalar_type()), uz.data_ptr(), s_u.data_ptr(), s_v.data_ptr(), input_factor,
                             output_factor, out.data_ptr(), f ? out.numel() / f : 0, f, stream);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_in, const at::Tensor& uz_in,
                                                               const at::Tensor& s_u_in, const at::Tensor& s_v_in,
                                                               double input_factor, double output_factor) {
  check_swiglu(uz_in, s_u_in, s_v_in);
  const int64_t f = s_u_in.numel();
  TORCH_CHECK(grad_in.sizes() == at::IntArrayRef(output_sizes(uz_in, f)) &&
                  grad_in.scalar_type() == uz_in.scalar_type(),
              "scaled_swiglu: the output gradient must have the output's shape and dtype");
  const at::Tensor grad = grad_in.contiguous(), uz = uz_in.contiguous();
  const at::Tensor s_u = s_u_in.contiguous(), s_v = s_v_in.contiguous();
  at::Tensor grad_uz = at::empty_like(uz), grad_s_u = at::empty_like(s_u), grad_s_v = at::empty_like(s_v);
  dispatch(
      uz.device(),
      [&] { cpu::swiglu_backward(grad, uz, s_u, s_v, input_factor, output_factor, grad_uz, grad_s_u, grad_s_v); },
      [&](auto to_cuda, void* stream) {
        const auto dtype = to_cuda(uz.scalar_type());
        const int64_t tokens = f ? grad.numel() / f : 0;
        // From torch's caching allocator on the current stream (the kernels' `stream`).
        const int64_t workspace_bytes = cuda::swiglu_backward_workspace_bytes(dtype, tokens, f);
        at::Tensor workspace = at::empty({workspace_bytes}, uz.options().dtype(at::kByte));
        cuda::swiglu_backward(dtype, grad.data_ptr(), uz.data_ptr(), s_u.data_ptr(), s_v.data_ptr(), input_factor,
                              output_factor, grad_uz.data_ptr(), grad_s_u.data_ptr(), grad_s_v.data_ptr(), tokens, f,
                              workspace.data_ptr(), workspace_bytes, stream);
      });
  return {grad_uz, grad_s_u, grad_s_v};
}

// A piece as Python passes it: (flat data, offset, cols, along_rows, region).
using PieceArg = std::tuple<at::Tensor, int64_t, int64_t, bool, int64_t>;

// The pieces grouped by element type (one kernel launch each), checked against the float64 buffer
// holding their sums or factors (`buffer_size` elements; 0 when there is none).
std::map<at::ScalarType, std::vector<Piece>> group_pieces(const std::vector<PieceArg>& args, const at::Device& device,
                                                          int64_t buffer_size) {
  std::map<at::ScalarType, std::vector<Piece>> groups;
  for (const auto& [data, offset, cols, along_rows, region] : args) {
    TORCH_CHECK(data.is_contiguous() && data.device() == device && at::isFloatingType(data.scalar_type()),
                "projection: pieces must be contiguous floating-point tensors on ", device);
    TORCH_CHECK(cols > 0 && offset >= 0 && region >= 0, "projection: bad piece (offset ", offset, ", cols ", cols, ")");
    const int64_t vectors_end = along_rows ? (offset + data.numel() + cols - 1) / cols : cols;
    TORCH_CHECK(buffer_size == 0 || region + vectors_end <= buffer_size,
                "projection: a piece's vectors run past the end of the float64 buffer");
    groups[data.scalar_type()].push_back({data.data_ptr(), data.numel(), offset, cols, region, along_rows});
  }
  return groups;
}

void check_buffer(const at::Tensor& buffer, const char* name) {
  TORCH_CHECK(buffer.scalar_type() == at::kDouble && buffer.is_contiguous() && buffer.dim() == 1,
              "projection: ", name, " must be a contiguous float64 vector");
}

void accumulate_sq_norms_(const std::vector<PieceArg>& args, at::Tensor& sums) {
  check_buffer(sums, "sums");
  for (auto& [dtype, pieces] : group_pieces(args, sums.device(), sums.numel())) {
    dispatch(
        sums.device(), [&] { cpu::accumulate_sq_norms(pieces, dtype, sums.data_ptr<double>()); },
        [&](auto to_cuda, void* stream) {
          cuda::accumulate_sq_norms(to_cuda(dtype), pieces.data(), pieces.size(), sums.data_ptr<double>(), stream);
        });
  }
}

void scale_(const std::vector<PieceArg>& args, const at::Tensor& factors_in) {
  check_buffer(factors_in, "factors");
  const at::Tensor factors = factors_in.contiguous();
  for (auto& [dtype, pieces] : group_pieces(args, factors.device(), factors.numel())) {
    dispatch(
        factors.device(), [&] { cpu::scale(pieces, dtype, factors.data_ptr<double>()); },
        [&](auto to_cuda, void* stream) {
          cuda::scale(to_cuda(dtype), pieces.data(), pieces.size(), factors.data_ptr<double>(), stream);
        });
  }
}

void project_whole_(const std::vector<PieceArg>& args, bool bound) {
  if (args.empty()) return;
  const at::Device device = std::get<0>(args.front()).device();
  for (const auto& [data, offset, cols, along_rows, region] : args) {
    TORCH_CHECK(offset == 0 && data.numel() % cols == 0, "project_whole_: pieces must be whole weights");
  }
  for (auto& [dtype, pieces] : group_pieces(args, device, 0)) {
    dispatch(
        device, [&] { cpu::project_whole(pieces, dtype, bound); },
        [&](auto to_cuda, void* stream) {
          cuda::project_whole(to_cuda(dtype), pieces.data(), pieces.size(), bound, stream);
        });
  }
}

}  // namespace
}  // namespace angpt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "angpt's fused kernels: the nu-scaled SwiGLU and the bounded-weight projection";
#ifdef ANGPT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("swiglu_forward", &angpt::swiglu_forward, "out = output_factor (input_factor s_u u) SiLU(input_factor s_v z)");
  m.def("swiglu_backward", &angpt::swiglu_backward, "(grad uz, grad s_u, grad s_v) of swiglu_forward");
  m.def("accumulate_sq_norms_", &angpt::accumulate_sq_norms_, "sums[region + vector] += partial squared norms");
  m.def("scale_", &angpt::scale_, "multiply each vector of each piece by factors[region + vector]");
  m.def("project_whole_", &angpt::project_whole_, "bound (or normalize) the vectors of whole weights in one pass");
}
