// fp8::Autocast: nesting, restoration, disabling inside an enabled region, and thread-locality.

#include <torchmoe/fp8/autocast.h>

#include <catch2/catch.hpp>

#include <optional>
#include <thread>

using namespace torchmoe::fp8;
using Catch::Matchers::Contains;

namespace {

// The history length of the current DelayedScaling recipe, 0 for another recipe, -1 without one.
int64_t current_history_len() {
  const std::optional<Recipe> recipe = current();
  if (!recipe) return -1;
  const auto* delayed = std::get_if<DelayedScaling>(&*recipe);
  return delayed ? delayed->amax_history_len() : 0;
}

}  // namespace

TEST_CASE("fp8::Autocast nests and restores the previous recipe", "[fp8][autocast]") {
  REQUIRE_FALSE(enabled());
  REQUIRE_FALSE(current().has_value());
  {
    Autocast outer(DelayedScaling().amax_history_len(16));
    CHECK(enabled());
    CHECK(current_history_len() == 16);
    {
      Autocast inner{CurrentScaling()};
      REQUIRE(current().has_value());
      CHECK(std::holds_alternative<CurrentScaling>(*current()));
      {
        Autocast off(BlockScaling(), /*enabled=*/false);
        CHECK_FALSE(enabled());
        {
          Autocast again(DelayedScaling().amax_history_len(4));
          CHECK(current_history_len() == 4);
        }
        CHECK_FALSE(enabled());
      }
      CHECK(std::holds_alternative<CurrentScaling>(*current()));
      {
        Autocast off(false);
        CHECK_FALSE(enabled());
      }
      CHECK(enabled());
    }
    CHECK(current_history_len() == 16);
  }
  CHECK_FALSE(enabled());
  {
    Autocast on(true);  // the default recipe
    CHECK(current_history_len() == DelayedScaling().amax_history_len());
  }
  CHECK_FALSE(enabled());
}

TEST_CASE("fp8::Autocast restores the recipe when an exception leaves its scope",
          "[fp8][autocast]") {
  try {
    Autocast guard{CurrentScaling()};
    throw std::runtime_error("step failed");
  } catch (const std::runtime_error&) {
  }
  CHECK_FALSE(enabled());
}

TEST_CASE("fp8::Autocast rejects an invalid recipe and changes nothing",
          "[fp8][autocast][errors]") {
  Autocast outer{CurrentScaling()};
  const BlockScaling two_tiles = BlockScaling().grad_block(BlockShape::k128x128);
  CHECK_THROWS_WITH(Autocast(two_tiles), Contains("BlockScaling: at most one of"));
  CHECK(std::holds_alternative<CurrentScaling>(*current()));
  // A disabled guard does not check the recipe it is given, as nothing will use it.
  CHECK_NOTHROW(Autocast(two_tiles, /*enabled=*/false));
  CHECK(enabled());
}

TEST_CASE("fp8::Autocast is thread-local", "[fp8][autocast]") {
  Autocast guard(DelayedScaling().amax_history_len(8));
  bool other_enabled = true;
  int64_t other_inner = 0;
  std::thread other([&] {
    other_enabled = enabled();
    Autocast own(DelayedScaling().amax_history_len(2));
    other_inner = current_history_len();
  });
  other.join();
  CHECK_FALSE(other_enabled);
  CHECK(other_inner == 2);
  CHECK(current_history_len() == 8);
}
