// The launcher silu_and_mul.cu exports to ops.cpp (plain C++ types: no CUDA or torch headers).
#pragma once
#include <stdint.h>

enum class KilnDtype : int { f32 = 0, f16 = 1, bf16 = 2 };

int kiln_silu_and_mul(KilnDtype dtype, const void* x, void* out, int64_t rows, int64_t d, void* stream);
const char* kiln_cuda_error_string(int code);
