#include "torchmoe/autograd/stacked_grad_edge.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>

#include "torchmoe/ops/empty.h"

namespace torchmoe::autograd {
namespace {

using torch::autograd::variable_list;

// Hands slice g of a stacked [G, ...] gradient to edge g: the fan-out of StackedGradEdge.
class StackedGradFanOut final : public torch::autograd::Node {
 public:
  StackedGradFanOut(torch::autograd::edge_list&& edges, const at::Tensor& like)
      // The sequence number of an accumulator: the engine runs it as soon as its gradient is
      // ready, however old the node is (a layer keeps it across calls).
      : Node(UINT64_MAX, std::move(edges)) {
    std::vector<int64_t> sizes{static_cast<int64_t>(num_outputs())};
    sizes.insert(sizes.end(), like.sizes().begin(), like.sizes().end());
    add_input_metadata(like.options(), c10::fromIntArrayRefSlow(sizes),
                       /*is_tensor_subclass=*/false, /*is_nested=*/false, std::nullopt);
  }
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(num_outputs());
    // Plain aliases, made without the dispatcher and its view tracking (128 selects through it
    // took 64 us, the aliases 13, on a CPU): each becomes its weight's .grad or is added into it,
    // and the stacked tensor is not used again. unbind where that does not hold: create_graph
    // (the slices carry history), and a gradient that is not a plain strided tensor with storage
    // (one a hook replaced).
    const at::Tensor& stacked = grads[0];
    if (at::GradMode::is_enabled() || stacked.layout() != at::kStrided || !stacked.has_storage() ||
        stacked.key_set().has_any(c10::python_ks)) {
      return stacked.unbind(0);
    }
    const c10::IntArrayRef sizes = stacked.sizes().slice(1), strides = stacked.strides().slice(1);
    variable_list slices(num_outputs());
    for (size_t g = 0; g < slices.size(); ++g) {
      slices[g] = ops::alias_storage(
          stacked, stacked.scalar_type(), sizes, strides,
          stacked.storage_offset() + static_cast<int64_t>(g) * stacked.stride(0));
    }
    return slices;
  }
  std::string name() const override { return "torchmoe::autograd::StackedGradFanOut"; }
};

c10::Stream current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// A tensor's autograd state as StackedGradEdge reads it, from its metadata: no call through
// VariableHooks per tensor (which cost more than the rest of the check with 128 experts). A view
// goes the slow way: its history is made lazily.
struct GradState {
  const torch::autograd::AutogradMeta* meta = nullptr;
  bool requires_grad = false;
  bool leaf = true;
};

GradState grad_state(const at::Tensor& t) {
  GradState s;
  s.meta = torch::autograd::impl::get_autograd_meta(t);
  if (s.meta == nullptr) return s;
  if (s.meta->is_view_) {
    s.leaf = t.grad_fn() == nullptr;
    s.requires_grad = t.requires_grad();
  } else {
    s.leaf = s.meta->grad_fn_ == nullptr;
    s.requires_grad = s.meta->requires_grad_ || !s.leaf;
  }
  return s;
}

// Whether `edge` is still what autograd would make for a tensor in state `s`: a leaf's
// accumulator while it requires a gradient, else no edge. False for a tensor with history or a
// view (their edges are made per call).
bool edge_is_current(const GradState& s, const torch::autograd::Edge& edge) {
  if (s.meta == nullptr) return !edge.is_valid();
  if (!s.leaf || s.meta->is_view_) return false;
  if (!s.requires_grad) return !edge.is_valid();
  // Compared without locking the weak pointer: the edge holds the accumulator, so a match cannot
  // be a freed one's address reused.
  return edge.is_valid() && !s.meta->grad_accumulator_.owner_before(edge.function) &&
         !edge.function.owner_before(s.meta->grad_accumulator_);
}

}  // namespace

StackedGradEdge::Resolved StackedGradEdge::resolve(at::TensorList tensors, bool stacked) {
  Resolved r;
  if (tensors.empty()) return r;
  if (stacked) {
    r.requires_grad = tensors[0].requires_grad();
    if (r.requires_grad) r.edge = torch::autograd::impl::gradient_edge(tensors[0]);
    r.tensors = std::make_shared<const std::vector<at::Tensor>>(tensors.vec());
    return r;
  }
  const size_t groups = tensors.size();
  const std::lock_guard<std::mutex> lock(mutex_);
  // The kept node's input is [G, sizes] with tensor 0's sizes when it was made: the same tensors
  // now of another shape (set_data keeps their accumulators) need a new one.
  bool reuse = tensors_ != nullptr && tensors_->size() == groups &&
               (node_ == nullptr ||
                (tensors[0].sizes() == sizes_ &&
                 node_->input_metadata(0).stream() == current_stream(tensors[0].device())));
  bool leaves = true;
  for (size_t g = 0; g < groups; ++g) {
    const at::Tensor& t = tensors[g];
    // No edge for a list with an undefined tensor: the op refuses it, naming it.
    if (!t.defined()) return Resolved{{}, false, std::make_shared<const std::vector<at::Tensor>>()};
    const GradState state = grad_state(t);
    r.requires_grad |= state.requires_grad;
    leaves &= state.leaf;
    if (reuse) {
      reuse = t.unsafeGetTensorImpl() == (*tensors_)[g].unsafeGetTensorImpl() &&
              edge_is_current(state, node_ ? node_->next_edge(g) : torch::autograd::Edge());
    }
  }
  if (!reuse) {
    // Let go of the kept accumulators first: those only this held are then made anew, on the
    // current stream, as autograd makes them for a call.
    node_.reset();
    tensors_.reset();
    auto kept = std::make_shared<const std::vector<at::Tensor>>(tensors.vec());
    std::shared_ptr<torch::autograd::Node> node;
    if (r.requires_grad) {
      torch::autograd::edge_list edges;
      edges.reserve(groups);
      for (const at::Tensor& t : tensors) edges.push_back(torch::autograd::impl::gradient_edge(t));
      node = std::shared_ptr<StackedGradFanOut>(new StackedGradFanOut(std::move(edges), tensors[0]),
                                                torch::autograd::deleteNode);
    }
    if (!leaves) {  // a tensor's edge is its history: this call's alone
      r.tensors = std::move(kept);
      if (node) r.edge = torch::autograd::Edge(std::move(node), 0);
      return r;
    }
    tensors_ = std::move(kept);
    node_ = std::move(node);
    sizes_ = tensors[0].sizes().vec();
  }
  r.tensors = tensors_;
  if (node_) r.edge = torch::autograd::Edge(node_, 0);
  return r;
}

}  // namespace torchmoe::autograd
