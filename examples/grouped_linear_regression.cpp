// Trains a GroupedLinear "student" to match a frozen random GroupedLinear "teacher" from a plain
// C++ loop: tokens are routed to experts at random each step, sorted by expert, and fed with
// m_splits. Runs on CUDA when a GPU is present (bf16 parameters with fp32 main-grad accumulation),
// else CPU.
//
//   grouped_linear_regression [--device auto|cpu|cuda] [--steps N] [--seed S]
//
// Exits 0 when the loss fell to a tenth of its first value or less, 1 when it did not, 2 for bad
// flags.

#include <torchmoe/torchmoe.h>

#include <torch/torch.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string device = "auto";
  int64_t steps = 300;
  uint64_t seed = 0;
};

// A whole decimal integer in [min, max]: "1e3", "12x" and "-1" for an unsigned value are errors.
template <typename Int>
Int parse_integer(const std::string& flag, const std::string& text, Int min, Int max) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < min || value > max) {
    throw std::invalid_argument(flag + " must be an integer in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "], got '" + text + "'");
  }
  return value;
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--device") {
      args.device = value();
    } else if (flag == "--steps") {
      args.steps = parse_integer<int64_t>(flag, value(), 1, std::numeric_limits<int64_t>::max());
    } else if (flag == "--seed") {
      args.seed = parse_integer<uint64_t>(flag, value(), 0, std::numeric_limits<uint64_t>::max());
    } else if (flag == "--help" || flag == "-h") {
      std::cout
          << "usage: grouped_linear_regression [--device auto|cpu|cuda] [--steps N] [--seed S]\n";
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda") {
    throw std::invalid_argument("--device must be auto, cpu or cuda, got " + args.device);
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << " (see --help)\n";
    return 2;
  }
  const bool cuda = args.device == "cuda" || (args.device == "auto" && torch::cuda::is_available());
  if (cuda && !torch::cuda::is_available()) {
    std::cerr << "error: --device cuda but no CUDA device is available\n";
    return 2;
  }
  torch::manual_seed(args.seed);
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const int64_t experts = 8, hidden = cuda ? 1024 : 64, out = cuda ? 512 : 32;
  const int64_t tokens = cuda ? 8192 : 512;
  const torch::Dtype dtype = cuda ? torch::kBFloat16 : torch::kFloat32;

  auto options = torchmoe::GroupedLinearOptions(experts, hidden, out).device(device);
  torchmoe::GroupedLinear teacher(torchmoe::GroupedLinearOptions(options).params_dtype(dtype));
  // fp32 master weights; the bf16 compute copy's weight gradients land in fp32 main-grad buffers.
  torchmoe::GroupedLinear master(options);
  torchmoe::GroupedLinear student(
      torchmoe::GroupedLinearOptions(options).params_dtype(dtype).fuse_wgrad_accumulation(cuda));
  for (auto& p : teacher->parameters()) p.set_requires_grad(false);
  torch::optim::Adam optimizer(master->parameters(), torch::optim::AdamOptions(1e-2));

  std::cout << "training " << *student << " on " << device << " (" << dtype << "), " << tokens
            << " tokens/step, " << args.steps << " steps\n";
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, loss_value = 0;
  for (int64_t step = 1; step <= args.steps; ++step) {
    // Route: a random expert per token. The tokens are i.i.d., so treating them as already sorted
    // by expert only needs the per-expert counts as m_splits.
    const torch::Tensor expert = torch::randint(experts, {tokens}, torch::kLong);
    const torch::Tensor counts = torch::bincount(expert, {}, experts);
    const std::vector<int64_t> m_splits(counts.data_ptr<int64_t>(),
                                        counts.data_ptr<int64_t>() + experts);
    const torch::Tensor x =
        torch::randn({tokens, hidden}, torch::TensorOptions().device(device).dtype(dtype));
    const torch::Tensor target = teacher(x, m_splits).detach();

    {  // copy the master weights into the compute copy
      torch::NoGradGuard no_grad;
      auto src = master->parameters();
      auto dst = student->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    const torch::Tensor y = student(x, m_splits, /*is_first_microbatch=*/true);
    const torch::Tensor loss = torch::mse_loss(y.to(torch::kFloat32), target.to(torch::kFloat32));
    optimizer.zero_grad();
    loss.backward();
    {  // hand the gradients to the fp32 master parameters
      auto src = student->named_parameters();
      auto dst = master->named_parameters();
      std::vector<torch::Tensor> main = student->main_grads();
      for (int64_t e = 0; e < experts; ++e) {
        const std::string w = "weight" + std::to_string(e), b = "bias" + std::to_string(e);
        dst[w].mutable_grad() = cuda ? main[e].clone() : src[w].grad().clone();
        dst[b].mutable_grad() = src[b].grad().to(torch::kFloat32);
        src[w].mutable_grad().reset();
        src[b].mutable_grad().reset();
      }
    }
    optimizer.step();
    loss_value = loss.item<double>();
    if (step == 1) first_loss = loss_value;
    if (step == 1 || step % 25 == 0 || step == args.steps) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "step " << std::setw(5) << step << "  loss " << std::scientific
                << std::setprecision(3) << loss_value << std::defaultfloat << "  " << std::fixed
                << std::setprecision(1) << (step * tokens / seconds) << " tokens/s\n"
                << std::defaultfloat;
    }
  }
  std::cout << "loss fell from " << first_loss << " to " << loss_value << " ("
            << first_loss / loss_value << "x)\n";
  return loss_value < 0.1 * first_loss ? 0 : 1;
}
