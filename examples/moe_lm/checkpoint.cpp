// moe_lm's output checks and checkpoints: save, resume and merge (checkpoint.h).

#include "checkpoint.h"

#include <fmt/core.h>

#include <torchmoe/distributed/collectives.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "report.h"

namespace fs = std::filesystem;

namespace moe_lm {
namespace {

// The directory a file PATH goes into ("." for a bare name).
fs::path parent_dir(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// An --ep run's checkpoint says which rank of how many saved it ("ep.rank", "ep.size"); a
// single-process one says nothing: {0, 0}.
std::pair<int64_t, int64_t> checkpoint_rank(torch::serialize::InputArchive& archive) {
  c10::IValue rank, size;
  if (!archive.try_read("ep.size", size)) return {0, 0};
  archive.read("ep.rank", rank);
  return {rank.toInt(), size.toInt()};
}

// This process's checkpoint into `checkpoint`, its config into f.model and its step into
// start_step; throws when it is missing or not this process's (with --ep, `rank`'s) file.
void load_own_checkpoint(const std::string& resume, Flags& f, bool expert_parallel, int64_t rank,
                         const torch::Device& device,
                         std::optional<torch::serialize::InputArchive>& checkpoint,
                         int64_t& start_step) {
  if (!fs::is_regular_file(resume))
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' does not exist{}", resume,
        expert_parallel
            ? fmt::format(" (--ep {} resumes from the files an --ep {} run saved as PATH, one "
                          "per rank: PATH.rank<r>-of-{})",
                          f.ep, f.ep, f.ep)
            : ""));
  checkpoint.emplace();
  checkpoint->load_from(resume, device);
  f.model = ModelConfig::load(*checkpoint);
  c10::IValue step;
  checkpoint->read("step", step);
  start_step = step.toInt();
  const auto [saved_rank, saved_ranks] = checkpoint_rank(*checkpoint);
  if (saved_ranks && !expert_parallel)
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' is rank {}'s file of an --ep {} run: resume it with --ep {} under "
        "torchrun, or merge the files into one with --merge-checkpoint",
        resume, saved_rank, saved_ranks, saved_ranks));
  if (expert_parallel && (saved_ranks != f.ep || saved_rank != rank))
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' must be rank {}'s file of an --ep {} run, got {}", resume, rank, f.ep,
        saved_ranks ? fmt::format("rank {} of --ep {}", saved_rank, saved_ranks)
                    : "a single-process checkpoint"));
}

}  // namespace

void check_can_create(const char* flag, const std::string& path, const std::string& probe) {
  const fs::path dir = parent_dir(path);
  std::error_code ec;
  auto fail = [&](const std::string& why) {
    throw std::runtime_error(fmt::format("{}: cannot write '{}': {}", flag, path, why));
  };
  if (!fs::exists(dir, ec)) fail(fmt::format("directory '{}' does not exist", dir.string()));
  if (!fs::is_directory(dir, ec)) fail(fmt::format("'{}' is not a directory", dir.string()));
  if (fs::is_directory(path, ec)) fail("it is a directory");
  const bool existed = fs::exists(probe, ec);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    fail(probe == path ? std::string(std::strerror(err))
                       : fmt::format("cannot create '{}': {}", probe, std::strerror(err)));
  }
  ::close(fd);
  if (!existed) fs::remove(probe, ec);
}

std::string rank_path(const std::string& path, int64_t rank, int64_t ranks) {
  return fmt::format("{}.rank{}-of-{}", path, rank, ranks);
}

void save_checkpoint(const std::string& path, MoETransformer& model, const Trainer& trainer,
                     int64_t step) {
  torch::serialize::OutputArchive archive;
  model->config.save(archive);
  trainer.save(archive);
  archive.write("step", c10::IValue(step));
  if (model->expert_parallel) {
    const c10d::ProcessGroup& group = *model->expert_parallel->group();
    archive.write("ep.rank", c10::IValue(static_cast<int64_t>(group.getRank())));
    archive.write("ep.size", c10::IValue(static_cast<int64_t>(group.getSize())));
  }
  const std::string tmp = path + ".tmp";
  // save_to returns once the archive's last record is written and the file is closed; it throws
  // on a failed write.
  archive.save_to(tmp);
  // Through a power loss too: the data reaches the disk before the rename can.
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(
        fmt::format("--save: cannot flush '{}' to the disk: {}", tmp, std::strerror(err)));
  }
  ::close(fd);
  fs::rename(tmp, path);
  // Make the rename itself durable (best effort: some file systems refuse fsync on directories).
  const int dir_fd = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

