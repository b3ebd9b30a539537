// ProcessGroupGloo from C++, with the headers a Debian machine and the torch wheel provide.
//
// The wheel ships c10d's ProcessGroupGloo.hpp and libtorch_cpu.so exports ProcessGroupGloo (and
// the gloo it bundles), but not gloo's headers, which ProcessGroupGloo.hpp includes. They come
// from Debian's libgloo-dev, an older gloo than the one inside libtorch_cpu.so, so this file uses
// them only to parse declarations and never runs or lays out anything of gloo's:
//
// - It calls two out-of-line functions of libtorch: ProcessGroupGloo::Options::create_default
//   (which makes the transport device, honouring GLOO_SOCKET_IFNAME as Python does) and the
//   ProcessGroupGloo constructor. All other use goes through c10d::Backend's virtual functions,
//   whose code (and ProcessGroupGloo's vtable: its key function is the out-of-line destructor)
//   is libtorch's, built against its own gloo.
// - The one object laid out here is the ProcessGroupGloo that make_intrusive allocates. Its
//   members are std containers, smart pointers and integers; gloo types appear only behind
//   std::shared_ptr, whose size does not depend on them, so the size agrees with libtorch's
//   whatever gloo's headers hold.
// - Nothing of gloo is instantiated here: no gloo symbol is defined or referenced, which the
//   ctest gloo_symbols checks on libtorchmoe.so. libgloo.so is never linked, so the process holds
//   one gloo, libtorch's.
//
// USE_C10D_GLOO and USE_DISTRIBUTED, which the header needs, come with torch_cpu's CMake target.

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "torchmoe/distributed/backends.h"

namespace torchmoe::distributed {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      store, rank, size, c10d::ProcessGroupGloo::Options::create_default(timeout));
}

}  // namespace torchmoe::distributed
