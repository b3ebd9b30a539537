// moe_lm: trains a small byte-level MoE transformer language model (model.h) from a C++ loop with
// torchmoe's MoELayer, then optionally samples text from it. Run with --help for the flags.
//
// Training: AdamW with linear warmup and cosine decay, global gradient-norm clipping, gradient
// accumulation over micro-batches. On CUDA the model computes in bf16 with fp32 master weights:
// the expert weights' gradients go straight into fp32 main-grad buffers (GroupedLinear's fused
// accumulation), the other parameters' bf16 gradients are added into fp32 buffers after each
// micro-batch, and AdamW updates fp32 masters that are copied back into the bf16 parameters.

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <fmt/os.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "model.h"

namespace fs = std::filesystem;

namespace moe_lm {
namespace {

// ---- output ----------------------------------------------------------------------------------

// Every line the run reports goes through here and is flushed at once: stdout is fully buffered
// when it is not a terminal (nohup, CI, `| tee`), and a long run would show nothing until exit.
template <typename... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
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

// ---- flags -----------------------------------------------------------------------------------

struct Flags {
  ModelConfig model;
  std::string data = "/usr/share/common-licenses";
  std::string device = "auto";
  std::string dtype = "auto";
  int64_t steps = 300;
  int64_t stop_at = 0;
  int64_t batch = 16;
  int64_t accum = 1;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  int64_t warmup = 30;
  double weight_decay = 0.1;
  double clip = 1.0;
  bool expert_bias = false;
  uint64_t seed = 1234;
  int64_t log_every = 10;
  int64_t eval_every = 100;
  int64_t eval_batches = 8;
  std::string csv;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
  int64_t generate = 0;
  std::string prompt = "The ";
  double temperature = 0.8;
  int64_t profile_moe = 0;
};

struct Flag {
  const char* name;
  const char* value;  // placeholder for the help text; nullptr for a switch
  const char* help;
  std::function<void(const std::string&)> set;
};

// A flag's value as an integer (int64_t) or a real number (double), at least `min`. The messages
// say "value": parse_flags puts the flag's name in front.
template <typename T>
T parse_number(const std::string& text, T min) {
  constexpr bool kInteger = std::is_integral_v<T>;
  size_t used = 0;
  T v{};
  try {
    if constexpr (kInteger) {
      v = std::stoll(text, &used);
    } else {
      v = std::stod(text, &used);
    }
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || !std::isfinite(static_cast<double>(v))) {
    throw std::invalid_argument(
        fmt::format("value needs {}, got '{}'", kInteger ? "an integer" : "a number", text));
  }
  if (v < min) throw std::invalid_argument(fmt::format("value must be >= {}, got {}", min, text));
  return v;
}

std::vector<Flag> flag_table(Flags& f) {
  auto integer = [](int64_t& out, int64_t min) {
    return [&out, min](const std::string& v) { out = parse_number(v, min); };
  };
  auto number = [](double& out, double min) {
    return [&out, min](const std::string& v) { out = parse_number(v, min); };
  };
  auto text = [](std::string& out) { return [&out](const std::string& v) { out = v; }; };
  return {
      {"--data", "PATH",
       "text file, or a directory whose files are concatenated (default "
       "/usr/share/common-licenses)",
       text(f.data)},
      {"--device", "auto|cpu|cuda", "where to train (default auto: cuda when available)",
       text(f.device)},
      {"--dtype", "auto|fp32|bf16",
       "compute dtype (default auto: bf16 on cuda, fp32 on cpu); masters are fp32", text(f.dtype)},
      {"--steps", "N", "optimizer steps to train to (default 300)", integer(f.steps, 0)},
      {"--stop-at", "N",
       "end this run after step N (saving with --save); the schedule still spans --steps",
       integer(f.stop_at, 1)},
      {"--batch", "N", "sequences per micro-batch (default 16)", integer(f.batch, 1)},
      {"--accum", "N", "micro-batches per optimizer step (default 1)", integer(f.accum, 1)},
      {"--seq", "N", "sequence length in bytes (default 128)", integer(f.model.seq, 2)},
      {"--layers", "N", "transformer blocks (default 4)", integer(f.model.layers, 1)},
      {"--hidden", "N", "model width (default 128)", integer(f.model.hidden, 1)},
      {"--heads", "N", "attention heads, dividing --hidden (default 4)", integer(f.model.heads, 1)},
      {"--experts", "N", "experts per MoE layer (default 8)", integer(f.model.experts, 1)},
      {"--topk", "N", "experts per token (default 2)", integer(f.model.topk, 1)},
      {"--ffn", "N", "expert hidden width (default 256)", integer(f.model.ffn, 1)},
      {"--aux-coeff", "X", "load-balancing loss coefficient (default 0.01)",
       number(f.model.aux_loss_coeff, 0)},
      {"--z-coeff", "X", "router z-loss coefficient (default 0.001)",
       number(f.model.z_loss_coeff, 0)},
      {"--expert-bias", nullptr,
       "aux-loss-free balancing: update each router's expert bias every step",
       [&f](const std::string&) { f.expert_bias = true; }},
      {"--lr", "X", "peak learning rate (default 3e-3)", number(f.lr, 0)},
      {"--min-lr-ratio", "X", "final learning rate as a fraction of --lr (default 0.1)",
       number(f.min_lr_ratio, 0)},
      {"--warmup", "N", "linear warmup steps (default 30)", integer(f.warmup, 0)},
      {"--weight-decay", "X", "AdamW weight decay on matrices (default 0.1)",
       number(f.weight_decay, 0)},
      {"--clip", "X", "global gradient-norm clip, 0 = off (default 1.0)", number(f.clip, 0)},
      {"--seed", "N", "seed for initialisation, batches and sampling (default 1234)",
       [&f](const std::string& v) { f.seed = static_cast<uint64_t>(parse_number<int64_t>(v, 0)); }},
      {"--log-every", "N", "progress line every N steps (default 10)", integer(f.log_every, 1)},
      {"--eval-every", "N", "validation every N steps, 0 = only at the end (default 100)",
       integer(f.eval_every, 0)},
      {"--eval-batches", "N", "validation micro-batches (default 8)", integer(f.eval_batches, 1)},
      {"--csv", "PATH",
       "write one CSV row per step: step, loss, aux_loss, lr, grad_norm, tokens_per_s and "
       "ms_per_step (this step), avg_tokens_per_s and avg_ms_per_step (running averages over this "
       "run's steps after its first), val_loss and val_ppl (on validation steps), load_min and "
       "load_max (expert load / uniform share); a token is a byte, losses are in nats/byte",
       text(f.csv)},
      {"--save", "PATH", "save a checkpoint at the end (and every --save-every steps)",
       text(f.save)},
      {"--save-every", "N", "with --save: also save every N steps (default 0 = end only)",
       integer(f.save_every, 0)},
      {"--resume", "PATH", "continue from a checkpoint (its model shape overrides the shape flags)",
       text(f.resume)},
      {"--generate", "N", "with --resume: print N sampled bytes after --prompt and exit",
       integer(f.generate, 1)},
      {"--prompt", "TEXT", "generation prompt (default \"The \")", text(f.prompt)},
      {"--temperature", "X", "sampling temperature, 0 = greedy (default 0.8)",
       number(f.temperature, 0)},
      {"--profile-moe", "N",
       "after training: time N MoE-layer forward+backward passes alone and report their share of a "
       "step",
       integer(f.profile_moe, 1)},
  };
}

void print_help(const std::vector<Flag>& table) {
  fmt::print(
      "usage: moe_lm [flags]\n\nTrains a byte-level MoE transformer LM with torchmoe from a C++ "
      "loop.\n\nflags:\n");
  // Help texts are wrapped to 100 columns, continuation lines indented under the first.
  constexpr size_t kIndent = 29, kWidth = 100;
  auto print_flag = [&](const std::string& left, const std::string& help) {
    std::istringstream words(help);
    std::string word, line;
    bool first = true;
    auto flush_line = [&] {
      fmt::print("  {:<26} {}\n", first ? left : "", line);
      first = false;
      line.clear();
    };
    while (words >> word) {
      if (!line.empty() && kIndent + line.size() + 1 + word.size() > kWidth) flush_line();
      line += (line.empty() ? "" : " ") + word;
    }
    flush_line();
  };
  for (const Flag& f : table)
    print_flag(std::string(f.name) + (f.value ? std::string(" ") + f.value : ""), f.help);
  print_flag("--help", "this text");
}

// Returns nullopt after --help; throws std::invalid_argument for bad flags.
std::optional<Flags> parse_flags(int argc, char** argv) {
  Flags f;
  const std::vector<Flag> table = flag_table(f);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      print_help(table);
      return std::nullopt;
    }
    const auto it =
        std::find_if(table.begin(), table.end(), [&](const Flag& fl) { return arg == fl.name; });
    if (it == table.end()) throw std::invalid_argument("unknown flag '" + arg + "' (see --help)");
    if (!it->value) {
      it->set("");
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value " + it->value);
    try {
      it->set(argv[++i]);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(arg + ": " + e.what());
    }
  }
  const ModelConfig& m = f.model;
  if (m.hidden % m.heads)
    throw std::invalid_argument(
        fmt::format("--heads {} must divide --hidden {}", m.heads, m.hidden));
  if (m.topk > m.experts)
    throw std::invalid_argument(
        fmt::format("--topk {} must be at most --experts {}", m.topk, m.experts));
  if (f.device != "auto" && f.device != "cpu" && f.device != "cuda")
    throw std::invalid_argument("--device must be auto, cpu or cuda, got '" + f.device + "'");
  if (f.dtype != "auto" && f.dtype != "fp32" && f.dtype != "bf16")
    throw std::invalid_argument("--dtype must be auto, fp32 or bf16, got '" + f.dtype + "'");
  if (f.generate && f.resume.empty())
    throw std::invalid_argument("--generate needs --resume CHECKPOINT");
  if (f.save_every && f.save.empty()) throw std::invalid_argument("--save-every needs --save PATH");
  return f;
}

// ---- data ------------------------------------------------------------------------------------

struct Corpus {
  torch::Tensor train, valid;  // int64 bytes, on the CPU
};

Corpus load_corpus(const std::string& path, int64_t seq) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::set<fs::path> seen;  // a directory may hold links to the same text
    for (const auto& entry : fs::directory_iterator(path)) {
      if (!entry.is_regular_file()) continue;
      if (seen.insert(fs::canonical(entry.path())).second) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    throw std::runtime_error("data file or directory '" + path + "' does not exist");
  }
  std::string bytes;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read '" + file.string() + "'");
    bytes.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const auto size = static_cast<int64_t>(bytes.size());
  const int64_t valid_size = size / 10;
  if (size < 20 * (seq + 1)) {  // validation (a tenth) must hold two windows
    throw std::runtime_error(fmt::format("'{}' has {} bytes; --seq {} needs at least {}", path,
                                         size, seq, 20 * (seq + 1)));
  }
  const torch::Tensor all = torch::from_blob(bytes.data(), {size}, torch::kUInt8).to(torch::kLong);
  return {all.narrow(0, 0, size - valid_size).clone(),
          all.narrow(0, size - valid_size, valid_size).clone()};
}

