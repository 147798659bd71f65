// Fused SiLU-and-mul: out[r, j] = silu(x[r, j]) * x[r, d + j] for a (rows, 2d)
// input. Device code and its launcher only: no torch headers, so nvcc compiles
// this file quickly; ops.cpp registers the launcher as a torch op.
//
// Returns 0 on success or a CUDA error code; a host-side argument error returns -1.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "silu_and_mul.h"

namespace {

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t d) {
  const int64_t row = blockIdx.x;
  const T* gate = x + row * 2 * d;
  const T* up = gate + d;
  T* dst = out + row * d;
  for (int64_t j = blockIdx.y * blockDim.x + threadIdx.x; j < d; j += (int64_t)gridDim.y * blockDim.x) {
    const float a = to_float(gate[j]);
    const float silu = a / (1.0f + __expf(-a));  // computed in float32 for every dtype
    dst[j] = from_float<T>(silu * to_float(up[j]));
  }
}

template <typename T>
int launch(const void* x, void* out, int64_t rows, int64_t d, void* stream) {
  if (rows < 0 || d < 0 || rows > 2147483647) return -1;
  if (rows == 0 || d == 0) return 0;
  const int threads = 256;
  int64_t col_blocks = (d + threads - 1) / threads;
  const dim3 grid((unsigned)rows, (unsigned)(col_blocks < 65535 ? col_blocks : 65535));
  silu_and_mul_kernel<T><<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const T*>(x), static_cast<T*>(out), d);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int kiln_silu_and_mul(KilnDtype dtype, const void* x, void* out, int64_t rows, int64_t d, void* stream) {
  switch (dtype) {
    case KilnDtype::f32: return launch<float>(x, out, rows, d, stream);
    case KilnDtype::f16: return launch<__half>(x, out, rows, d, stream);
    case KilnDtype::bf16: return launch<__nv_bfloat16>(x, out, rows, d, stream);
  }
  return -1;
}

const char* kiln_cuda_error_string(int code) {
  return code < 0 ? "invalid shape: rows must be in [0, 2^31) and d >= 0"
                  : cudaGetErrorString(static_cast<cudaError_t>(code));
}
