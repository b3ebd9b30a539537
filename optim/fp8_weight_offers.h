#pragma once
// Layers offering their FP8 weights to whichever FusedAdamW steps them (GroupedLinearOptions::
// fp8_weights_from_optimizer): a layer whose forward under DelayedScaling finds no current
// optimizer-written copies offers its Fp8WeightTarget here once, and a FusedAdamW that holds all of
// the layer's weights takes it at its next step, as set_fp8_weights would. One optimizer writes a
// layer at a time: the one that holds it, until that optimizer is destroyed or releases it, or
// another is given the layer by hand (set_fp8_weights) while it holds it from an offer. Internal,
// not installed.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "torchmoe/optim/fp8_weight_target.h"

namespace torchmoe::optim::detail {

/// The layer `layer` (its targets' Fp8WeightTarget::layer) offers the target `make` builds while
/// `alive` has not expired.
void offer_fp8_weights(const void* layer, std::weak_ptr<const void> alive,
                       std::function<Fp8WeightTarget()> make);

/// Moves whenever an offer is made or a hold ends: an optimizer that has looked at the offers
/// since need not look again.
uint64_t fp8_weight_offers_version();

/// The targets of the offers that no optimizer holds (a `make` may give a target without a layer,
/// for one that can no longer be offered: left out).
std::vector<Fp8WeightTarget> open_fp8_weight_offers();

/// Holds `layer` for `holder`. False when another holder has it, unless that one took it from an
/// offer and this one is given it `by_hand`: then the hold moves.
bool hold_fp8_weights(const void* holder, const void* layer, bool by_hand);

/// Whether `holder` holds `layer`.
bool holds_fp8_weights(const void* holder, const void* layer);

/// Ends `holder`'s hold on `layer`, if it has one.
void release_fp8_weights(const void* holder, const void* layer);

/// A holder's identity: when the last copy goes, so do its holds.
std::shared_ptr<const void> make_fp8_weight_holder();

}  // namespace torchmoe::optim::detail
