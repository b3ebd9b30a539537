// Builds against the installed headers and library only, and trains one step. torchmoe.h alone
// brings what a GroupedLinear step needs (torch/torch.h would double this test's compile time).
#include <torchmoe/torchmoe.h>

#include <iostream>

int main() {
  torchmoe::GroupedLinear layer(torchmoe::GroupedLinearOptions(3, 16, 8));
  const torch::Tensor x = torch::randn({10, 16});
  const torch::Tensor y = layer(x, std::vector<int64_t>{4, 0, 6});
  y.square().sum().backward();
  const bool ok = y.sizes() == torch::IntArrayRef({10, 8}) &&
                  layer->named_parameters()["weight2"].grad().defined();
  std::cout << layer << (ok ? " consumer OK" : " consumer FAILED") << std::endl;
  return ok ? 0 : 1;
}
