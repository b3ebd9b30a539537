// moe_lm: trains a small byte-level MoE transformer language model (model.h) from a C++ loop with
// torchmoe's MoELayer, then optionally samples text from it. Run with --help for the flags.
//
// Training: AdamW with linear warmup and cosine decay, global gradient-norm clipping, gradient
// accumulation over micro-batches; on CUDA in bf16 with fp32 master weights (trainer.h).
//
// With --ep N it runs as the N processes torchrun launches, experts sharded over them and the
// other parameters trained data-parallel (trainer.h); rank 0 reports for all.
//
// This file holds the run loop, checkpoints (per rank with --ep, and their merge), progress
// lines and the CSV, generation and --profile-moe; flags.h the flags, data.h the corpus and its
// batches, trainer.h the optimizer.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/core.h>
#include <fmt/os.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "data.h"
#include "flags.h"
#include "model.h"
#include "step.h"
#include "trainer.h"

namespace fs = std::filesystem;

namespace moe_lm {
namespace {

// ---- output ----------------------------------------------------------------------------------

// False on the ranks other than 0 of an --ep run: rank 0 reports for all of them.
bool reporting = true;

// Every line the run reports goes through here and is flushed at once: stdout is fully buffered
// when it is not a terminal (nohup, CI, `| tee`), and a long run would show nothing until exit.
template <typename... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
  if (!reporting) return;
  fmt::print(stdout, format, std::forward<Args>(args)...);
  std::fflush(stdout);
}

// Errors go to stderr with every line prefixed "moe_lm: " (a c10::Error's message may hold
// several lines).
void print_error(const std::string& message) {
  std::istringstream lines(message);
  std::string line;
  bool any = false;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    fmt::print(stderr, "moe_lm: {}\n", line);
    any = true;
  }
  if (!any) fmt::print(stderr, "moe_lm: unknown error\n");
}

// ---- training --------------------------------------------------------------------------------

// The sum over the ranks of an --ep run of a value each has (the value itself without --ep).
// Every rank must call it.
torch::Tensor rank_sum(const torch::Tensor& value, const MoETransformer& model) {
  if (!model->expert_parallel) return value;
  torch::Tensor sum = value.detach().clone();
  torchmoe::distributed::all_reduce_sum_(sum, *model->expert_parallel);
  return sum;
}

// With --ep every rank evaluates its part of each batch (the MoE layers need all ranks), and the
// mean of the parts' means is the batch's.
double evaluate(MoETransformer& model, const Corpus& c, const Flags& f, int64_t rank,
                const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  // Fixed, evenly spaced validation windows.
  const int64_t span = c.valid.size(0) - f.model.seq - 1;
  const int64_t count = f.eval_batches * f.batch;
  const torch::Tensor starts =
      torch::linspace(0, static_cast<double>(span), count).to(torch::kLong);
  torch::Tensor total = torch::zeros({}, torch::TensorOptions(torch::kFloat32).device(device));
  for (int64_t b = 0; b < f.eval_batches; ++b) {
    const Batch batch =
        windows(c.valid, rank_part(starts, b * f.batch, f.batch, f, rank), f.model.seq, device);
    total += lm_loss(model(batch.input), batch.target);
  }
  model->train();
  return rank_sum(total, model).item<double>() / static_cast<double>(f.eval_batches * f.ranks());
}

// ---- output files ----------------------------------------------------------------------------

