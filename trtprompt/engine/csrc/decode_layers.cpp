// A pure decode step's decoder layers in one call: per layer the (add +) RMSNorm, the qkv linear, the fused decode
// attention, o_proj, add + RMSNorm, gate_up, SiLU * up and down, each the op the Python layer would call, reached
// through the dispatcher from here. A step of whole chunks (prefill chunks, speculative verification rows) runs
// the same with chunk_attention in the decode attention's place.
//
// The results are the layer-by-layer path's bit for bit (same ops, same inputs, same order); what goes is the
// Python between them: a SmolLM2 step makes ~8 op calls and ~10 Python calls a layer at 5-6 us per custom op
// call from Python on a 2-core EPYC, against well under a microsecond per call here. Each linear arrives as the
// kernel call its Python module routes a call of these rows to (engine/kernel_call.py). docs/design.md,
// "Fused layer ops".
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "op_handle.h"

namespace {

using trtprompt_ops::op;

// engine/kernel_call.py's KINDS.
enum Kind : int64_t { kPanel = 0, kAmx = 1, kFewRows = 2, kOneDnn = 3 };

using Opt = std::optional<at::Tensor>;
using OptList = c10::List<Opt>;
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      double);
using Unary = at::Tensor(const at::Tensor&);
using BiasLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&, const Opt&);
using FewRows = at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&, int64_t);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             double, const Opt&, const Opt&, double);

// oneDNN's prepacked GEMM as OneDnnLinear calls it from Python (attr "none", no scalars, no algorithm). A boxed call:
// torch registers the op's kernel with its own C++ signature, which no header here declares.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const Opt& bias) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  handle.callBoxed(stack);
  return stack[0].toTensor();
}

// The step's linears, four a layer (qkv, o_proj, gate_up, down), each as engine/kernel_call.py's KernelCall.
struct Linears {
  at::IntArrayRef kinds, groups;
  at::TensorList weights;
  const OptList& scales;
  const OptList& biases;

  at::Tensor run(size_t i, const at::Tensor& x) const {
    static const auto panel = op<BiasLinear>("trtprompt::panel_linear");
    static const auto amx = op<BiasLinear>("trtprompt::amx_linear");
    static const auto few_rows = op<FewRows>("trtprompt::few_rows_linear");
    const Opt scale = scales.get(i), bias = biases.get(i);
    if (kinds[i] == kOneDnn) {
      return onednn_linear(x, weights[i], bias);
    }
    if (kinds[i] == kFewRows) {
      at::Tensor out = few_rows.call(x, weights[i], scale, groups[i]);
      return bias.has_value() ? at::add(out, *bias) : out;  // as KernelCall.run: `out + bias`
    }
    return (kinds[i] == kPanel ? panel : amx).call(x, weights[i], scale, bias);
  }
};

void check_lengths(size_t layers, size_t v_caches, size_t norms, size_t qk_norms, const Linears& lin) {
  TORCH_CHECK(layers > 0 && v_caches == layers && norms == 2 * layers && qk_norms == 2 * layers,
              "decode_layers: k_caches, v_caches (one a layer), norms and qk_norms (two a layer) disagree");
  const size_t n = 4 * layers;
  TORCH_CHECK(lin.kinds.size() == n && lin.groups.size() == n && lin.weights.size() == n && lin.scales.size() == n &&
                  lin.biases.size() == n,
              "decode_layers: kinds, groups, weights, scales and biases need four entries a layer");
  for (const int64_t kind : lin.kinds) {
    TORCH_CHECK(kind >= kPanel && kind <= kOneDnn, "decode_layers: unknown linear kind ", kind);
  }
}

// x [T, hidden]: the step's embeddings in packed order. chunks false: one token per sequence, block_tables / lens
// paged_decode's (tables, seq_lens); true: every row in a chunk, lens paged_prefill's segments. Returns (residual
// stream, last layer's MLP output not yet added), as DecoderModel's layer loop leaves them.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
    const at::Tensor& block_tables, const at::Tensor& lens, bool chunks, int64_t heads, double scale, double eps,
    at::TensorList norms, const OptList& qk_norms, at::IntArrayRef kinds, at::IntArrayRef groups,
    at::TensorList weights, const OptList& scales, const OptList& biases) {
  static const auto rms_norm = op<RmsNorm>("trtprompt::rms_norm");
  static const auto add_rms_norm = op<AddRmsNorm>("trtprompt::add_rms_norm");
  static const auto silu_and_mul = op<Unary>("trtprompt::silu_and_mul");
  static const auto decode = op<Attention>("trtprompt::decode_attention");
  static const auto chunk = op<Attention>("trtprompt::chunk_attention");
  const auto& attention = chunks ? chunk : decode;
  const Linears lin{kinds, groups, weights, scales, biases};
  const size_t layers = k_caches.size();
  check_lengths(layers, v_caches.size(), norms.size(), qk_norms.size(), lin);
  at::Tensor residual = x.contiguous(), delta, h;
  for (size_t i = 0; i < layers; ++i) {
    if (i == 0) {
      h = rms_norm.call(residual, norms[0], eps);
    } else {
      std::tie(residual, h) = add_rms_norm.call(residual, delta, norms[2 * i], eps);
    }
    const at::Tensor qkv = lin.run(4 * i, h);
    const at::Tensor attended = attention.call(qkv, cos, sin, k_caches[i], v_caches[i], slot_blocks, slot_offsets,
                                               block_tables, lens, heads, scale, qk_norms.get(2 * i),
                                               qk_norms.get(2 * i + 1), eps);
    std::tie(residual, h) = add_rms_norm.call(residual, lin.run(4 * i + 1, attended), norms[2 * i + 1], eps);
    delta = lin.run(4 * i + 3, silu_and_mul.call(lin.run(4 * i + 2, h)));
  }
  return {residual, delta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_blocks, Tensor slot_offsets, Tensor block_tables, Tensor lens, bool chunks, int heads, float scale, "
        "float eps, Tensor[] norms, Tensor?[] qk_norms, int[] kinds, int[] groups, Tensor[] weights, "
        "Tensor?[] scales, Tensor?[] biases) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}

// oneDNN's packed weights are MkldnnCPU tensors, which make that the call's dispatch key.
TORCH_LIBRARY_IMPL(trtprompt, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
}
