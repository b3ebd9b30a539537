#pragma once
// A link object shared between two Functions (an Fp8GradLink, a RouterGradLink), kept in one
// Function's context so that its backward can hand data to, or take it from, the other's. The
// context's saved data holds IValues, so the shared_ptr rides in a capsule.

#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <utility>

namespace torchmoe::autograd {
namespace detail {

template <typename Link>
struct LinkHolder : torch::CustomClassHolder {
  std::shared_ptr<Link> link;
};

constexpr const char* kSavedLinkKey = "grad_link";

}  // namespace detail

// Keeps `link` in ctx (nothing when it is null).
template <typename Link>
void save_link(torch::autograd::AutogradContext* ctx, std::shared_ptr<Link> link) {
  if (!link) return;
  auto holder = c10::make_intrusive<detail::LinkHolder<Link>>();
  holder->link = std::move(link);
  ctx->saved_data[detail::kSavedLinkKey] = c10::IValue::make_capsule(std::move(holder));
}

// The link save_link kept in ctx, or null.
template <typename Link>
std::shared_ptr<Link> saved_link(torch::autograd::AutogradContext* ctx) {
  const auto found = ctx->saved_data.find(detail::kSavedLinkKey);
  if (found == ctx->saved_data.end()) return nullptr;
  return c10::static_intrusive_pointer_cast<detail::LinkHolder<Link>>(found->second.toCapsule())
      ->link;
}

}  // namespace torchmoe::autograd
