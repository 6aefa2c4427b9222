// The bf16 dot-product panels (bf16_panels.cpp), a weight format of panel_linear (panel_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace trtprompt_bf16_panels {

// Whether this build holds the kernel (the AVX-512 variant, built by a GCC that knows avx512_bf16); whether the
// CPU runs it is the caller's check.
bool compiled();

// x [M, K] bfloat16 times panels [N / 32, K / 2, 32, 2] bfloat16, plus an optional float32 bias [N]: y [M, N] bfloat16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const float* bias);

}  // namespace trtprompt_bf16_panels