// The directory a file PATH goes into ("." for a bare name).
fs::path parent_dir(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// Checks, before any training, that the file `probe` can be created in the directory `path` goes
// into: the directory exists and takes a new file. Creates `probe` and removes it again (unless it
// was there before). Throws "FLAG: ..." otherwise.
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

// The file of rank `rank` of an --ep run of `ranks` ranks saving or resuming as PATH.
std::string rank_path(const std::string& path, int64_t rank, int64_t ranks) {
  return fmt::format("{}.rank{}-of-{}", path, rank, ranks);
}

// An --ep run's checkpoint says which rank of how many saved it ("ep.rank", "ep.size"); a
// single-process one says nothing: {0, 0}.
std::pair<int64_t, int64_t> checkpoint_rank(torch::serialize::InputArchive& archive) {
  c10::IValue rank, size;
  if (!archive.try_read("ep.size", size)) return {0, 0};
  archive.read("ep.rank", rank);
  return {rank.toInt(), size.toInt()};
}

// The checkpoint is written to PATH.tmp, flushed to the disk, and only then renamed over PATH:
// a run killed or failing mid-save leaves the previous checkpoint as it was (and at most a
// partial PATH.tmp, which the next save overwrites). With --ep, each rank saves its own file.
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

std::string format_eta(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

// Expert load of each layer relative to uniform (T·k/E) from counts [layers, E]; the min and max
// over layers. One copy to the host for all layers.
std::pair<double, double> load_range(const torch::Tensor& loads) {
  const torch::Tensor counts = loads.to(torch::kCPU, torch::kFloat64);
  const torch::Tensor mean = counts.mean(1, true);
  const torch::Tensor used = (mean > 0).squeeze(1);
  if (!used.any().item<bool>()) return {0.0, 0.0};
  const torch::Tensor share = (counts / mean).index({used});
  return {share.min().item<double>(), share.max().item<double>()};
}

void generate(MoETransformer& model, const Flags& f, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(f.seed);
  std::vector<int64_t> context(f.prompt.begin(), f.prompt.end());
  for (int64_t& b : context) b = static_cast<uint8_t>(b);
  if (context.empty()) context.push_back('\n');
  std::string text = f.prompt;
  for (int64_t i = 0; i < f.generate; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(context.size()), model->config.seq);
    const torch::Tensor input =
        torch::tensor(std::vector<int64_t>(context.end() - n, context.end()))
            .view({1, n})
            .to(device);
    const torch::Tensor logits = model(input).logits[0][n - 1].to(torch::kCPU);
    int64_t next = 0;
    if (f.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      next = torch::multinomial(torch::softmax(logits / f.temperature, 0), 1, false, gen)
                 .item<int64_t>();
    }
    context.push_back(next);
    text.push_back(static_cast<char>(next));
  }
  say("{}\n", text);
}

// Times forward+backward of one MoE layer alone at the training shape (unit-RMS random input)
// and reports layers · that time as a share of the measured step time.
// Times `n` calls of fn (after 3 untimed ones), synchronising the device around them; ms per call.
template <typename Fn>
double time_ms(int64_t n, const torch::Device& device, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  if (device.is_cuda()) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) fn();
  if (device.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(n);
}

void profile_moe(MoETransformer& model, Trainer& trainer, const Flags& f,
                 const torch::Device& device, const torch::Dtype dtype, double step_ms) {
  torchmoe::MoELayer moe = model->moe_layers().at(0);
  // A rank's tokens: --batch / --ep sequences with --ep.
  const torch::Tensor x = torch::randn({f.batch / f.ranks() * f.model.seq, f.model.hidden},
                                       torch::TensorOptions(dtype).device(device))
                              .requires_grad_(true);
  const double ms = time_ms(f.profile_moe, device, [&] {
    const torchmoe::MoEOutput out = moe(x);
    (out.output.to(torch::kFloat32).square().mean() + out.aux_loss).backward();
  });
  const double share = 100.0 * ms * static_cast<double>(f.model.layers * f.accum) / step_ms;
  say("moe profile: one MoE layer fwd+bwd {:.3f} ms x {} layers x {} micro-batches = {:.1f}% of a "
      "{:.1f} ms step\n",
      ms, f.model.layers, f.accum, share, step_ms);
  // The optimizer step: gradient norm, clip, AdamW on the masters and their bf16 copies, and the
  // clearing of the gradient sums (with its host read of the norm).
  const double step_only = time_ms(f.profile_moe, device, [&] { trainer.step(0.0); });
  say("moe profile: optimizer step {:.3f} ms = {:.1f}% of a {:.1f} ms step\n", step_only,
      100.0 * step_only / step_ms, step_ms);
  // The profiling passes wrote into the main-grad buffers, .grad and the optimizer state (with a
  // learning rate of 0); nothing is trained after this.
}

// The CSV's columns (documented in --csv's help and docs/moe.md).
constexpr const char* kCsvHeader =
    "step,loss,aux_loss,lr,grad_norm,tokens_per_s,ms_per_step,avg_tokens_per_s,avg_ms_per_step,"
    "val_loss,val_ppl,load_min,load_max";

// The first line of `path`, or "" when it cannot be read.
// A resumed run's CSV: its rows up to the checkpoint's step, the ones a run from an earlier
// checkpoint wrote past it dropped (the resumed run writes those steps again). Replaced through
// a temporary file, as checkpoints are. Throws when the header is not this version's.
void keep_csv_rows_through(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  if (line != kCsvHeader)
    throw std::runtime_error(fmt::format(
        "--csv: '{}' has other columns than this moe_lm writes (an older version's?); give a new "
        "file",
        path));
  std::string kept = line + "\n";
  while (std::getline(in, line)) {
    if (std::strtoll(line.c_str(), nullptr, 10) <= step) kept += line + "\n";
  }
  in.close();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    if (!out.flush()) throw std::runtime_error(fmt::format("--csv: could not write '{}'", tmp));
  }
  fs::rename(tmp, path);
}

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

// --merge-checkpoint: the per-rank files of an --ep run into one single-process checkpoint.
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

