// moe_lm's output: stdout's lines, stderr's errors, the progress line and the CSV (report.h).

#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace fs = std::filesystem;

namespace moe_lm {
namespace {

bool reporting_on = true;

// The CSV's columns (documented in --csv's help and docs/moe.md).
constexpr const char* kCsvHeader =
    "step,loss,aux_loss,lr,grad_norm,tokens_per_s,ms_per_step,avg_tokens_per_s,avg_ms_per_step,"
    "val_loss,val_ppl,load_min,load_max";

std::string format_eta(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

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

}  // namespace

void set_reporting(bool on) { reporting_on = on; }
bool reporting() { return reporting_on; }

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

std::pair<double, double> load_range(const torch::Tensor& loads) {
  const torch::Tensor counts = loads.to(torch::kCPU, torch::kFloat64);
  const torch::Tensor mean = counts.mean(1, true);
  const torch::Tensor used = (mean > 0).squeeze(1);
  if (!used.any().item<bool>()) return {0.0, 0.0};
  const torch::Tensor share = (counts / mean).index({used});
  return {share.min().item<double>(), share.max().item<double>()};
}

void say_progress(const StepFigures& s, int64_t steps, int64_t steps_left) {
  say("step {:>5}/{} | loss {:.4f} | aux {:.4f} | lr {:.2e} | {:>9.0f} avg tok/s | {:>7.1f} "
      "avg ms/step | ETA {} | load min {:.2f} max {:.2f}\n",
      s.step, steps, s.loss, s.aux, s.lr, s.avg_tok_s, s.avg_ms,
      format_eta(s.avg_ms / 1000.0 * static_cast<double>(steps_left)), s.load.first, s.load.second);
}

void say_validation(double loss) {
  say("  validation | loss {:.4f} | perplexity {:.2f}\n", loss, std::exp(loss));
}

std::unique_ptr<fmt::ostream> open_csv(const std::string& path, int64_t start_step) {
  // A resumed run appends to its CSV, which must then have this version's columns.
  const bool append = start_step > 0 && fs::exists(path) && fs::file_size(path) > 0;
  if (append) keep_csv_rows_through(path, start_step);
  auto csv = std::make_unique<fmt::ostream>(
      fmt::output_file(path, append ? fmt::file::WRONLY | fmt::file::APPEND | fmt::file::CREATE
                                    : fmt::file::WRONLY | fmt::file::CREATE | fmt::file::TRUNC));
  if (!append) csv->print("{}\n", kCsvHeader);
  return csv;
}

void write_csv_row(fmt::ostream& csv, const StepFigures& s) {
  csv.print("{},{:.6f},{:.6f},{:.6e},{:.4f},{:.1f},{:.2f},{:.1f},{:.2f},{},{},{:.4f},{:.4f}\n",
            s.step, s.loss, s.aux, s.lr, s.grad_norm, s.tok_s, s.ms, s.avg_tok_s, s.avg_ms,
            s.val ? fmt::format("{:.6f}", *s.val) : "",
            s.val ? fmt::format("{:.4f}", std::exp(*s.val)) : "", s.load.first, s.load.second);
  csv.flush();
}

}  // namespace moe_lm