struct Batch {
  torch::Tensor input, target;  // [B, S] int64
};

// Windows starting at `starts`: input bytes [s, s + S), targets shifted by one.
Batch windows(const torch::Tensor& text, const torch::Tensor& starts, int64_t seq,
              const torch::Device& device) {
  const torch::Tensor idx = starts.unsqueeze(1) + torch::arange(seq + 1).unsqueeze(0);
  const torch::Tensor w = text.index_select(0, idx.reshape(-1)).view({starts.size(0), seq + 1});
  return {w.narrow(1, 0, seq).to(device), w.narrow(1, 1, seq).to(device)};
}

// The batch of (step, micro) depends on the seed and those only, so a resumed run sees the same
// data.
Batch train_batch(const Corpus& c, const Flags& f, int64_t step, int64_t micro,
                  const torch::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      f.seed * 1000003ULL + static_cast<uint64_t>(step) * 1009ULL + static_cast<uint64_t>(micro));
  const torch::Tensor starts =
      torch::randint(c.train.size(0) - f.model.seq - 1, {f.batch}, gen, torch::kLong);
  return windows(c.train, starts, f.model.seq, device);
}

// ---- mixed-precision trainer -----------------------------------------------------------------

struct Slot {
  torch::Tensor param;      // what the model computes with (bf16 or fp32)
  torch::Tensor master;     // fp32 copy AdamW updates (the parameter itself when fp32)
  torch::Tensor main_grad;  // fp32 gradient sum over micro-batches
  bool fused = false;       // GroupedLinear writes main_grad itself
};

