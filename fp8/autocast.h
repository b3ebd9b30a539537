#pragma once
// Turning FP8 on for a region of a C++ training loop: an RAII guard, as te.fp8_autocast /
// te.autocast in Python and at::autocast's guards in LibTorch. docs/fp8.md, "Turning FP8 on in a
// C++ loop", says why a guard and not a module option.

#include <optional>

#include "torchmoe/fp8/recipe.h"

namespace torchmoe::fp8 {

/// Sets this thread's FP8 recipe for its lifetime and restores the previous one when destroyed.
/// Nestable: an inner guard overrides an outer one, and `Autocast(false)` turns FP8 off inside an
/// enabled region. Thread-local: other threads, including the autograd engine's backward threads,
/// do not see it (the FP8 forward copies the recipe into its autograd node). Guards must be
/// destroyed in reverse order of construction, as scopes do.
///
/// Example:
/// ```
/// const auto recipe = torchmoe::fp8::DelayedScaling().amax_history_len(16);
/// {
///   torchmoe::fp8::Autocast fp8(recipe);
///   loss = criterion(model->forward(x), target);
/// }
/// loss.backward();  // FP8 where the forward was, whatever the backward thread's state
/// ```
class Autocast {
 public:
  /// FP8 with `recipe` (checked here) when enabled; FP8 off otherwise.
  explicit Autocast(const Recipe& recipe, bool enabled = true);
  /// FP8 with the default recipe (DelayedScaling(), TE's default on Hopper) when enabled; FP8 off
  /// otherwise.
  explicit Autocast(bool enabled);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;
  Autocast(Autocast&&) = delete;
  Autocast& operator=(Autocast&&) = delete;

 private:
  std::optional<Recipe> previous_;
};

/// The recipe set by this thread's innermost Autocast; nullopt outside any, or inside a disabled
/// one.
std::optional<Recipe> current();
/// Whether FP8 is on for this thread: current().has_value().
bool enabled();

}  // namespace torchmoe::fp8
