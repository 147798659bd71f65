// torch.ops.kiln_csrc: the CUDA kernels of silu_and_mul.cu registered as torch ops.
//
// Built by Kiln's nvcc stage as a torch extension (kiln.toml [build.toolchain]
// torch = true: the installed torch's headers, libraries and C++ ABI) for the
// filtered -gencode list, and loaded with torch.ops.load_library. Only core
// headers: the current stream comes through c10's device-generic interface,
// so the library links against libc10/libtorch_cpu alone and needs no CUDA build
// of torch to compile.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "silu_and_mul.h"

namespace {

constexpr int64_t kAbiVersion = 2;

KilnDtype dtype_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return KilnDtype::f32;
    case at::kHalf: return KilnDtype::f16;
    case at::kBFloat16: return KilnDtype::bf16;
    default: TORCH_CHECK(false, "kiln_csrc::silu_and_mul: dtype ", x.scalar_type(), " is not float32/float16/bfloat16");
  }
}

at::Tensor silu_and_mul_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "kiln_csrc::silu_and_mul expects (M, 2D), got ", x.sizes());
  const at::Tensor input = x.contiguous();
  const int64_t rows = input.size(0), d = input.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, input.options());
  c10::DeviceGuard guard(input.device());
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(input.device()).native_handle();
  const int rc = kiln_silu_and_mul(dtype_of(input), input.data_ptr(), out.data_ptr(), rows, d, stream);
  TORCH_CHECK(rc == 0, "kiln_csrc::silu_and_mul failed (", rc, "): ", kiln_cuda_error_string(rc));
  return out;
}

}  // namespace

TORCH_LIBRARY(kiln_csrc, m) {
  m.def("abi_version() -> int", []() -> int64_t { return kAbiVersion; });
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_csrc, CUDA, m) { m.impl("silu_and_mul", &silu_and_mul_cuda); }
