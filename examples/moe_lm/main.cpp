// moe_lm: trains a small byte-level MoE transformer language model (model.h) from a C++ loop with
// torchmoe's MoELayer, then optionally samples text from it. Run with --help for the flags.
//
// Training: AdamW with linear warmup and cosine decay, global gradient-norm clipping, gradient
// accumulation over micro-batches; on CUDA in bf16 with fp32 master weights (trainer.h).
//
// With --ep N it runs as the N processes torchrun launches, experts sharded over them and the
// other parameters trained data-parallel (trainer.h); rank 0 reports for all.
//
// This file holds the entry: the run's setup from its flags (device, process group, resume, the
// model) and what it then does. flags.h holds the flags, data.h the corpus and its batches,
// train_loop.h the loop and step.h its micro-batches, trainer.h the optimizer, checkpoint.h the
// output checks and checkpoints, evaluate.h validation, generation and --profile-moe, report.h
// the output lines and the CSV.

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/core.h>
#include <fmt/os.h>
#include <torch/cuda.h>
#include <torch/serialize/archive.h>

#include <torchmoe/distributed/process_group.h>
#include <torchmoe/fp8/recipe.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "checkpoint.h"
#include "data.h"
#include "evaluate.h"
#include "flags.h"
#include "model.h"
#include "report.h"
#include "step.h"
#include "train_loop.h"
#include "trainer.h"

