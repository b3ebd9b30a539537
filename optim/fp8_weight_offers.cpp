#include "torchmoe/optim/fp8_weight_offers.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchmoe::optim::detail {
namespace {

struct Offer {
  std::weak_ptr<const void> alive;
  std::function<Fp8WeightTarget()> make;
};

struct Offers {
  std::mutex mutex;
  std::unordered_map<const void*, Offer> offers;       // by layer
  std::unordered_map<const void*, const void*> holds;  // layer -> holder
  std::atomic<uint64_t> version{1};
};

// Never destroyed: an optimizer in a static may release its holds after other statics are gone.
Offers& offers() {
  static Offers* instance = new Offers;
  return *instance;
}

}  // namespace

void offer_fp8_weights(const void* layer, std::weak_ptr<const void> alive,
                       std::function<Fp8WeightTarget()> make) {
  Offers& o = offers();
  const std::lock_guard<std::mutex> lock(o.mutex);
  o.offers[layer] = {std::move(alive), std::move(make)};
  ++o.version;
}

uint64_t fp8_weight_offers_version() { return offers().version.load(); }

std::vector<Fp8WeightTarget> open_fp8_weight_offers() {
  Offers& o = offers();
  std::vector<std::function<Fp8WeightTarget()>> open;
  {
    const std::lock_guard<std::mutex> lock(o.mutex);
    for (auto it = o.offers.begin(); it != o.offers.end();) {
      // An expired offer goes: its address may become another layer's.
      if (it->second.alive.expired()) {
        it = o.offers.erase(it);
        continue;
      }
      if (o.holds.count(it->first) == 0) open.push_back(it->second.make);
      ++it;
    }
  }
  std::vector<Fp8WeightTarget> targets;
  for (const auto& make : open) {
    Fp8WeightTarget target = make();
    if (target.layer != nullptr) targets.push_back(std::move(target));
  }
  return targets;
}

bool hold_fp8_weights(const void* holder, const void* layer) {
  Offers& o = offers();
  const std::lock_guard<std::mutex> lock(o.mutex);
  const auto [it, inserted] = o.holds.emplace(layer, holder);
  return inserted || it->second == holder;
}

std::shared_ptr<const void> make_fp8_weight_holder() {
  return std::shared_ptr<const char>(new char, [](const char* holder) {
    Offers& o = offers();
    {
      const std::lock_guard<std::mutex> lock(o.mutex);
      for (auto it = o.holds.begin(); it != o.holds.end();) {
        it = it->second == holder ? o.holds.erase(it) : std::next(it);
      }
      ++o.version;
    }
    delete holder;
  });
}

}  // namespace torchmoe::optim::detail
