#pragma once
// moe_lm's files: the check, before any training, that an output can be created, and checkpoints:
// saved atomically, one per rank with --ep (PATH.rank<r>-of-<ranks>), resumed from (--resume),
// and an --ep run's merged into one single-process checkpoint (--merge-checkpoint).

#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <torchmoe/distributed/process_group.h>

#include <cstdint>
#include <optional>
#include <string>

#include "flags.h"
#include "model.h"
#include "trainer.h"

namespace moe_lm {

// Checks, before any training, that the file `probe` can be created in the directory `path` goes
// into: the directory exists and takes a new file. Creates `probe` and removes it again (unless it
// was there before). Throws "FLAG: ..." otherwise.
void check_can_create(const char* flag, const std::string& path, const std::string& probe);

// The file of rank `rank` of an --ep run of `ranks` ranks saving or resuming as PATH.
std::string rank_path(const std::string& path, int64_t rank, int64_t ranks);

// The checkpoint is written to PATH.tmp, flushed to the disk, and only then renamed over PATH:
// a run killed or failing mid-save leaves the previous checkpoint as it was (and at most a
// partial PATH.tmp, which the next save overwrites). With --ep, each rank saves its own file.
void save_checkpoint(const std::string& path, MoETransformer& model, const Trainer& trainer,
                     int64_t step);

// Loads the checkpoint `path` that --resume names (with --ep, this rank's file: every rank calls
// it) onto `device` into `checkpoint`, and its model's config into f.model; returns its step.
// Throws when it is missing or not this rank's, and with --ep on every rank when any rank's
// failed or the ranks' files are not of one save.
int64_t load_resume(const std::string& path, Flags& f,
                    const std::optional<torchmoe::ProcessGroupOptions>& group, int64_t rank,
                    const torch::Device& device,
                    std::optional<torch::serialize::InputArchive>& checkpoint);

// --merge-checkpoint: the per-rank files of an --ep run into one single-process checkpoint.
int merge_checkpoints(const Flags& flags_in);

}  // namespace moe_lm
