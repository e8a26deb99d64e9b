// tlt_core._C: the thin pybind11 layer over csrc/. It takes raw data pointers (Python ints)
// that tlt_core.ops has already validated, dispatches to the CPU or CUDA implementation, and
// releases the GIL while a kernel runs. Argument checking beyond sizes, type codes and the
// device lives in tlt_core.ops: a raw pointer cannot be checked here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tlt/attention.h"
#include "tlt/decoder_layers.h"
#include "tlt/device.h"
#include "tlt/idle.h"
#include "tlt/kv_cache.h"
#include "tlt/panel_matmul.h"
#include "tlt/random.h"
#include "tlt/rms_norm.h"
#include "tlt/rope.h"
#include "tlt/silu_mul.h"
#include "tlt/draft_sample.h"
#include "tlt/tree.h"
#include "tlt/verify.h"

namespace py = pybind11;

namespace {

// A device of -1 means the host; >= 0 is a CUDA device whose current stream is `stream`.
struct Target {
  Target(int64_t device, uintptr_t stream) : device(device), stream(stream) {
    if (device < -1)
      throw std::invalid_argument("device: must be -1 (the host) or a CUDA device index, got " +
                                  std::to_string(device));
  }
  int64_t device;
  uintptr_t stream;
  bool cuda() const { return device >= 0; }
};

#if defined(TLT_WITH_CUDA)
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

void require_cuda_build() {
  if (!kBuiltWithCuda)
    throw std::runtime_error(
        "tlt_core was built without CUDA kernels (nvcc not found or TLT_CUDA=off); "
        "rebuild with TLT_CUDA=on on a machine with the CUDA toolkit");
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Runs the CPU function or, for a CUDA target, the CUDA one (only compiled in CUDA builds).
#if defined(TLT_WITH_CUDA)
#define TLT_DISPATCH(target, cpu_call, cuda_call) \
  do {                                            \
    if ((target).cuda()) {                        \
      tlt::cuda_set_device((target).device);      \
      cuda_call;                                  \
    } else {                                      \
      cpu_call;                                   \
    }                                             \
  } while (0)
#else
#define TLT_DISPATCH(target, cpu_call, cuda_call) \
  do {                                            \
    if ((target).cuda()) require_cuda_build();    \
    cpu_call;                                     \
  } while (0)
#endif

void select_tree(uintptr_t cand_tokens, uintptr_t cand_scores, uintptr_t cand_parents,
                 uintptr_t root_tokens, int64_t batch, int64_t num_candidates,
                 int64_t num_nodes_max, uintptr_t tokens, uintptr_t parents,
                 uintptr_t source_index, uintptr_t num_nodes, uintptr_t row_status,
                 int64_t device, uintptr_t stream) {
  const Target target{device, stream};
  TLT_DISPATCH(target,
               tlt::select_tree_cpu(ptr<const int64_t>(cand_tokens), ptr<const float>(cand_scores),
                                    ptr<const int32_t>(cand_parents),
                                    ptr<const int64_t>(root_tokens), batch, num_candidates,
                                    num_nodes_max, ptr<int64_t>(tokens), ptr<int32_t>(parents),
                                    ptr<int32_t>(source_index), ptr<int32_t>(num_nodes),
                                    ptr<int32_t>(row_status)),
               tlt::select_tree_cuda(ptr<const int64_t>(cand_tokens),
                                     ptr<const float>(cand_scores),
                                     ptr<const int32_t>(cand_parents),
                                     ptr<const int64_t>(root_tokens), batch, num_candidates,
                                     num_nodes_max, ptr<int64_t>(tokens), ptr<int32_t>(parents),
                                     ptr<int32_t>(source_index), ptr<int32_t>(num_nodes),
                                     ptr<int32_t>(row_status), ptr<void>(target.stream)));
}

void tree_metadata(uintptr_t parents, uintptr_t num_nodes, uintptr_t cache_len, int64_t batch,
                   int64_t num_nodes_max, uintptr_t depths, uintptr_t positions, uintptr_t mask,
                   uintptr_t row_status, int64_t device, uintptr_t stream) {
  const Target target{device, stream};
  TLT_DISPATCH(target,
               tlt::tree_metadata_cpu(ptr<const int32_t>(parents), ptr<const int32_t>(num_nodes),
                                      ptr<const int32_t>(cache_len), batch, num_nodes_max,
                                      ptr<int32_t>(depths), ptr<int64_t>(positions),
                                      ptr<int32_t>(mask), ptr<int32_t>(row_status)),
               tlt::tree_metadata_cuda(ptr<const int32_t>(parents),
                                       ptr<const int32_t>(num_nodes),
                                       ptr<const int32_t>(cache_len), batch, num_nodes_max,
                                       ptr<int32_t>(depths), ptr<int64_t>(positions),
                                       ptr<int32_t>(mask), ptr<int32_t>(row_status),
                                       ptr<void>(target.stream)));
}

void verify_tree_greedy(uintptr_t logits, int32_t logits_type, uintptr_t tokens,
                        uintptr_t parents, uintptr_t num_nodes, int64_t batch,
                        int64_t num_nodes_max, int64_t vocab, uintptr_t accept_index,
                        uintptr_t num_accepted, uintptr_t emitted_tokens,
                        uintptr_t emitted_logprobs, uintptr_t row_status, int64_t device,
                        uintptr_t stream, int isa) {
  const Target target{device, stream};
  const auto type = static_cast<tlt::FloatType>(logits_type);
  TLT_DISPATCH(target,
               tlt::verify_tree_greedy_cpu(ptr<const void>(logits), type,
                                           ptr<const int64_t>(tokens),
                                           ptr<const int32_t>(parents),
                                           ptr<const int32_t>(num_nodes), batch, num_nodes_max,
                                           vocab, ptr<int32_t>(accept_index),
                                           ptr<int32_t>(num_accepted),
                                           ptr<int64_t>(emitted_tokens),
                                           ptr<float>(emitted_logprobs),
                                           ptr<int32_t>(row_status), isa),
               tlt::verify_tree_greedy_cuda(ptr<const void>(logits), type,
                                            ptr<const int64_t>(tokens),
                                            ptr<const int32_t>(parents),
                                            ptr<const int32_t>(num_nodes), batch, num_nodes_max,
                                            vocab, ptr<int32_t>(accept_index),
                                            ptr<int32_t>(num_accepted),
                                            ptr<int64_t>(emitted_tokens),
                                            ptr<float>(emitted_logprobs),
                                            ptr<int32_t>(row_status), ptr<void>(target.stream)));
}

void verify_tree_sampling(uintptr_t logits, int32_t logits_type, uintptr_t draft_probs,
                          uintptr_t tokens, uintptr_t parents, uintptr_t num_nodes,
                          uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
                          uintptr_t uniforms, int64_t batch, int64_t num_nodes_max,
                          int64_t vocab, uintptr_t accept_index, uintptr_t num_accepted,
                          uintptr_t emitted_tokens, uintptr_t emitted_logprobs,
                          uintptr_t row_status, uintptr_t workspace, int64_t device,
                          uintptr_t stream, int isa) {
  const Target target{device, stream};
  const auto type = static_cast<tlt::FloatType>(logits_type);
  TLT_DISPATCH(
      target,
      tlt::verify_tree_sampling_cpu(
          ptr<const void>(logits), type, ptr<const float>(draft_probs), ptr<const int64_t>(tokens),
          ptr<const int32_t>(parents), ptr<const int32_t>(num_nodes),
          ptr<const float>(temperature), ptr<const int32_t>(top_k), ptr<const float>(top_p),
          ptr<const float>(uniforms), batch, num_nodes_max, vocab, ptr<int32_t>(accept_index),
          ptr<int32_t>(num_accepted), ptr<int64_t>(emitted_tokens), ptr<float>(emitted_logprobs),
          ptr<int32_t>(row_status), isa),
      tlt::verify_tree_sampling_cuda(
          ptr<const void>(logits), type, ptr<const float>(draft_probs), ptr<const int64_t>(tokens),
          ptr<const int32_t>(parents), ptr<const int32_t>(num_nodes),
          ptr<const float>(temperature), ptr<const int32_t>(top_k), ptr<const float>(top_p),
          ptr<const float>(uniforms), batch, num_nodes_max, vocab, ptr<int32_t>(accept_index),
          ptr<int32_t>(num_accepted), ptr<int64_t>(emitted_tokens), ptr<float>(emitted_logprobs),
          ptr<int32_t>(row_status), ptr<void>(workspace), ptr<void>(target.stream)));
}

void compact_kv(uintptr_t cache, int64_t planes, int64_t batch, int64_t groups, int64_t max_len,
                int64_t entry_bytes, uintptr_t cache_len, uintptr_t accept_index,
                uintptr_t num_accepted, int64_t num_nodes_max, uintptr_t row_status,
                int64_t device, uintptr_t stream) {
  const Target target{device, stream};
  TLT_DISPATCH(target,
               tlt::compact_kv_cpu(ptr<void>(cache), planes, batch, groups, max_len, entry_bytes,
                                   ptr<const int32_t>(cache_len), ptr<const int32_t>(accept_index),
                                   ptr<const int32_t>(num_accepted), num_nodes_max,
                                   ptr<int32_t>(row_status)),
               tlt::compact_kv_cuda(ptr<void>(cache), planes, batch, groups, max_len,
                                    entry_bytes, ptr<const int32_t>(cache_len),
                                    ptr<const int32_t>(accept_index),
                                    ptr<const int32_t>(num_accepted), num_nodes_max,
                                    ptr<int32_t>(row_status), ptr<void>(target.stream)));
}

void philox_uniforms(uintptr_t seeds, uintptr_t offsets, int64_t batch, int64_t count,
                     uintptr_t uniforms, int64_t device, uintptr_t stream) {
  const Target target{device, stream};
  TLT_DISPATCH(target,
               tlt::philox_uniforms_cpu(ptr<const int64_t>(seeds), ptr<const int64_t>(offsets),
                                        batch, count, ptr<float>(uniforms)),
               tlt::philox_uniforms_cuda(ptr<const int64_t>(seeds), ptr<const int64_t>(offsets),
                                         batch, count, ptr<float>(uniforms),
                                         ptr<void>(target.stream)));
}

// CPU only: on a GPU the decode passes replay as CUDA graphs, which already remove the per-op
// cost this fusion exists for.
void rope_kv_write(uintptr_t qkv, int32_t model_type, int64_t batch, int64_t tokens,
                   int64_t q_heads, int64_t kv_heads, int64_t head_dim, uintptr_t cos,
                   uintptr_t sin_signed, int64_t table_len, uintptr_t positions, uintptr_t slots,
                   uintptr_t cache_k, uintptr_t cache_v, int32_t cache_type, int64_t row_stride,
                   int64_t head_stride, int64_t max_len, uintptr_t q_out) {
  tlt::rope_kv_write_cpu(ptr<const void>(qkv), static_cast<tlt::FloatType>(model_type), batch,
                         tokens, q_heads, kv_heads, head_dim, ptr<const void>(cos),
                         ptr<const void>(sin_signed), table_len, ptr<const int64_t>(positions),
                         ptr<const int64_t>(slots), ptr<void>(cache_k), ptr<void>(cache_v),
                         static_cast<tlt::FloatType>(cache_type), row_stride, head_stride,
                         max_len, ptr<void>(q_out));
}

// CPU only, as rope_kv_write.
void add_rms_norm_bf16(uintptr_t h, uintptr_t delta, uintptr_t weight, int64_t rows,
                       int64_t hidden, float eps, uintptr_t h_out, uintptr_t normed) {
  tlt::add_rms_norm_bf16_cpu(ptr<const void>(h), ptr<const void>(delta), ptr<const void>(weight),
                             rows, hidden, eps, ptr<void>(h_out), ptr<void>(normed));
}

// CPU only, as rope_kv_write. bias and addend may be 0 (none).
void panel_matmul_f32(uintptr_t x, int64_t rows, int64_t in_features, int64_t ldx,
                      uintptr_t panels, int64_t out_features, uintptr_t bias, uintptr_t addend,
                      int64_t ld_addend, uintptr_t out, int64_t ldy, int isa) {
  tlt::panel_matmul_f32_cpu(ptr<const float>(x), rows, in_features, ldx, ptr<const float>(panels),
                            out_features, ptr<const float>(bias), ptr<const float>(addend),
                            ld_addend, ptr<float>(out), ldy, isa);
}

void panel_matmul_bf16(uintptr_t x, int64_t rows, int64_t in_features, int64_t ldx,
                       uintptr_t panels, int64_t out_features, uintptr_t bias, uintptr_t addend,
                       int64_t ld_addend, uintptr_t out, int64_t ldy, int isa) {
  tlt::panel_matmul_bf16_cpu(ptr<const uint16_t>(x), rows, in_features, ldx,
                             ptr<const uint16_t>(panels), out_features, ptr<const uint16_t>(bias),
                             ptr<const uint16_t>(addend), ld_addend, ptr<uint16_t>(out), ldy, isa);
}

void panel_matmul_bf16_pairs(uintptr_t x, int64_t rows, int64_t in_features, int64_t ldx,
                             uintptr_t pairs, int64_t out_features, uintptr_t bias,
                             uintptr_t addend, int64_t ld_addend, uintptr_t out, int64_t ldy,
                             int isa) {
  tlt::panel_matmul_bf16_pairs_cpu(ptr<const uint16_t>(x), rows, in_features, ldx,
                                   ptr<const uint16_t>(pairs), out_features,
                                   ptr<const uint16_t>(bias), ptr<const uint16_t>(addend),
                                   ld_addend, ptr<uint16_t>(out), ldy, isa);
}

// CPU only, as rope_kv_write. mask may be 0 (every query sees every slot read).
void decode_attention(uintptr_t q, int64_t batch, int64_t q_heads, int64_t tokens,
                      int64_t head_dim, uintptr_t cache_k, uintptr_t cache_v, int32_t kv_type,
                      int64_t kv_heads, int64_t row_stride, int64_t head_stride, int64_t max_len,
                      int64_t slots, uintptr_t mask, int64_t mask_batch_stride,
                      int64_t mask_token_stride, float scale, uintptr_t out, int32_t out_type) {
  tlt::decode_attention_cpu(ptr<const void>(q), batch, q_heads, tokens, head_dim,
                            ptr<const void>(cache_k), ptr<const void>(cache_v),
                            static_cast<tlt::FloatType>(kv_type), kv_heads, row_stride,
                            head_stride, max_len, slots, ptr<const uint8_t>(mask),
                            mask_batch_stride, mask_token_stride, scale, ptr<void>(out),
                            static_cast<tlt::FloatType>(out_type));
}

// CPU only, as rope_kv_write.
void sample_draft(uintptr_t logits, int64_t rows, int64_t draft_vocab, uintptr_t temperature,
                  uintptr_t uniforms, int64_t draws, uintptr_t draft_to_target, int64_t vocab,
                  uintptr_t out, int64_t ld_out, uintptr_t ids, uintptr_t row_status) {
  tlt::sample_draft_cpu(ptr<const float>(logits), rows, draft_vocab, ptr<const float>(temperature),
                        ptr<const float>(uniforms), draws, ptr<const int64_t>(draft_to_target),
                        vocab, ptr<float>(out), ld_out, ptr<int64_t>(ids),
                        ptr<int32_t>(row_status));
}

// CPU only, as rope_kv_write.
void silu_mul(uintptr_t gate_up, int32_t type, int64_t rows, int64_t width, int64_t ld,
              uintptr_t out) {
  tlt::silu_mul_cpu(ptr<const void>(gate_up), static_cast<tlt::FloatType>(type), rows, width, ld,
                    ptr<void>(out));
}

// CPU only, as rope_kv_write. A panel weight as (panels, out_features, pairs, bias or 0).
using PanelWeightArgs = std::tuple<uintptr_t, int64_t, bool, uintptr_t>;

tlt::PanelWeightBf16 panel_weight(const PanelWeightArgs& args) {
  const auto& [panels, out_features, pairs, bias] = args;
  return {ptr<const uint16_t>(panels), out_features, pairs, ptr<const uint16_t>(bias)};
}

// A model's decoder layers (decoder_layers.h), their weights' addresses gathered once per pack.
class DecoderLayersBf16 {
 public:
  DecoderLayersBf16(int64_t hidden, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                    int64_t intermediate)
      : shape_{hidden, q_heads, kv_heads, head_dim, intermediate} {}

  // q_norm, k_norm: 0 where the layer has none
  void add_layer(uintptr_t input_norm, float input_eps, const PanelWeightArgs& qkv,
                 uintptr_t q_norm, uintptr_t k_norm, float qk_eps, const PanelWeightArgs& o,
                 uintptr_t post_attention_norm, float post_attention_eps,
                 const PanelWeightArgs& gate_up, const PanelWeightArgs& down) {
    layers_.push_back({ptr<const uint16_t>(input_norm), input_eps, panel_weight(qkv),
                       ptr<const uint16_t>(q_norm), ptr<const uint16_t>(k_norm), qk_eps,
                       panel_weight(o), ptr<const uint16_t>(post_attention_norm),
                       post_attention_eps, panel_weight(gate_up), panel_weight(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // cache: the [L, 2, B, H_kv, max_len, d] cache's address, its type (FloatType: float32 or
  // bfloat16) and its first four strides; mask 0: none; saved: (layer, [R, H] output address)
  // pairs.
  void run(uintptr_t h, int64_t batch, int64_t tokens, uintptr_t cache, int32_t cache_type,
           int64_t layer_stride,
           int64_t plane_stride, int64_t row_stride, int64_t head_stride, int64_t max_len,
           uintptr_t cos, uintptr_t sin_signed, int64_t table_len, uintptr_t positions,
           uintptr_t slots, uintptr_t mask, int64_t mask_batch_stride, int64_t mask_token_stride,
           int64_t read_len, const std::vector<std::pair<int64_t, uintptr_t>>& saved) const {
    const auto& [hidden, q_heads, kv_heads, head_dim, intermediate] = shape_;
    const tlt::DecoderStep step{batch, tokens, hidden, q_heads, kv_heads, head_dim,
                                intermediate, ptr<void>(cache),
                                static_cast<tlt::FloatType>(cache_type), layer_stride, plane_stride,
                                row_stride, head_stride, max_len, ptr<const uint16_t>(cos),
                                ptr<const uint16_t>(sin_signed), table_len,
                                ptr<const int64_t>(positions), ptr<const int64_t>(slots),
                                ptr<const uint8_t>(mask), mask_batch_stride, mask_token_stride,
                                read_len};
    std::vector<int64_t> saved_layers;
    std::vector<uint16_t*> saved_out;
    for (const auto& [layer, out] : saved) {
      saved_layers.push_back(layer);
      saved_out.push_back(ptr<uint16_t>(out));
    }
    tlt::decoder_layers_bf16_cpu(layers_.data(), num_layers(), step, ptr<uint16_t>(h),
                                 saved_layers.data(), saved_out.data(),
                                 static_cast<int64_t>(saved.size()));
  }

 private:
  std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> shape_;  // H, H_q, H_kv, d, I
  std::vector<tlt::DecoderLayerBf16> layers_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tlt_core kernels (raw-pointer layer; use tlt_core.ops, which validates arguments)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("select_tree", &select_tree, nogil);
  m.def("tree_metadata", &tree_metadata, nogil);
  m.def("verify_tree_greedy", &verify_tree_greedy, nogil);
  m.def("verify_tree_sampling", &verify_tree_sampling, nogil);
  m.def("verify_tree_sampling_workspace_bytes", &tlt::verify_tree_sampling_workspace_bytes);
  m.def("compact_kv", &compact_kv, nogil);
  m.def("philox_uniforms", &philox_uniforms, nogil);
  m.def("rope_kv_write", &rope_kv_write, nogil);
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, nogil);
  m.def("panel_matmul_f32", &panel_matmul_f32, nogil);
  m.def("panel_matmul_bf16", &panel_matmul_bf16, nogil);
  m.def("panel_matmul_bf16_pairs", &panel_matmul_bf16_pairs, nogil);
  m.def("panel_matmul_vectorised", &tlt::panel_matmul_vectorised);
  m.def("panel_matmul_pairs_vectorised", &tlt::panel_matmul_pairs_vectorised);
  m.def("decode_attention", &decode_attention, nogil);
  m.def("silu_mul", &silu_mul, nogil);
  m.def("sample_draft", &sample_draft, nogil);
  m.attr("panel_width") = tlt::kPanelWidth;
  py::class_<DecoderLayersBf16>(m, "DecoderLayersBf16")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("hidden"),
           py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"))
      .def("add_layer", &DecoderLayersBf16::add_layer)
      .def_property_readonly("num_layers", &DecoderLayersBf16::num_layers)
      .def("run", &DecoderLayersBf16::run, nogil);
  // Idle detection (tlt/idle.h); std::invalid_argument surfaces as ValueError.
  py::class_<tlt::IdleStateMachine>(m, "IdleStateMachine")
      .def(py::init([](double utilization_threshold, double idle_after_s) {
             return tlt::IdleStateMachine(tlt::IdleConfig{utilization_threshold, idle_after_s});
           }),
           py::arg("utilization_threshold"), py::arg("idle_after_s"))
      .def("update",
           [](tlt::IdleStateMachine& self, double now_s, double utilization, bool work) {
             return self.update(now_s, utilization, work) == tlt::WorkerState::kIdle;
           },
           py::arg("now_s"), py::arg("utilization"), py::arg("engine_has_work"),
           "one observation; returns True when the worker is idle")
      .def_property_readonly(
          "idle", [](const tlt::IdleStateMachine& self) {
            return self.state() == tlt::WorkerState::kIdle;
          })
      .def_property_readonly("transitions", &tlt::IdleStateMachine::transitions)
      .def_property_readonly("last_change_s", &tlt::IdleStateMachine::last_change_s);
  py::class_<tlt::NvmlProbe>(m, "NvmlProbe")
      .def(py::init<const std::string&>(), py::arg("library") = "libnvidia-ml.so.1")
      .def_property_readonly("available", &tlt::NvmlProbe::available)
      .def_property_readonly("error", &tlt::NvmlProbe::error)
      .def("device_count", &tlt::NvmlProbe::device_count)
      .def("utilization", &tlt::NvmlProbe::utilization, py::arg("index"), nogil)
      .def("index_of_uuid", &tlt::NvmlProbe::index_of_uuid, py::arg("uuid"), nogil);
  m.attr("built_with_cuda") = kBuiltWithCuda;
  m.attr("max_tree_nodes") = tlt::kMaxTreeNodes;
  m.attr("max_candidates") = tlt::kMaxCandidates;
  m.attr("max_vocab") = tlt::kMaxVocab;
}
