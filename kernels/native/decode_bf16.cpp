// Decode's CPU kernels in bf16, on x86 CPUs with AVX512F (with AVX512-BF16 where it is; common.h
// emulates it elsewhere): the few-row product (linear_bf16), the routed experts of a few tokens
// (moe_pairs, moe_topk), MLA decode attention over the paged
// cache (mla_decode; on the AMX tile unit, for any batch, where it can), RMSNorm with its residual
// add (rms_norm), LayerNorm with a bias (layer_norm), rotary embedding (rotary), the MTP layer's input (mtp_input), and a layer's
// attention and MoE block in one call each (mla_attention, moe_block), a decode step's whole
// stack of layers in one (decode_stack), greedy sampling's argmax over bf16 logits (argmax_bf16), and
// a greedy speculative step with MTP drafts in one (greedy_spec_step), and DeepSeek-V3.2's
// indexer top-k and sparse MLA decode (indexer_topk, sparse_mla_decode), and DeepSeek-V4's
// attention (v4_attention), compressors' pooling (compress_pool) and hyper-connections (hc_pre,
// hc_merge), and a prefill chunk's causal attention (extend_attention). Pointers arrive as integers
// (torch.Tensor.data_ptr()); the Python wrappers in __init__.py and blocks.py check shapes, dtypes
// and strides.
//
// One file per concern, included in this order: common.h (threads, bf16), products.h (the few-row
// product), experts.h (moe_pairs, moe_topk), attention.h (mla_decode), layer.h (norms, rotary,
// mtp_input, mla_attention, route, moe_block, decode_stack), argmax.h (argmax_bf16), spec.h
// (greedy_spec_step), sparse.h (DeepSeek-V3.2's indexer_topk, sparse_mla_decode), v4.h
// (DeepSeek-V4's v4_attention, compress_pool, hc_pre, hc_merge), extend.h (extend_attention). This
// file binds them.

#include "layer.h"
#include "argmax.h"
#include "spec.h"
#include "sparse.h"
#include "v4.h"
#include "extend.h"


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
  m.def("use_amx", &use_amx);
  m.def("use_amx_attention", &use_amx_attention);
  m.def("use_attend_generic", &use_attend_generic);
  m.def("use_pool", &use_pool);
  m.def("set_pool_min_bytes", &set_pool_min_bytes);
  m.def("linear_bf16", &linear_bf16, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_q", &linear_q, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("use_quant_generic", &use_quant_generic);
  m.def("moe_pairs", &moe_pairs, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_topk", &moe_topk, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mla_decode", &mla_decode, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("extend_attention", &extend_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary", &rotary, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mtp_input", &mtp_input, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mla_attention", &mla_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("route", &route);
  m.def("moe_block", &moe_block_py, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("layer_plan_fields", &layer_plan_fields);
  m.def("indexer_plan_fields", &indexer_plan_fields);
  m.def("layer_norm", &layer_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_stack", &decode_stack, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_bf16", &argmax_bf16, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("greedy_spec_step", &greedy_spec_step, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("indexer_topk", &indexer_topk, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sparse_mla_decode", &sparse_mla_decode, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("v4_attention", &v4_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("compress_pool", &compress_pool, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("hc_pre", &hc_pre, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("hc_merge", &hc_merge, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("exp_f32", [](int64_t x_ptr, int64_t y_ptr, int64_t n) {
    exp_floats(reinterpret_cast<const float*>(x_ptr), reinterpret_cast<float*>(y_ptr), n);
  });
  m.def("dot_bf16_lanes", [](int64_t acc_ptr, int64_t a_ptr, int64_t b_ptr, int64_t n) {
    auto* acc = reinterpret_cast<float*>(acc_ptr);
    const auto *a = reinterpret_cast<const uint16_t*>(a_ptr), *b = reinterpret_cast<const uint16_t*>(b_ptr);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(acc + i, dot_bf16(_mm512_loadu_ps(acc + i), _mm512_loadu_si512(a + 2 * i),
                                         _mm512_loadu_si512(b + 2 * i)));
  });
  m.def("narrow_f32", [](int64_t x_ptr, int64_t y_ptr, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(y_ptr) + i),
                          narrow16(_mm512_loadu_ps(reinterpret_cast<const float*>(x_ptr) + i)));
  });
}
