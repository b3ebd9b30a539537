// Loads moe_lm's byte corpus and cuts training and validation windows from it.

#include "data.h"

#include <ATen/ATen.h>
#include <fmt/core.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace fs = std::filesystem;

namespace moe_lm {

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

Batch windows(const torch::Tensor& text, const torch::Tensor& starts, int64_t seq,
              const torch::Device& device) {
  const torch::Tensor idx = starts.unsqueeze(1) + torch::arange(seq + 1).unsqueeze(0);
  const torch::Tensor w = text.index_select(0, idx.reshape(-1)).view({starts.size(0), seq + 1});
  return {w.narrow(1, 0, seq).to(device), w.narrow(1, 1, seq).to(device)};
}

Batch train_batch(const Corpus& c, const Flags& f, int64_t step, int64_t micro, int64_t rank,
                  const torch::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      f.seed * 1000003ULL + static_cast<uint64_t>(step) * 1009ULL + static_cast<uint64_t>(micro));
  const torch::Tensor starts =
      torch::randint(c.train.size(0) - f.model.seq - 1, {f.batch}, gen, torch::kLong);
  return windows(c.train, rank_part(starts, 0, f.batch, f, rank), f.model.seq, device);
}

torch::Tensor rank_part(const torch::Tensor& rows, int64_t first, int64_t count, const Flags& f,
                        int64_t rank) {
  return rows.narrow(0, first + rank * (count / f.ranks()), count / f.ranks());
}

}  // namespace moe_lm