namespace moe_lm {
namespace {

// The process group of an --ep run, from torchrun's environment (GPU LOCAL_RANK on CUDA).
torchmoe::ProcessGroupOptions expert_parallel_group(const Flags& f, bool cuda) {
  const char* world = std::getenv("WORLD_SIZE");
  if (!world || std::string(world) != std::to_string(f.ep))
    throw std::runtime_error(
        fmt::format("--ep {0} runs as {0} processes launched by torchrun (torchrun --no-python "
                    "--nproc-per-node {0} moe_lm --ep {0} ...), so WORLD_SIZE must be {0}, got {1}",
                    f.ep, world ? fmt::format("WORLD_SIZE={}", world) : "no WORLD_SIZE"));
  return torchmoe::distributed::init_process_group(cuda ? torch::kCUDA : torch::kCPU);
}

// Output paths are checked before any work: a run must not train for an hour and then find that
// it cannot write its checkpoint (`save`, this process's file). Only rank 0 writes the CSV and the
// trace. So are the flags that need CUDA.
void check_before_work(const Flags& f, const std::string& save, bool cuda) {
  if (!f.generate) {
    if (!save.empty()) check_can_create("--save", save, save + ".tmp");
    if (!f.csv.empty() && reporting()) check_can_create("--csv", f.csv, f.csv);
  }
  if (f.cuda_graph && !cuda)
    throw std::runtime_error("--cuda-graph needs CUDA, but no CUDA device is available");
  if (!f.fp8.empty() && !cuda)
    throw std::runtime_error(
        "--fp8 needs CUDA (FP8 GEMMs are CUDA only), but no CUDA device is available");
  if (!f.generate && !f.trace.empty() && reporting()) check_can_create("--trace", f.trace, f.trace);
}

// The run's first lines: the model, the device and the data; --ep's split; the resumed step.
void say_run(const MoETransformer& model, const Flags& f, const Corpus& corpus, bool cuda,
             torch::Dtype dtype, bool expert_parallel, int64_t start_step) {
  // The whole model's: with --ep the other ranks hold as many expert parameters as this one.
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  for (const auto& moe : model->moe_layers()) {
    for (const auto& p : moe->experts->parameters()) params += (f.ranks() - 1) * p.numel();
  }
  const ModelConfig& m = f.model;
  say("moe_lm: {} layers, hidden {}, {} heads, {} experts top-{} ({} block), ffn {}, seq {} | "
      "{:.2f}M parameters | {} {} | data {} ({} train / {} valid bytes)\n",
      m.layers, m.hidden, m.heads, m.experts, m.topk, m.moe_block, m.ffn, m.seq, params / 1e6,
      cuda ? "cuda" : "cpu", dtype == torch::kBFloat16 ? "bf16 (fp32 masters)" : "fp32", f.data,
      corpus.train.size(0), corpus.valid.size(0));
  if (expert_parallel)
    say("expert parallel over {} ranks: {} experts and {} sequences of each micro-batch per rank\n",
        f.ep, m.experts / f.ep, f.batch / f.ep);
  if (start_step) say("resumed from {} at step {}\n", f.resume, start_step);
}

int run(const Flags& flags_in) {
  Flags f = flags_in;
  if (!f.merge_checkpoint.empty()) return merge_checkpoints(f);
  const bool cuda = f.device == "cuda" || (f.device == "auto" && torch::cuda::is_available());
  if (cuda && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda but no CUDA device is available");
  std::optional<torchmoe::ProcessGroupOptions> group;
  if (f.ep) group = expert_parallel_group(f, cuda);
  const int64_t rank = group ? group->group()->getRank() : 0;
  set_reporting(rank == 0);
  // With --ep every rank saves and resumes its own file.
  const auto own_file = [&](const std::string& path) {
    return group ? rank_path(path, rank, f.ep) : path;
  };
  const std::string resume = f.resume.empty() ? "" : own_file(f.resume);
  const std::string save = f.save.empty() ? "" : own_file(f.save);
  check_before_work(f, save, cuda);
  // A captured stream cannot be the legacy default one, and every step must be ordered with the
  // captured work, so with --cuda-graph the whole run, from the model's creation on, uses one
  // side stream.
  std::optional<c10::cuda::CUDAStreamGuard> side_stream;
  if (f.cuda_graph) side_stream.emplace(c10::cuda::getStreamFromPool());
  // init_process_group made GPU LOCAL_RANK the current device.
  const torch::Device device =
      cuda ? torch::Device(torch::kCUDA, c10::cuda::current_device()) : torch::Device(torch::kCPU);
  const torch::Dtype dtype =
      f.dtype == "bf16" || (f.dtype == "auto" && cuda) ? torch::kBFloat16 : torch::kFloat32;

  std::optional<torch::serialize::InputArchive> checkpoint;
  const int64_t start_step =
      resume.empty() ? 0 : load_resume(resume, f, group, rank, device, checkpoint);
  const int64_t end_step = f.stop_at ? std::min(f.stop_at, f.steps) : f.steps;
  if (!f.generate && end_step <= start_step)
    throw std::runtime_error(fmt::format(
        "nothing to train: the checkpoint is at step {}, and --steps {}{} ends there or before",
        start_step, f.steps, f.stop_at ? fmt::format(" --stop-at {}", f.stop_at) : ""));
  torch::manual_seed(f.seed);
  // --fp8 delayed: the experts keep amax histories of the recipe's length (TE's default 1024).
  const int64_t fp8_history =
      f.fp8 == "delayed" ? torchmoe::fp8::DelayedScaling().amax_history_len() : 0;
  MoETransformer model(f.model, torch::TensorOptions(dtype).device(device), group, fp8_history);
  Trainer trainer(model, f);
  if (checkpoint) trainer.load(*checkpoint);
  if (f.generate) {
    generate(model, f, device);
    return 0;
  }
  const Corpus corpus = load_corpus(f.data, f.model.seq);
  say_run(model, f, corpus, cuda, dtype, group.has_value(), start_step);

  std::unique_ptr<fmt::ostream> csv;
  if (!f.csv.empty() && reporting()) csv = open_csv(f.csv, start_step);
  const TrainContext context{device, cuda, rank, group.has_value(), save, start_step, end_step};
  const double step_ms = train(model, trainer, corpus, f, context, csv.get());
  if (f.profile_moe) profile_moe(model, trainer, f, device, dtype, step_ms);
  // NCCL warns at exit about a process group that was not shut down (its communicators would
  // otherwise be torn down during static destruction).
  if (group) group->group()->shutdown();
  return 0;
}

}  // namespace
}  // namespace moe_lm

int main(int argc, char** argv) {
  std::optional<moe_lm::Flags> flags;
  try {
    flags = moe_lm::parse_flags(argc, argv);
  } catch (const std::invalid_argument& e) {
    moe_lm::print_error(e.what());
    return 2;
  }
  if (!flags) return 0;
  try {
    return moe_lm::run(*flags);
  } catch (const std::exception& e) {
    // Under torchrun every rank reports its own error.
    const char* rank = flags->ep ? std::getenv("RANK") : nullptr;
    moe_lm::print_error((rank ? fmt::format("rank {}: ", rank) : std::string()) +
                        moe_lm::error_message(e));
    return 1;
  }
}
