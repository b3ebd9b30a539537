#pragma once
// Grouped GEMM ops: the three products of a grouped linear layer over row-splits of one input.
//
// This layer validates arguments, allocates outputs and makes the one device/dtype/backend decision
// per layer call (plan_grouped_gemms); the kernels below it see raw pointers only. Group g owns
// rows [offset_g, offset_g + m_splits[g]) of every row-grouped operand,
// offset_g = Σ_{h<g} m_splits[h].
//
// A plan carries the split sizes every GEMM of the call reads: host sizes are checked to sum to
// the rows once, when planning. Device sizes are read by the sm90 kernel itself (no device-to-host
// copy, CUDA-graph safe) and cannot be checked without a sync: there each group is clamped to the
// buffer (a sum above the row count truncates the last groups; negative sizes count as 0), and
// rows past the last group are neither read nor written, which is what capacity-padded inputs
// need. Backends that need host sizes get them copied to the host once, when planning.
//
// Gathered input (forward and wgrad): instead of a [rows, in] input, a layer may read an input of
// any row count through `gather_rows` ([rows] int32 or int64 on the input's device): row i of the
// grouped operand is input[gather_rows[i]]. An MoE layer passes its tokens and routing map this
// way, so that the expert-ordered copy of the tokens is never written nor kept for backward. The
// sm90 kernel loads the rows through the map; the other backends gather a copy first
// (input.index_select(0, gather_rows)), which is the reference. The map's entries must be rows of
// the input or -1 (a zero row: a padding row); they are not checked (that would need a
// device-to-host copy).
//
// Scattered output (forward and dgrad): instead of a [rows, ·] output, a layer may add each row
// of its product into a row of a smaller one through a RowScatter: output[t] = Σ product[i] over
// the rows i with scatter.rows[i] = t (zeros where none lands). An MoE layer sums each token's
// expert rows this way inside fc2's forward (the unpermute) and fc1's dgrad (the permutation's
// backward), so that the expert-ordered rows are never written. The sm90 kernel adds each row in
// L2 with one rounding per add: with at most two rows per output row (top-1 and top-2 routing)
// the result does not depend on the order in which they land (zero plus a is a, and the adds
// commute), and it is their sum rounded once, what ops::unpermute_rows gives (its fp32 sum of two
// 16-bit values, rounded, is that: fp32 has more than twice their precision plus two bits); with
// more, the rounding order varies from run to run. The other backends compute the rows and add them
// with index_add_. Entries are rows of the output or -1 (not added), unchecked as gather_rows' are.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "torchmoe/ops/fp8_options.h"
#include "torchmoe/ops/types.h"

namespace torchmoe::ops {

// G per-group tensors of one shape: one stacked [G, ...] tensor (a single grouped weight, or
// gradient buffers allocated in one piece) or G separate tensors; none (size 0) for "no bias".
// Separate tensors are referenced, not copied: the list must outlive this view.
class GroupedTensors {
 public:
  GroupedTensors() = default;
  GroupedTensors(at::TensorList separate) : separate_(separate) {}
  GroupedTensors(const std::vector<at::Tensor>& separate) : separate_(separate) {}
  static GroupedTensors stacked(const at::Tensor& all);

  size_t size() const;
  bool empty() const { return size() == 0; }
  bool is_stacked() const { return stacked_.defined(); }
  const at::Tensor& stacked_tensor() const { return stacked_; }
  at::TensorList separate() const { return separate_; }
  // Group g's tensor (a view into the stacked tensor).
  at::Tensor operator[](size_t g) const;

