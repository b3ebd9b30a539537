#pragma once
// C++ objects kept in a Function's context beside its saved tensors. The context's saved data
// holds IValues under string keys, so an object rides in one capsule: a link shared between two
// Functions (an Fp8GradLink, a RouterGradLink), whose backwards hand data through it, or an
// options struct kept whole. Each entry costs host time on every call (a CPU host: five entries
// ~0.7 µs, one capsule ~0.1 µs), so a struct is one entry, not one per field.

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <utility>

namespace torchmoe::autograd {
namespace detail {

template <typename T>
struct ValueHolder : torch::CustomClassHolder {
  explicit ValueHolder(T v) : value(std::move(v)) {}
  T value;
};

constexpr const char* kSavedLinkKey = "grad_link";

// The object save_value kept under `key`, or null.
template <typename T>
const T* find_saved_value(torch::autograd::AutogradContext* ctx, const char* key) {
  const auto found = ctx->saved_data.find(key);
  if (found == ctx->saved_data.end()) return nullptr;
  // The capsule in ctx keeps the holder alive as long as ctx.
  return &static_cast<const ValueHolder<T>*>(found->second.toCapsule().get())->value;
}

}  // namespace detail

// Keeps a copy of `value` in ctx under `key`.
template <typename T>
void save_value(torch::autograd::AutogradContext* ctx, const char* key, T value) {
  ctx->saved_data[key] =
      c10::IValue::make_capsule(c10::make_intrusive<detail::ValueHolder<T>>(std::move(value)));
}

// The value save_value<T> kept in ctx under `key`.
template <typename T>
const T& saved_value(torch::autograd::AutogradContext* ctx, const char* key) {
  const T* value = detail::find_saved_value<T>(ctx, key);
  TORCH_INTERNAL_ASSERT(value != nullptr, "saved_value: no value saved under ", key);
  return *value;
}

// Keeps `link` in ctx (nothing when it is null).
template <typename Link>
void save_link(torch::autograd::AutogradContext* ctx, std::shared_ptr<Link> link) {
  if (link) save_value(ctx, detail::kSavedLinkKey, std::move(link));
}

// The link save_link kept in ctx, or null.
template <typename Link>
std::shared_ptr<Link> saved_link(torch::autograd::AutogradContext* ctx) {
  const auto* link = detail::find_saved_value<std::shared_ptr<Link>>(ctx, detail::kSavedLinkKey);
  return link ? *link : nullptr;
}

}  // namespace torchmoe::autograd
