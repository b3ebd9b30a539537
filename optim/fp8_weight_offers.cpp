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

struct Hold {
  const void* holder = nullptr;
  bool by_hand = false;
};

struct Offers {
  std::mutex mutex;
  std::unordered_map<const void*, Offer> offers;  // by layer
  std::unordered_map<const void*, Hold> holds;    // by layer
  std::atomic<uint64_t> version{1};

  // Under the mutex: an expired offer goes, as its address may become another layer's.
  void erase_expired() {
    for (auto it = offers.begin(); it != offers.end();) {
      it = it->second.alive.expired() ? offers.erase(it) : std::next(it);
    }
  }
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
  o.erase_expired();
  o.offers[layer] = {std::move(alive), std::move(make)};
  ++o.version;
}

uint64_t fp8_weight_offers_version() { return offers().version.load(); }

std::vector<Fp8WeightTarget> open_fp8_weight_offers() {
  Offers& o = offers();
  std::vector<std::function<Fp8WeightTarget()>> open;
  {
    const std::lock_guard<std::mutex> lock(o.mutex);
    o.erase_expired();
    for (const auto& [layer, offer] : o.offers) {
      if (o.holds.count(layer) == 0) open.push_back(offer.make);
    }
  }
  // Built outside the lock: a layer's call may take locks of its own.
  std::vector<Fp8WeightTarget> targets;
  for (const auto& make : open) {
    Fp8WeightTarget target = make();
    if (target.layer != nullptr) targets.push_back(std::move(target));
  }
  return targets;
}

bool hold_fp8_weights(const void* holder, const void* layer, bool by_hand) {
  Offers& o = offers();
  const std::lock_guard<std::mutex> lock(o.mutex);
  const auto [it, inserted] = o.holds.emplace(layer, Hold{holder, by_hand});
  if (inserted) return true;
  if (it->second.holder == holder) {
    it->second.by_hand |= by_hand;
    return true;
  }
  if (it->second.by_hand || !by_hand) return false;
  it->second = {holder, by_hand};
  ++o.version;  // the previous holder lets the layer go at its next step
  return true;
}

bool holds_fp8_weights(const void* holder, const void* layer) {
  Offers& o = offers();
  const std::lock_guard<std::mutex> lock(o.mutex);
  const auto it = o.holds.find(layer);
  return it != o.holds.end() && it->second.holder == holder;
}

void release_fp8_weights(const void* holder, const void* layer) {
  Offers& o = offers();
  const std::lock_guard<std::mutex> lock(o.mutex);
  const auto it = o.holds.find(layer);
  if (it == o.holds.end() || it->second.holder != holder) return;
  o.holds.erase(it);
  ++o.version;
}

std::shared_ptr<const void> make_fp8_weight_holder() {
  return std::shared_ptr<const char>(new char, [](const char* holder) {
    Offers& o = offers();
    {
      const std::lock_guard<std::mutex> lock(o.mutex);
      bool released = false;
      for (auto it = o.holds.begin(); it != o.holds.end();) {
        const bool mine = it->second.holder == holder;
        released |= mine;
        it = mine ? o.holds.erase(it) : std::next(it);
      }
      if (released) ++o.version;
    }
    delete holder;
  });
}

}  // namespace torchmoe::optim::detail