int run(const Flags& flags_in) {
  Flags f = flags_in;
  if (!f.merge_checkpoint.empty()) return merge_checkpoints(f);
  const bool cuda = f.device == "cuda" || (f.device == "auto" && torch::cuda::is_available());
  if (cuda && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda but no CUDA device is available");
  std::optional<torchmoe::ProcessGroupOptions> group;
  if (f.ep) group = expert_parallel_group(f, cuda);
  const int64_t rank = group ? group->group()->getRank() : 0;
  reporting = rank == 0;
  // With --ep every rank saves and resumes its own file.
  const auto own_file = [&](const std::string& path) {
    return group ? rank_path(path, rank, f.ep) : path;
  };
  const std::string resume = f.resume.empty() ? "" : own_file(f.resume);
  const std::string save = f.save.empty() ? "" : own_file(f.save);
  // Output paths are checked before any work: a run must not train for an hour and then find
  // that it cannot write its checkpoint. Only rank 0 writes the CSV and the trace.
  if (!f.generate) {
    if (!save.empty()) check_can_create("--save", save, save + ".tmp");
    if (!f.csv.empty() && reporting) check_can_create("--csv", f.csv, f.csv);
  }
  if (f.cuda_graph && !cuda)
    throw std::runtime_error("--cuda-graph needs CUDA, but no CUDA device is available");
  if (!f.fp8.empty() && !cuda)
    throw std::runtime_error(
        "--fp8 needs CUDA (FP8 GEMMs are CUDA only), but no CUDA device is available");
  if (!f.generate && !f.trace.empty() && reporting) check_can_create("--trace", f.trace, f.trace);
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
  int64_t start_step = 0;
  const auto load_resume = [&] {
    if (!fs::is_regular_file(resume))
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' does not exist{}", resume,
          group ? fmt::format(" (--ep {} resumes from the files an --ep {} run saved as PATH, one "
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
    if (saved_ranks && !group)
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' is rank {}'s file of an --ep {} run: resume it with --ep {} under "
          "torchrun, or merge the files into one with --merge-checkpoint",
          resume, saved_rank, saved_ranks, saved_ranks));
    if (group && (saved_ranks != f.ep || saved_rank != rank))
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' must be rank {}'s file of an --ep {} run, got {}", resume, rank, f.ep,
          saved_ranks ? fmt::format("rank {} of --ep {}", saved_rank, saved_ranks)
                      : "a single-process checkpoint"));
  };
  if (!resume.empty() && !group) load_resume();
  const int64_t end_step = f.stop_at ? std::min(f.stop_at, f.steps) : f.steps;
  if (!resume.empty() && group) {
    // Every rank learns, in one collective, whether all could load their files and whether the
    // files are of one save (a run killed while saving can leave files of different steps, whose
    // schedules, optimizer steps and data would drift apart): a rank that stopped alone would leave
    // the others waiting in their first collective until the timeout. The steps are all equal
    // exactly when their squares' sum is the square of their sum over ep.
    std::string error;
    try {
      load_resume();
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
  }
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
  if (group)
    say("expert parallel over {} ranks: {} experts and {} sequences of each micro-batch per rank\n",
        f.ep, m.experts / f.ep, f.batch / f.ep);
  if (start_step) say("resumed from {} at step {}\n", f.resume, start_step);

  std::unique_ptr<fmt::ostream> csv;
  if (!f.csv.empty() && reporting) {
    // A resumed run appends to its CSV, which must then have this version's columns.
    const bool append = start_step > 0 && fs::exists(f.csv) && fs::file_size(f.csv) > 0;
    if (append) keep_csv_rows_through(f.csv, start_step);
    csv = std::make_unique<fmt::ostream>(
        fmt::output_file(f.csv, append ? fmt::file::WRONLY | fmt::file::APPEND | fmt::file::CREATE
                                       : fmt::file::WRONLY | fmt::file::CREATE | fmt::file::TRUNC));
    if (!append) csv->print("{}\n", kCsvHeader);
  }

  MicroBatchRunner runner(model, trainer, f);
  if (f.cuda_graph)
    say("cuda graph: steps from {} replay one captured micro-batch\n",
        start_step + MicroBatchRunner::kEagerSteps + 1);
  const int64_t tokens_per_step = f.batch * f.accum * m.seq;
  double timed_ms = 0;
  int64_t timed_steps = 0;
  double last_ms = 0;
  // --trace records steps [trace_begin, trace_end): from the run's 10th, or as late as fits.
  const int64_t trace_begin =
      std::max(start_step, std::min(start_step + 9, end_step - f.trace_steps));
  const int64_t trace_end = std::min(end_step, trace_begin + f.trace_steps);
  namespace profiler = torch::autograd::profiler;
  const profiler::ProfilerConfig trace_config(torch::profiler::impl::ProfilerState::KINETO);
  std::set<torch::profiler::impl::ActivityType> trace_activities{
      torch::profiler::impl::ActivityType::CPU};
  if (cuda) trace_activities.insert(torch::profiler::impl::ActivityType::CUDA);
  const bool tracing = !f.trace.empty() && reporting;
  for (int64_t step = start_step; step < end_step; ++step) {
    if (tracing && step == trace_begin) {
      profiler::prepareProfiler(trace_config, trace_activities);
      profiler::enableProfiler(trace_config, trace_activities);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = learning_rate(f, step);
    // The losses and the first micro-batch's loads stay on the device until the step's one
    // host read (the gradient norm in trainer.step) has waited for the GPU anyway.
    torch::Tensor loss_sum, aux_sum, loads;
    for (int64_t micro = 0; micro < f.accum; ++micro) {
      const Batch batch = train_batch(corpus, f, step, micro, rank, device);
      const MicroBatchResult r = runner.run(batch, step - start_step, micro);
      loss_sum = micro == 0 ? r.loss.clone() : loss_sum + r.loss;
      aux_sum = micro == 0 ? r.aux_loss.clone() : aux_sum + r.aux_loss;
      if (micro == 0) loads = torch::stack(r.tokens_per_expert);  // [layers, E]
    }
    runner.finish_step();
    const double grad_norm = trainer.step(lr);
    if (f.model.expert_bias) {
      for (auto& moe : model->moe_layers()) moe->router->update_expert_bias();
    }
    if (cuda) torch::cuda::synchronize();
    last_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (step > start_step) {  // the first step includes one-time setup
      timed_ms += last_ms;
      ++timed_steps;
    }
    // Running average over this run's steps after its first (which includes one-time setup);
    // on the first step, that step's time.
    const double avg_ms = timed_steps ? timed_ms / static_cast<double>(timed_steps) : last_ms;
    // With --ep: the LM loss is the mean of the ranks' (their parts are equal), the router losses
    // the sum of their shares.
    const torch::Tensor sums = rank_sum(torch::stack({loss_sum, aux_sum}), model);
    const double loss = sums[0].item<double>() / static_cast<double>(f.accum * f.ranks()),
                 aux = sums[1].item<double>() / static_cast<double>(f.accum);
    const std::pair<double, double> load = load_range(loads);
    if (tracing && step + 1 == trace_end) {
      profiler::disableProfiler()->save(f.trace);
      say("  trace of steps {}-{} written to {}\n", trace_begin + 1, trace_end, f.trace);
    }
    const bool last = step + 1 == end_step;
    std::optional<double> val;
    if ((f.eval_every && (step + 1) % f.eval_every == 0) || last)
      val = evaluate(model, corpus, f, rank, device);
    const double tok_s = static_cast<double>(tokens_per_step) / (last_ms / 1000.0);
    const double avg_tok_s = static_cast<double>(tokens_per_step) / (avg_ms / 1000.0);
    if ((step + 1) % f.log_every == 0 || step == start_step || last) {
      say("step {:>5}/{} | loss {:.4f} | aux {:.4f} | lr {:.2e} | {:>9.0f} avg tok/s | {:>7.1f} "
          "avg ms/step | ETA {} | load min {:.2f} max {:.2f}\n",
          step + 1, f.steps, loss, aux, lr, avg_tok_s, avg_ms,
          format_eta(avg_ms / 1000.0 * static_cast<double>(end_step - step - 1)), load.first,
          load.second);
    }
    if (val) say("  validation | loss {:.4f} | perplexity {:.2f}\n", *val, std::exp(*val));
    if (csv) {
      csv->print("{},{:.6f},{:.6f},{:.6e},{:.4f},{:.1f},{:.2f},{:.1f},{:.2f},{},{},{:.4f},{:.4f}\n",
                 step + 1, loss, aux, lr, grad_norm, tok_s, last_ms, avg_tok_s, avg_ms,
                 val ? fmt::format("{:.6f}", *val) : "",
                 val ? fmt::format("{:.4f}", std::exp(*val)) : "", load.first, load.second);
      csv->flush();
    }
    if (!f.save.empty() && (last || (f.save_every && (step + 1) % f.save_every == 0))) {
      save_checkpoint(save, model, trainer, step + 1);
      say("  saved {} (step {})\n", group ? f.save + fmt::format(".rank<r>-of-{}", f.ep) : f.save,
          step + 1);
    }
  }
  if (f.profile_moe) {
    const double step_ms = timed_steps ? timed_ms / static_cast<double>(timed_steps) : last_ms;
    profile_moe(model, trainer, f, device, dtype, step_ms);
  }
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
