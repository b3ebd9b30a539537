// moe_lm's flag table, number parsing, help text and parse_flags with its checks.

#include "flags.h"

#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace moe_lm {
namespace {

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
  // Reals reach the model as float32: a larger one would fail far from its flag, or diverge.
  if (!kInteger && std::abs(static_cast<double>(v)) > std::numeric_limits<float>::max()) {
    throw std::invalid_argument(fmt::format("value must fit a float32, got {}", text));
  }
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
      {"--steps", "N", "optimizer steps to train to (default 300)", integer(f.steps, 1)},
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
      {"--moe-block", "NAME",
       "the MoE layers' routing and expert rules: mixtral (default), olmoe, qwen3, qwen2, "
       "deepseek-v3, gpt-oss or llama4 (docs/moe.md)",
       text(f.model.moe_block)},
      {"--expert-bias", nullptr,
       "aux-loss-free balancing: update each router's expert bias every step",
       [&f](const std::string&) { f.model.expert_bias = true; }},
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
       "after training: time N MoE-layer forward+backward passes alone, and N optimizer steps, "
       "and report their shares of a step",
       integer(f.profile_moe, 1)},
      {"--cuda-graph", nullptr,
       "capture each micro-batch's forward and backward as a CUDA graph after 3 eager steps and "
       "replay it (CUDA with sm_90 grouped GEMMs)",
       [&f](const std::string&) { f.cuda_graph = true; }},
      {"--trace", "PATH",
       "write a Kineto (chrome://tracing JSON) trace of --trace-steps steps from the 10th of this "
       "run; scripts/trace_summary.py sums its GPU time by part",
       text(f.trace)},
      {"--trace-steps", "N", "steps --trace records (default 5)", integer(f.trace_steps, 1)},
      {"--fp8", "RECIPE",
       "train the experts' GEMMs in FP8 with TransformerEngine's recipe delayed (amax history "
       "1024), current or block scaling (CUDA; docs/fp8.md); the rest of the model stays in "
       "--dtype",
       [&f](const std::string& v) {
         if (v.empty()) throw std::invalid_argument("value must be delayed, current or block");
         f.fp8 = v;
       }},
      {"--ep", "N",
       "expert parallelism over the N processes torchrun launches (WORLD_SIZE = N): each holds "
       "--experts / N experts of every MoE layer and trains on --batch / N sequences of every "
       "micro-batch, with the other parameters replicated; --save and --resume use one file per "
       "rank, PATH.rank<r>-of-<N>",
       integer(f.ep, 1)},
      {"--merge-checkpoint", "PATH",
       "with --ep N and --save OUT, in one process (no torchrun): merge the checkpoint files "
       "PATH.rank<r>-of-<N> of an --ep N run into the single-process checkpoint OUT, then exit",
       text(f.merge_checkpoint)},
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

}  // namespace

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
  const std::vector<std::string>& blocks = moe_blocks();
  if (std::find(blocks.begin(), blocks.end(), m.moe_block) == blocks.end())
    throw std::invalid_argument(fmt::format("--moe-block must be one of {}, got '{}'",
                                            fmt::join(blocks, ", "), m.moe_block));
  if (f.device != "auto" && f.device != "cpu" && f.device != "cuda")
    throw std::invalid_argument("--device must be auto, cpu or cuda, got '" + f.device + "'");
  if (f.dtype != "auto" && f.dtype != "fp32" && f.dtype != "bf16")
    throw std::invalid_argument("--dtype must be auto, fp32 or bf16, got '" + f.dtype + "'");
  if (f.generate && f.resume.empty())
    throw std::invalid_argument("--generate needs --resume CHECKPOINT");
  if (f.save_every && f.save.empty()) throw std::invalid_argument("--save-every needs --save PATH");
  if (f.cuda_graph && f.device == "cpu")
    throw std::invalid_argument("--cuda-graph needs --device cuda (or auto with a GPU)");
  if (f.min_lr_ratio > 1)
    throw std::invalid_argument(
        fmt::format("--min-lr-ratio must be at most 1 (the final rate is at most --lr), got {}",
                    f.min_lr_ratio));
  if (f.stop_at > f.steps)
    throw std::invalid_argument(fmt::format(
        "--stop-at ({}) must be at most --steps ({}), the schedule's end", f.stop_at, f.steps));
  if (!f.fp8.empty() && f.fp8 != "delayed" && f.fp8 != "current" && f.fp8 != "block")
    throw std::invalid_argument("--fp8 must be delayed, current or block, got '" + f.fp8 + "'");
  if (!f.fp8.empty() && f.device == "cpu")
    throw std::invalid_argument(
        "--fp8 needs --device cuda (or auto with a GPU): FP8 GEMMs are CUDA only");
  if (!f.merge_checkpoint.empty() && (!f.ep || f.save.empty()))
    throw std::invalid_argument(
        "--merge-checkpoint needs --ep N (the run's number of ranks) and --save OUT");
  if (f.ep && f.merge_checkpoint.empty()) {
    // A resumed run's shape is its checkpoint's, which an --ep N run saved.
    if (m.experts % f.ep && f.resume.empty())
      throw std::invalid_argument(
          fmt::format("--ep {} must divide --experts {} (each rank holds --experts / --ep experts)",
                      f.ep, m.experts));
    if (f.batch % f.ep)
      throw std::invalid_argument(fmt::format(
          "--ep {} must divide --batch {} (each rank trains on --batch / --ep sequences)", f.ep,
          f.batch));
    // A captured step must not wait for the host, and the dropless exchange copies its split
    // sizes to the host in every MoE layer (MoELayer's capacity mode would not, but it drops
    // tokens and moe_lm does not use it).
    if (f.cuda_graph)
      throw std::invalid_argument(
          "--cuda-graph does not work with --ep: the dropless expert exchange synchronises with "
          "the host for its split sizes in every MoE layer (only MoELayer's capacity mode, which "
          "moe_lm does not use, is capturable)");
    if (f.generate)
      throw std::invalid_argument(
          "--generate runs in one process: merge an --ep checkpoint with --merge-checkpoint first");
  }
  return f;
}

}  // namespace moe_lm
