#pragma once
// Helpers of the safetensors tests (test_safetensors.cpp, test_safetensors_errors.cpp): a temporary
// directory, raw file bytes, little-endian header sizes, tensors' bytes, random tensors of each
// dtype, and whether an address lies in a file's mapping.

#include <ATen/ATen.h>
#include <ftw.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace torchmoe::test::safetensors {

namespace fs = std::filesystem;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

// A fresh directory under the system's temporary directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    do {
      path_ = fs::temp_directory_path() / ("torchmoe_safetensors_" + std::to_string(::getpid()) +
                                           "_" + std::to_string(counter++));
    } while (!fs::create_directory(path_));
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  // Not fs::remove_all: the torch wheel's libtorch.so exports its own std::filesystem, whose
  // remove_all calls a libstdc++ function that Debian 12's libstdc++ lacks (a null call).
  ~TempDir() {
    ::nftw(
        path_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian encoding of `n`, written out byte by byte (not copied from memory), so
// that the files below follow the format's description rather than this host.
inline std::string le64(uint64_t n) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file from its parts: the header's size (that of `header` unless given), `header`,
// then `data`.
inline void write_raw(const std::string& path, const std::string& header, const std::string& data,
                      std::optional<uint64_t> header_size = std::nullopt) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << le64(header_size.value_or(header.size())) << header << data;
  REQUIRE(out.good());
}

// The tensor's bytes in row-major order: bit-exact comparison of any dtype, NaNs included.
inline std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
}

// Random bits of `dtype` (for floats: NaNs, infinities and subnormals too); bools are 0 or 1.
inline at::Tensor random_tensor(at::ScalarType dtype, std::vector<int64_t> shape) {
  if (dtype == at::kBool) return at::randint(0, 2, shape).to(at::kBool);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return at::randint(0, 256, {nbytes}, at::kByte).view(dtype).reshape(shape);
}

// Whether `address` lies in a mapping of the file at `path`, as /proc/self/maps lists them.
inline bool is_mapped_from(const void* address, const std::string& path) {
  const std::string file = fs::canonical(path).string();
  const auto target = reinterpret_cast<uintptr_t>(address);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms, offset, device, inode, name;
    fields >> range >> perms >> offset >> device >> inode;
    std::getline(fields >> std::ws, name);
    if (name != file) continue;
    const size_t dash = range.find('-');
    const uintptr_t begin = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (address == nullptr || (begin <= target && target < end)) return true;
  }
  return false;
}

inline bool is_mapped(const std::string& path) { return is_mapped_from(nullptr, path); }

inline constexpr std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"U8", at::kByte},   {"F64", at::kDouble},    {"F16", at::kHalf},
    {"I32", at::kInt},   {"BF16", at::kBFloat16}, {"F8_E4M3", at::kFloat8_e4m3fn},
    {"I64", at::kLong},  {"F32", at::kFloat},     {"F8_E5M2", at::kFloat8_e5m2},
    {"I16", at::kShort}, {"I8", at::kChar},       {"BOOL", at::kBool},
};

}  // namespace torchmoe::test::safetensors
