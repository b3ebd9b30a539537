// The test runner. ctest runs one process per test case, as many at once as there are cores
// (-j $(nproc)): one intra-op thread per process keeps them from oversubscribing the cores, which
// made ATen-heavy CPU cases many times slower under ctest than alone.
#define CATCH_CONFIG_RUNNER
#include <ATen/Parallel.h>
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  at::set_num_threads(1);
  return Catch::Session().run(argc, argv);
}