 private:
  at::Tensor stacked_;
  at::TensorList separate_;
};

// What a plan looks at besides the input's device and dtype: one layer's GEMM shape.
struct GemmShape {
  int64_t n = 0;  // out_features
  int64_t k = 0;  // in_features
  size_t groups = 0;
  // The layer's persistent tensors (weights, biases, main-grad buffers) all start on 16-byte
  // boundaries. Activations need not: an sm90 GEMM copies an unaligned one first.
  bool aligned = true;
};

// The decision of one layer call, carried to every GEMM of its forward and backward.
struct GemmPlan {
  // Per product; never kAuto (see plan_grouped_gemms).
  GemmBackend backend = GemmBackend::kReference;  // fprop
  GemmBackend dgrad_backend = GemmBackend::kReference;
  GemmBackend wgrad_backend = GemmBackend::kReference;
  GemmShape shape;
  // Set: the products run in FP8 (ops/grouped_gemm_fp8.h), their operands quantized with these
  // options and accumulated as they say. Unset: 16-bit (or fp32, fp64 on the CPU) products.
  std::optional<Fp8GemmOptions> fp8;
  // How the layer meets a routing map, decided with the backends (an MoE layer's data path:
  // "Gathered input" and "Scattered output" above). Every backend takes gather_rows and a
  // RowScatter; these say where doing so costs no copy of the rows:
  //   gathers_rows: forward (and wgrad) read the input through gather_rows as they load it (the
  //     16-bit sm90 kernel; in FP8 the input's quantize gathers, on every backend);
  //   forward_scatters, dgrad_scatters: forward's output, dgrad's input gradient rows are added
  //     through a RowScatter inside the GEMM (the 16-bit sm90 kernel).
  bool gathers_rows = false;
  bool forward_scatters = false;
  bool dgrad_scatters = false;
  int64_t rows = 0;  // rows of every row-grouped operand (input, output, grad_output)
  at::ScalarType dtype = at::kFloat;  // of every operand but fp32 gradient buffers
  c10::Device device{c10::kCPU};
  // Host sizes (checked against rows) when a product runs on kReference or kCublasLt (copied from
  // the device once, when planning, if only device sizes were given); device sizes when one runs
  // on kSm90 or kCublasLtGrouped (uploaded once when only host sizes were given). Both when both
  // are needed or at hand.
  SplitSizes m_splits{std::vector<int64_t>{}};
};

// One plan per shape, for layers that share `input`'s rows and split sizes (GroupedMLP's fc1 and
// fc2 plan together). Checks the split sizes (count, device, dtype; sum and signs on the host) and
// copies them between host and device at most once for all layers. The decision table, per
// product (fprop, dgrad, wgrad):
//   CPU, floating dtype                      -> kReference (a forced CUDA backend is an error)
//   forced kCublasLt / kSm90 / kCublasLtGrouped
//                                            -> that backend for all three products, or
//                                               NotImplementedError with its refusal
//   CUDA, kAuto: the first of the product's preference list that can run the call
//     bf16/fp16:  kSm90, kCublasLtGrouped, kCublasLt   (measured: docs/performance.md)
//     fp32:       kCublasLt
//   anything else                            -> NotImplementedError
// kSm90 runs sm_90 devices with n and k multiples of 8, at most 1024 groups, aligned persistent
// tensors; kCublasLtGrouped needs a loaded cuBLASLt >= 13.8 on sm_90+, n and k multiples of 8.
// `op` names the caller in error messages (e.g. "GroupedLinear"). When the first layer reads
// `input` through gather_rows (defined), the plans' rows are gather_rows' length, not input's.
// fp8: plans the FP8 products (ops/grouped_gemm_fp8.h) of operands quantized with these options
// (fp8::gemm_options makes them from a recipe). The layer's backend, whose table is
//   CUDA fp32/fp16/bf16, sm_89+, n and k multiples of 16:
//     kAuto, host sizes and experts of >= 2^24 weight elements
//                                            -> kCublasLt (measured faster there)
//     kSm90, or kAuto where the sm90 kernel can run the call (as above, any floating dtype)
//                                            -> kSm90, or the forced backend's refusal
//     kCublasLtGrouped, or kAuto where the grouped matmul can run the call
//                                            -> kCublasLtGrouped, or the forced backend's refusal
//     kCublasLt, or kAuto otherwise          -> kCublasLt (per-group FP8 matmuls, host sizes)
//   (TORCHMOE_GROUPED_GEMM_BACKEND overrides kAuto here too)
//   anything else                            -> NotImplementedError
// then runs each product where it takes the product's operands, else per group (kCublasLt): the
// sm90 kernel takes per-tensor scales and BlockScaling's default blocks (1x128 activations and
// gradients with 128x128 weights) with e4m3 weights, the grouped matmul per-tensor scales. A
// product that runs per group reads host sizes, copied from the device here, once, when only
// device sizes were given: the plan says what it runs, and its ops never decide again.
std::vector<GemmPlan> plan_grouped_gemms(const char* op, const at::Tensor& input,
                                         c10::ArrayRef<GemmShape> shapes,
                                         const SplitSizes& m_splits, GemmBackend choice,
                                         const at::Tensor& gather_rows = {},
                                         const std::optional<Fp8GemmOptions>& fp8 = std::nullopt);

// Where forward and dgrad put their rows (see "Scattered output" above); undefined rows: row i of
// the product is row i of the output.
struct RowScatter {
  at::Tensor rows;          // [plan rows] int32/int64 on the output's device, contiguous
  int64_t target_rows = 0;  // rows of the output
  bool defined() const { return rows.defined(); }
};

// y[rows of g] = x[rows of g] · W_gᵀ + b_g.
//   input [rows, in] contiguous, or with gather_rows [rows] any [source rows, in] read through it
//   (see above); weights: G × [out, in]; biases: none or G × [out].
// Returns y [rows, out] in the input's dtype, or [scatter.target_rows, out] with the rows added
// through `scatter`.
at::Tensor grouped_linear_forward(const GemmPlan& plan, const at::Tensor& input,
                                  const GroupedTensors& weights, const GroupedTensors& biases,
                                  const at::Tensor& gather_rows = {},
                                  const RowScatter& scatter = {});

// dx[rows of g] = dy[rows of g] · W_g. grad_output [rows, out]; returns dx [rows, in], or
// [scatter.target_rows, in] with the rows added through `scatter`.
at::Tensor grouped_linear_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                                const GroupedTensors& weights, const RowScatter& scatter = {});

// dW_g = dy_gᵀ · x_g into the caller's buffers (the module's gradients or fp32 main-grad):
//   weight_grads_out: G × [out, in] of the input's dtype or float32; overwritten, or added to
//   when `accumulate` (fp32/fp64 buffers only; an empty group then leaves its buffer untouched,
//   else zero-fills it).
//   bias_grads_out: none or G × [out] of the input's dtype, always overwritten with Σ_rows dy_g.
//   gather_rows: as in grouped_linear_forward (x_g is then the gathered rows of g).
void grouped_linear_wgrad(const GemmPlan& plan, const at::Tensor& input,
                          const at::Tensor& grad_output, const GroupedTensors& weight_grads_out,
                          bool accumulate, const GroupedTensors& bias_grads_out,
                          const at::Tensor& gather_rows = {});

// db_g = Σ_rows dy_g into bias_grads_out (G × [out]); used when the wgrad GEMM is deferred.
void grouped_bias_grad(const GemmPlan& plan, const at::Tensor& grad_output,
                       const GroupedTensors& bias_grads_out);

}  // namespace torchmoe::ops
