#pragma once
// What a moe_lm run reports: lines on stdout (rank 0's only with --ep), errors on stderr, each
// step's progress line and the CSV of every step.

#include <fmt/core.h>
#include <fmt/os.h>
#include <torch/types.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace moe_lm {

// False on the ranks other than 0 of an --ep run: rank 0 reports for all of them.
void set_reporting(bool on);
bool reporting();

// Every line the run reports goes through here and is flushed at once: stdout is fully buffered
// when it is not a terminal (nohup, CI, `| tee`), and a long run would show nothing until exit.
template <typename... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
  if (!reporting()) return;
  fmt::print(stdout, format, std::forward<Args>(args)...);
  std::fflush(stdout);
}

// Errors go to stderr with every line prefixed "moe_lm: " (a c10::Error's message may hold
// several lines).
void print_error(const std::string& message);

// Expert load of each layer relative to uniform (T·k/E) from counts [layers, E]; the min and max
// over layers. One copy to the host for all layers.
std::pair<double, double> load_range(const torch::Tensor& loads);

// What the progress line and the CSV report of a step.
struct StepFigures {
  int64_t step = 0;  // the steps done, this one included
  double loss = 0.0, aux = 0.0, lr = 0.0, grad_norm = 0.0;
  double ms = 0.0, avg_ms = 0.0;        // this step's time, the run's average
  double tok_s = 0.0, avg_tok_s = 0.0;  // the same as tokens per second
  std::pair<double, double> load;       // load_range of the first micro-batch
  std::optional<double> val;            // the validation loss, on the steps that evaluate
};

// The step's progress line: of `steps` in all, `steps_left` still to run in this process (ETA).
void say_progress(const StepFigures& s, int64_t steps, int64_t steps_left);
void say_validation(double loss);

// The CSV `path` (--csv) for a run from `start_step`: a new file with its header, or a resumed
// run's, kept through start_step to append to. Throws when a resumed run's file has other columns.
std::unique_ptr<fmt::ostream> open_csv(const std::string& path, int64_t start_step);
// The step's row, flushed.
void write_csv_row(fmt::ostream& csv, const StepFigures& s);

}  // namespace moe_lm