class Trainer {
 public:
  Trainer(MoETransformer& model, const Flags& f) : model_(model), flags_(f) {
    std::map<std::string, size_t> by_name;
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& p : model->named_parameters()) {
      Slot s;
      s.param = p.value();
      s.master = p.value().scalar_type() == torch::kFloat32
                     ? p.value().detach()
                     : p.value().detach().to(torch::kFloat32).clone();
      s.main_grad = torch::zeros_like(s.master);
      by_name[p.key()] = slots_.size();
      (s.param.dim() >= 2 ? decay : no_decay).push_back(s.master);
      slots_.push_back(std::move(s));
    }
    // Hand the expert weights' main-grad buffers to their GroupedLinear layers.
    for (const auto& item : model->named_modules()) {
      auto layer = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(item.value());
      if (!layer) continue;
      std::vector<std::string> names;
      if (layer->options.single_grouped_weight()) {
        names.push_back("weight");
      } else {
        for (int64_t g = 0; g < layer->options.num_gemms(); ++g)
          names.push_back("weight" + std::to_string(g));
      }
      std::vector<torch::Tensor> buffers;
      for (const std::string& name : names) {
        Slot& s = slots_.at(by_name.at(item.key() + "." + name));
        s.fused = true;
        buffers.push_back(s.main_grad);
      }
      layer->set_main_grads(buffers);
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(
        decay,
        std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(f.lr).betas({0.9, 0.95}).weight_decay(f.weight_decay)));
    groups.emplace_back(no_decay,
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(f.lr).betas({0.9, 0.95}).weight_decay(0.0)));
    optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups));
  }

  // After each micro-batch's backward: move the non-fused gradients into the fp32 sums.
  void accumulate() {
    torch::NoGradGuard no_grad;
    for (Slot& s : slots_) {
      if (s.fused || !s.param.grad().defined()) continue;
      s.main_grad.add_(s.param.grad());
      s.param.mutable_grad().reset();
    }
  }

  // Clips, steps AdamW on the masters, copies them into the parameters, clears the sums.
  // Returns the gradient norm before clipping.
  double step(double lr) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> masters;
    for (Slot& s : slots_) {
      s.master.mutable_grad() = s.main_grad;
      masters.push_back(s.master);
    }
    const double norm = flags_.clip > 0 ? torch::nn::utils::clip_grad_norm_(masters, flags_.clip)
                                        : torch::nn::utils::clip_grad_norm_(masters, INFINITY);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    optimizer_->step();
    for (Slot& s : slots_) {
      if (!s.master.is_same(s.param)) s.param.copy_(s.master);
      s.master.mutable_grad().reset();
      s.main_grad.zero_();
    }
    return norm;
  }

  // The fp32 masters stand for the parameters (which are their casts), so a checkpoint loads
  // into any device and compute dtype. Buffers (router expert bias and load) go as they are.
  void save(torch::serialize::OutputArchive& archive) const {
    torch::serialize::OutputArchive masters, buffers, optimizer;
    for (size_t i = 0; i < slots_.size(); ++i) masters.write(std::to_string(i), slots_[i].master);
    const auto model_buffers = model_->buffers();
    for (size_t i = 0; i < model_buffers.size(); ++i)
      buffers.write(std::to_string(i), model_buffers[i]);
    optimizer_->save(optimizer);
    archive.write("masters", masters);
    archive.write("buffers", buffers);
    archive.write("optimizer", optimizer);
  }

  void load(torch::serialize::InputArchive& archive) {
    torch::serialize::InputArchive masters, buffers, optimizer;
    archive.read("masters", masters);
    archive.read("buffers", buffers);
    archive.read("optimizer", optimizer);
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < slots_.size(); ++i) {
      torch::Tensor saved;
      masters.read(std::to_string(i), saved);
      slots_[i].master.copy_(saved);
      slots_[i].param.copy_(slots_[i].master);
    }
    auto model_buffers = model_->buffers();
    for (size_t i = 0; i < model_buffers.size(); ++i) {
      torch::Tensor saved;
      buffers.read(std::to_string(i), saved);
      model_buffers[i].copy_(saved);
    }
    optimizer_->load(optimizer);
  }

 private:
  MoETransformer& model_;
  const Flags& flags_;
  std::vector<Slot> slots_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

