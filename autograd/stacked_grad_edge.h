#pragma once
// One autograd edge for the gradients of G tensors of one shape, computed stacked.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <mutex>
#include <vector>

namespace torchmoe::autograd {

// The autograd edge of a parameter list's gradients (a layer's G weights, or its G biases),
// which backward computes stacked, [G, ...]: one [G, ...] parameter's own edge, or for G separate
// tensors a node that hands slice g of the stacked gradient to tensor g's accumulator. Backward so
// has one slot per list instead of one per tensor, and a layer keeps the node and the tensors
// across calls: an autograd node with 2·G inputs cost ~0.3 us per tensor per call (G accumulator
// nodes made and freed, G edges and their metadata). The kept node is reused while each tensor is
// the same leaf with the same accumulator, requires_grad and shape, on the same stream.
class StackedGradEdge {
 public:
  struct Resolved {
    torch::autograd::Edge edge;  // invalid when no tensor requires a gradient
    bool requires_grad = false;  // some tensor requires one
    // The tensors, shared with the layer while they are the ones it keeps (backward's dgrad reads
    // the weights without each call copying G tensor handles).
    std::shared_ptr<const std::vector<at::Tensor>> tensors;
  };
  // `tensors` is one [G, ...] tensor when `stacked`, else G tensors of one shape.
  Resolved resolve(at::TensorList tensors, bool stacked);

 private:
  std::mutex mutex_;                             // a layer called from two threads at once
  std::shared_ptr<torch::autograd::Node> node_;  // the separate tensors' fan-out
  std::shared_ptr<const std::vector<at::Tensor>> tensors_;
  std::vector<int64_t> sizes_;  // tensor 0's, when node_ was made
};

}  // namespace torchmoe::autograd