int64_t load_resume(const std::string& path, Flags& f,
                    const std::optional<torchmoe::ProcessGroupOptions>& group, int64_t rank,
                    const torch::Device& device,
                    std::optional<torch::serialize::InputArchive>& checkpoint) {
  int64_t start_step = 0;
  if (!group) {
    load_own_checkpoint(path, f, false, rank, device, checkpoint, start_step);
    return start_step;
  }
  // Every rank learns, in one collective, whether all could load their files and whether the
  // files are of one save (a run killed while saving can leave files of different steps, whose
  // schedules, optimizer steps and data would drift apart): a rank that stopped alone would leave
  // the others waiting in their first collective until the timeout. The steps are all equal
  // exactly when their squares' sum is the square of their sum over ep.
  std::string error;
  try {
    load_own_checkpoint(path, f, true, rank, device, checkpoint, start_step);
  } catch (const std::exception& e) {
    error = e.what();
  }
  torch::Tensor sums =
      torch::tensor({start_step, start_step * start_step, static_cast<int64_t>(!error.empty())},
                    torch::TensorOptions(torch::kLong).device(device));
  torchmoe::distributed::all_reduce_sum_(sums, *group);
  const torch::Tensor host = sums.cpu();
  const int64_t sum = host[0].item<int64_t>(), squares = host[1].item<int64_t>();
  const int64_t failed = host[2].item<int64_t>();
  if (!error.empty()) throw std::runtime_error(error);
  if (failed > 0)
    throw std::runtime_error(fmt::format(
        "--resume: {} of the {} ranks could not load their files (their errors say why)", failed,
        f.ep));
  if (f.ep * squares != sum * sum)
    throw std::runtime_error(fmt::format(
        "--resume: the ranks' files must be of one save, got step {} here and a mean of {} "
        "over the {} ranks",
        start_step, static_cast<double>(sum) / static_cast<double>(f.ep), f.ep));
  return start_step;
}

int merge_checkpoints(const Flags& flags_in) {
  Flags f = flags_in;
  check_can_create("--save", f.save, f.save + ".tmp");
  std::vector<torch::serialize::InputArchive> ranks(f.ep);
  int64_t step = 0;
  for (int64_t r = 0; r < f.ep; ++r) {
    const std::string path = rank_path(f.merge_checkpoint, r, f.ep);
    if (!fs::is_regular_file(path))
      throw std::runtime_error(fmt::format("--merge-checkpoint: '{}' does not exist", path));
    ranks[r].load_from(path, torch::kCPU);
    const auto [rank, size] = checkpoint_rank(ranks[r]);
    if (rank != r || size != f.ep)
      throw std::runtime_error(fmt::format(
          "--merge-checkpoint: '{}' must hold rank {} of an --ep {} run, got {}", path, r, f.ep,
          size ? fmt::format("rank {} of --ep {}", rank, size) : "a single-process checkpoint"));
    c10::IValue saved_step;
    ranks[r].read("step", saved_step);
    if (r > 0 && saved_step.toInt() != step)
      throw std::runtime_error(fmt::format(
          "--merge-checkpoint: '{}' is from step {}, rank 0's from step {}: files of different "
          "saves",
          path, saved_step.toInt(), step));
    step = saved_step.toInt();
  }
  f.model = ModelConfig::load(ranks[0]);
  MoETransformer model(f.model, torch::TensorOptions(torch::kFloat32));
  Trainer trainer(model, f);
  trainer.load_merged(ranks);
  save_checkpoint(f.save, model, trainer, step);
  say("merged {}.rank<r>-of-{} into {} (step {})\n", f.merge_checkpoint, f.ep, f.save, step);
  return 0;
}

}  // namespace moe_lm