double learning_rate(const Flags& f, int64_t step) {
  if (step < f.warmup) return f.lr * static_cast<double>(step + 1) / static_cast<double>(f.warmup);
  const double span = std::max<int64_t>(1, f.steps - f.warmup);
  const double progress = std::min(1.0, static_cast<double>(step - f.warmup) / span);
  const double min_lr = f.lr * f.min_lr_ratio;
  return min_lr + 0.5 * (f.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

torch::Tensor lm_loss(const ModelOutput& out, const torch::Tensor& target) {
  return at::cross_entropy_loss(out.logits.reshape({-1, out.logits.size(-1)}), target.reshape(-1));
}

double evaluate(MoETransformer& model, const Corpus& c, const Flags& f,
                const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  // Fixed, evenly spaced validation windows.
  const int64_t span = c.valid.size(0) - f.model.seq - 1;
  const int64_t count = f.eval_batches * f.batch;
  const torch::Tensor starts =
      torch::linspace(0, static_cast<double>(span), count).to(torch::kLong);
  double total = 0;
  for (int64_t b = 0; b < f.eval_batches; ++b) {
    const Batch batch =
        windows(c.valid, starts.narrow(0, b * f.batch, f.batch), f.model.seq, device);
    total += lm_loss(model(batch.input), batch.target).item<double>();
  }
  model->train();
  return total / static_cast<double>(f.eval_batches);
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

// The checkpoint is written to PATH.tmp, flushed to the disk, and only then renamed over PATH:
// a run killed or failing mid-save leaves the previous checkpoint as it was (and at most a
// partial PATH.tmp, which the next save overwrites).
void save_checkpoint(const std::string& path, MoETransformer& model, const Trainer& trainer,
                     int64_t step) {
  torch::serialize::OutputArchive archive;
  model->config.save(archive);
  trainer.save(archive);
  archive.write("step", c10::IValue(step));
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

// Expert load of each layer relative to uniform (T·k/E); the min and max over layers. One copy to
// the host for all layers.
std::pair<double, double> load_range(const ModelOutput& out) {
  const torch::Tensor counts =
      torch::stack(out.tokens_per_expert).to(torch::kCPU, torch::kFloat64);  // [layers, E]
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
void profile_moe(MoETransformer& model, const Flags& f, const torch::Device& device,
                 const torch::Dtype dtype, double step_ms) {
  torchmoe::MoELayer moe = model->moe_layers().at(0);
  const torch::Tensor x = torch::randn({f.batch * f.model.seq, f.model.hidden},
                                       torch::TensorOptions(dtype).device(device))
                              .requires_grad_(true);
  auto run = [&] {
    const torchmoe::MoEOutput out = moe(x);
    (out.output.to(torch::kFloat32).square().mean() + out.aux_loss).backward();
  };
  for (int i = 0; i < 3; ++i) run();
  if (device.is_cuda()) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < f.profile_moe; ++i) run();
  if (device.is_cuda()) torch::cuda::synchronize();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(f.profile_moe);
  const double share = 100.0 * ms * static_cast<double>(f.model.layers * f.accum) / step_ms;
  say(
      "moe profile: one MoE layer fwd+bwd {:.3f} ms x {} layers x {} micro-batches = {:.1f}% of a "
      "{:.1f} ms step\n",
      ms, f.model.layers, f.accum, share, step_ms);
  // The profiling passes wrote into the main-grad buffers and .grad; nothing is trained after this.
}

// The CSV's columns (documented in --csv's help and docs/moe.md).
constexpr const char* kCsvHeader =
    "step,loss,aux_loss,lr,grad_norm,tokens_per_s,ms_per_step,avg_tokens_per_s,avg_ms_per_step,"
    "val_loss,val_ppl,load_min,load_max";

// The first line of `path`, or "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

int run(const Flags& flags_in) {
  Flags f = flags_in;
  const bool cuda = f.device == "cuda" || (f.device == "auto" && torch::cuda::is_available());
  if (cuda && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda but no CUDA device is available");
  if (!f.resume.empty() && !fs::is_regular_file(f.resume))
    throw std::runtime_error("checkpoint '" + f.resume + "' does not exist");
  // Output paths are checked before any work: a run must not train for an hour and then find
  // that it cannot write its checkpoint.
  if (!f.generate) {
    if (!f.save.empty()) check_can_create("--save", f.save, f.save + ".tmp");
    if (!f.csv.empty()) check_can_create("--csv", f.csv, f.csv);
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  const torch::Dtype dtype =
      f.dtype == "bf16" || (f.dtype == "auto" && cuda) ? torch::kBFloat16 : torch::kFloat32;

  std::optional<torch::serialize::InputArchive> checkpoint;
  int64_t start_step = 0;
  if (!f.resume.empty()) {
    checkpoint.emplace();
    checkpoint->load_from(f.resume, device);
    f.model = ModelConfig::load(*checkpoint);
    c10::IValue step;
    checkpoint->read("step", step);
    start_step = step.toInt();
  }
  torch::manual_seed(f.seed);
  MoETransformer model(f.model, torch::TensorOptions(dtype).device(device));
  Trainer trainer(model, f);
  if (checkpoint) trainer.load(*checkpoint);
  if (f.generate) {
    generate(model, f, device);
    return 0;
  }
  const Corpus corpus = load_corpus(f.data, f.model.seq);

  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const ModelConfig& m = f.model;
  say("moe_lm: {} layers, hidden {}, {} heads, {} experts top-{}, ffn {}, seq {} | {:.2f}M "
      "parameters | {} {} | data {} ({} train / {} valid bytes)\n",
      m.layers, m.hidden, m.heads, m.experts, m.topk, m.ffn, m.seq, params / 1e6,
      cuda ? "cuda" : "cpu", dtype == torch::kBFloat16 ? "bf16 (fp32 masters)" : "fp32", f.data,
      corpus.train.size(0), corpus.valid.size(0));
  if (start_step) say("resumed from {} at step {}\n", f.resume, start_step);

  std::unique_ptr<fmt::ostream> csv;
  if (!f.csv.empty()) {
    // A resumed run appends to its CSV, which must then have this version's columns.
    const bool append = start_step > 0 && fs::exists(f.csv) && fs::file_size(f.csv) > 0;
    if (append && first_line(f.csv) != kCsvHeader)
      throw std::runtime_error(fmt::format(
          "--csv: '{}' has other columns than this moe_lm writes (an older version's?); give a new "
          "file",
          f.csv));
    csv = std::make_unique<fmt::ostream>(
        fmt::output_file(f.csv, append ? fmt::file::WRONLY | fmt::file::APPEND | fmt::file::CREATE
                                       : fmt::file::WRONLY | fmt::file::CREATE | fmt::file::TRUNC));
    if (!append) csv->print("{}\n", kCsvHeader);
  }

  const int64_t tokens_per_step = f.batch * f.accum * m.seq;
  double timed_ms = 0;
  int64_t timed_steps = 0;
  double last_ms = 0;
  const int64_t end_step = f.stop_at ? std::min(f.stop_at, f.steps) : f.steps;
  for (int64_t step = start_step; step < end_step; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = learning_rate(f, step);
    double loss_sum = 0, aux_sum = 0;
    std::pair<double, double> load{0, 0};
    for (int64_t micro = 0; micro < f.accum; ++micro) {
      const Batch batch = train_batch(corpus, f, step, micro, device);
      const ModelOutput out = model(batch.input);
      const torch::Tensor loss = lm_loss(out, batch.target);
      ((loss + out.aux_loss) / static_cast<double>(f.accum)).backward();
      trainer.accumulate();
      loss_sum += loss.item<double>();
      aux_sum += out.aux_loss.item<double>();
      if (micro == 0) load = load_range(out);
    }
    const double grad_norm = trainer.step(lr);
    if (f.expert_bias) {
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
    const double loss = loss_sum / static_cast<double>(f.accum),
                 aux = aux_sum / static_cast<double>(f.accum);
    const bool last = step + 1 == end_step;
    std::optional<double> val;
    if ((f.eval_every && (step + 1) % f.eval_every == 0) || last)
      val = evaluate(model, corpus, f, device);
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
      save_checkpoint(f.save, model, trainer, step + 1);
      say("  saved {} (step {})\n", f.save, step + 1);
    }
  }
  if (f.profile_moe) {
    const double step_ms = timed_steps ? timed_ms / static_cast<double>(timed_steps) : last_ms;
    profile_moe(model, f, device, dtype, step_ms);
  }
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
    // c10::Error carries a backtrace after its first line; the message is what a user needs.
    std::string message = e.what();
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
      message = c10_error->what_without_backtrace();
    moe_lm::print_error(message);
    return 1;
  }
}
