#include "torchmoe/fp8/autocast.h"

#include <utility>

namespace torchmoe::fp8 {
namespace {

// Per thread, as TE's FP8GlobalStateManager is per process but Python runs a training loop on one
// thread: two C++ threads training two models must not see each other's recipe.
thread_local std::optional<Recipe> tls_recipe;

}  // namespace

Autocast::Autocast(const Recipe& recipe, bool enabled) : previous_(tls_recipe) {
  if (enabled) {
    validate(recipe);
    tls_recipe = recipe;
  } else {
    tls_recipe.reset();
  }
}

Autocast::Autocast(bool enabled) : Autocast(Recipe(DelayedScaling()), enabled) {}

Autocast::~Autocast() { tls_recipe = std::move(previous_); }

std::optional<Recipe> current() { return tls_recipe; }

bool enabled() { return tls_recipe.has_value(); }

}  // namespace torchmoe::fp8
