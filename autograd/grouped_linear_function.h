#pragma once
// Autograd for the grouped linear layer: one autograd node whose forward and backward call the
// grouped GEMM ops, the planning step a module runs once per call, and the deferred
// weight-gradient step of delay_wgrad_compute.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "torchmoe/autograd/stacked_grad_edge.h"
#include "torchmoe/fp8/state.h"
#include "torchmoe/ops/glu.h"
#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/quantize.h"

namespace torchmoe::autograd {

using ops::GemmPlan;
using ops::GemmShape;

struct GroupedLinearConfig;

// A layer input whose GEMM rows are rows of it in another order: MoE's token permutation fused
// into fc1. Forward and wgrad read GEMM row i from input[rows[i]] (ops/grouped_gemm.h, "Gathered
// input"), or from `gathered` when the caller made that copy (the sm90 kernel's one-row loads are
// slower than a copy: docs/experiments.md); either way the Function's input, and what its
// gradient is of, is the un-gathered [input rows, in] tensor. The input gradient sums the dgrad
// rows of each input row, deterministically, as the permutation's own backward does: inside the
// dgrad GEMM (ops "Scattered output") for at most two rows per input row, whose sum does not depend
// on the order they land in; else after it (ops::unpermute_rows). FP8: always after it.
struct RowGather {
  at::Tensor rows;        // [N] int32/int64: the input row of each GEMM row
  at::Tensor token_rows;  // [input rows, k] int64: the GEMM rows of each input row, -1 for none
  at::Tensor gathered;    // [N, in]: input's rows in GEMM order, contiguous; or undefined
};

// A layer output summed per output row inside the forward GEMM instead of written in GEMM order
// (ops/grouped_gemm.h, "Scattered output"): MoE's unpermute fused into fc2, for top-1 and top-2
// routing (at most two rows per output row: sums that do not depend on the order the rows land
// in). 16-bit plans. Forward returns [token_rows rows, out]; backward reads the output
// gradient's rows back in GEMM order (ops::permute_rows) for dgrad and wgrad.
struct OutputScatter {
  at::Tensor rows;          // [N] int32/int64: the output row each GEMM row is added to
  at::Tensor token_rows;    // [output rows, k <= 2] int64: the GEMM rows of each, -1 for none
  at::Tensor sorted_slots;  // [N] int64: token_rows' inverse (PermutedTokens::sorted_slots)
};

// A weight-gradient GEMM that delay_wgrad_compute moved out of backward.
struct DelayedWgrad {
  at::Tensor input;        // [rows, in], or the gathered input and its row map:
  at::Tensor gather_rows;  // [rows] (RowGather::rows), else undefined
  at::Tensor grad_output;  // [rows, out]
  // FP8: the columnwise copies the GEMM reads instead of input and grad_output.
  ops::SplitQuantized fp8_input;
  ops::SplitQuantized fp8_grad_output;
  c10::intrusive_ptr<GroupedLinearConfig> config;
};

// The FP8 copies of a layer's weights kept across micro-batches (is_first_microbatch): made by a
// call with true, read by calls with false. Owned by the layer, shared with its calls' configs.
struct Fp8WeightCache {
  ops::SplitQuantized weights;  // rowwise (fprop) and columnwise (dgrad), as quantize_weights
  // Delayed-scaling copies that an optimizer writes with each update
  // (optim::FusedAdamW::set_fp8_weights), laid out as `weights` (no amax), and the layer's
  // weight parameters' version counters when it last wrote them all: an in-place change (an
  // ATen op, or a FusedAdamW writing the parameter as a model copy) moves a counter, and
  // forwards quantize the weights again.
  ops::SplitQuantized optimizer_weights;
  std::vector<uint32_t> versions;
};

// What an FP8 forward keeps (docs/fp8.md) besides its plan, which carries what the recipe asks
// (ops::Fp8GemmOptions, made when the call was planned, so backward, on another thread and after
// the autocast region, runs what forward planned): the layer's delayed-scaling state, and the
// quantized operands that backward reads instead of the 16-bit tensors.
struct Fp8Config {
  fp8::Fp8State state{nullptr};  // the layer's; required by delayed scaling
  // nullopt: quantize the weights every call; true: quantize and cache; false: use the cache.
  std::optional<bool> is_first_microbatch;
  // Read weight_cache->optimizer_weights instead, whatever is_first_microbatch says.
  bool optimizer_weights = false;
  std::shared_ptr<Fp8WeightCache> weight_cache;  // the layer's (used when is_first_microbatch)
  // Set by forward: the input's columnwise copy (wgrad), the weights' (dgrad).
  ops::SplitQuantized input;
  ops::SplitQuantized weights;
};

// An FP8 layer's output gradient handed over already quantized by the backward that produces it, so
// that the 16-bit gradient is never written: in FP8 GroupedMLP fc2's backward differentiates its
// input activation and quantizes the result for fc1 in one pass (ops::glu_backward_split_quantize;
// under current scaling and below 8 waves of tiles its two ops, which do write it); in an FP8 MoE
// layer the unpermute's backward quantizes the layer's output gradient for fc2 straight from the
// tokens' rows (ops::gather_split_quantize). The consumer's forward arms the link with how its
// backward would quantize its output gradient; the producer's backward leaves the FP8 copies here
// and hands autograd, as the consumer's output gradient, a zero of its shape that takes no memory;
// the consumer's backward takes the copies instead of quantizing that. Unarmed (the consumer has
// bias gradients, which are sums of the 16-bit gradient), the two exchange the 16-bit gradient as
// any two functions do.
struct Fp8GradLink {
  // Set by the consumer's forward.
  bool armed = false;
  ops::SplitQuantizeOptions options;  // the consumer plan's, for its output gradient
  fp8::Fp8State state{nullptr};
  int64_t rows = 0;                    // the consumer's
  std::optional<SplitSizes> m_splits;  // the consumer's
  bool rowwise = false;                // dgrad's copy
  bool columnwise = false;             // wgrad's copy
  // Set by the producer's backward, taken by the consumer's.
  std::optional<ops::SplitQuantized> grad;
};

// What the producer hands autograd as the consumer's output gradient: a zero of that shape that
// takes no memory, every stride 0, which is how the consumer's backward knows that nothing else
// was summed into it.
at::Tensor linked_gradient_placeholder(at::IntArrayRef sizes, const at::TensorOptions& options);

// The producer's side of an armed link: the consumer's output gradient is rows `gather_rows` of
// `grad` (every row of it when undefined); quantizes them as the consumer's backward would.
ops::SplitQuantized quantize_linked_gradient(const Fp8GradLink& link, const at::Tensor& grad,
                                             const at::Tensor& gather_rows);

// FIFO of delayed weight-gradient GEMMs: oldest backward first.
class WgradQueue : public std::deque<DelayedWgrad> {};

// Everything about one forward call that is not a differentiable tensor.
struct GroupedLinearConfig : torch::CustomClassHolder {
  GemmPlan plan;
  // The weights dgrad multiplies by, and their versions at forward. Kept here rather than as saved
  // variables, which cost ~0.15 us each per call (128 experts: 20 us of host time); backward still
  // refuses weights modified in place since forward, as saved variables would. Set by forward.
  std::shared_ptr<const std::vector<at::Tensor>> weights;
  std::vector<uint32_t> weight_versions;
  // The weights (biases) were passed as one [G, out, in] ([G, out]) tensor instead of G tensors.
  bool grouped_weight = false;
  bool grouped_bias = false;
  // fuse_wgrad_accumulation: weight gradients are added into these fp32 buffers (G × [out, in], or
  // one [G, out, in] with grouped_weight) instead of being returned to autograd.
  std::vector<at::Tensor> main_grads;
  // is_first_microbatch == true: the first micro-batch overwrites main-grad instead of adding.
  bool overwrite_main_grad = false;
  // delay_wgrad_compute: backward queues its weight-gradient GEMM here instead of running it.
  std::shared_ptr<WgradQueue> wgrad_queue;
  // Fused input activation (GroupedMLP's recompute_activation): the Function's input is the
  // pre-activation [rows, 2·in] and the GEMM input is glu(input, input_scales). Only the
  // pre-activation and scales are saved; backward recomputes the activation for the wgrad GEMM.
  std::optional<ops::GluOptions> input_activation;
  // The input is read through a row map (not with input_activation): the Function's input is the
  // un-gathered [input rows, in] tensor, which is also what backward keeps.
  std::optional<RowGather> input_gather;
  // The output's rows are summed into fewer rows inside the forward GEMM (16-bit plans).
  std::optional<OutputScatter> output_scatter;
  // FP8 products (the plan is an FP8 plan): forward quantizes the GEMM input and the weights,
  // backward the output gradient, and the GEMMs read the FP8 copies.
  std::optional<Fp8Config> fp8;
  // Fp8GradLink: the config takes its output gradient's copies from grad_output_link (fc1 in FP8
  // GroupedMLP, from fc2; fc2 in an FP8 MoE layer, from the unpermute); fc2's config (with
  // input_activation) leaves its input gradient's copies in grad_input_link.
  std::shared_ptr<Fp8GradLink> grad_output_link;
  std::shared_ptr<Fp8GradLink> grad_input_link;
};

// What a layer keeps across its calls for their autograd nodes.
struct GroupedLinearEdges {
  StackedGradEdge weights, biases;
};

// Each tensor's version counter, as Tensor::_version reads it but without the call through the
// autograd hooks (with 128 experts those calls were 8% of a forward's host time on a CPU).
std::vector<uint32_t> tensor_versions(at::TensorList tensors);

// The layer's output: input [rows, in] (contiguous), or [rows, 2·in] with config.input_activation,
// whose per-row scales are input_scales (else nullopt), or [input rows, in] with
// config.input_gather; weights G × [out, in] or one [G, out, in]; biases empty, G × [out] or one
// [G, out] (matching config.grouped_weight / grouped_bias). Returns [rows, out], or [output rows,
// out] with config.output_scatter. When grad mode is on and a tensor argument requires a
// gradient, the output's autograd node is a torchmoe::autograd::GroupedLinearFunction, whose
// backward computes the gradients of those that do (kept: the layer's edges, or null for
// edges made for this call alone).
at::Tensor grouped_linear(const at::Tensor& input, const std::optional<at::Tensor>& input_scales,
                          at::TensorList weights, at::TensorList biases,
                          const c10::intrusive_ptr<GroupedLinearConfig>& config,
                          GroupedLinearEdges* kept = nullptr);

// Runs one deferred weight-gradient GEMM. Returns the weight gradients in the parameter layout
// (G × [out, in], or one [G, out, in]); returns nothing when they went into config.main_grads.
std::vector<at::Tensor> run_delayed_wgrad(const DelayedWgrad& work);

}  // namespace torchmoe::autograd
