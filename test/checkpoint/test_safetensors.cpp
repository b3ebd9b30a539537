// The safetensors reader and writer: bit-exact round trips of every dtype, scalars, empty tensors
// and metadata; zero-copy views that live in the file's mapping (and keep it mapped) when aligned;
// files built byte by byte from the format's description, read by the reader and compared with the
// writer's output; and every kind of bad file, rejected with an error naming the tensor.

#include <ATen/ATen.h>
#include <ftw.h>
#include <torchmoe/checkpoint/safetensors.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;
using torchmoe::checkpoint::load_safetensors;
using torchmoe::checkpoint::SafetensorsFile;
using torchmoe::checkpoint::save_safetensors;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;
namespace fs = std::filesystem;

namespace {

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

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian encoding of `n`, written out byte by byte (not copied from memory), so
// that the files below follow the format's description rather than this host.
std::string le64(uint64_t n) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file from its parts: the header's size (that of `header` unless given), `header`,
// then `data`.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> header_size = std::nullopt) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << le64(header_size.value_or(header.size())) << header << data;
  REQUIRE(out.good());
}

// The tensor's bytes in row-major order: bit-exact comparison of any dtype, NaNs included.
std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
}

// Random bits of `dtype` (for floats: NaNs, infinities and subnormals too); bools are 0 or 1.
at::Tensor random_tensor(at::ScalarType dtype, std::vector<int64_t> shape) {
  if (dtype == at::kBool) return at::randint(0, 2, shape).to(at::kBool);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return at::randint(0, 256, {nbytes}, at::kByte).view(dtype).reshape(shape);
}

// Whether `address` lies in a mapping of the file at `path`, as /proc/self/maps lists them.
bool is_mapped_from(const void* address, const std::string& path) {
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

bool is_mapped(const std::string& path) { return is_mapped_from(nullptr, path); }

constexpr std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"U8", at::kByte},   {"F64", at::kDouble},    {"F16", at::kHalf},
    {"I32", at::kInt},   {"BF16", at::kBFloat16}, {"F8_E4M3", at::kFloat8_e4m3fn},
    {"I64", at::kLong},  {"F32", at::kFloat},     {"F8_E5M2", at::kFloat8_e5m2},
    {"I16", at::kShort}, {"I8", at::kChar},       {"BOOL", at::kBool},
};

}  // namespace

TEST_CASE("safetensors round trip keeps every dtype bit for bit, in the given order",
          "[checkpoint]") {
  at::manual_seed(0);
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  // 105 elements: after U8 (105 bytes) the next tensors sit misaligned and are read as copies,
  // the rest of the file as views; the bytes must come back the same either way.
  Tensors tensors;
  for (const auto& [name, dtype] : kDtypes) {
    tensors.emplace_back(std::string("t.") + name, random_tensor(dtype, {3, 5, 7}));
  }
  tensors.emplace_back("t.transposed", random_tensor(at::kFloat, {4, 6}).t());
  save_safetensors(path, tensors);
  // The header names each dtype as the format does (each tensor is named after its dtype).
  const std::string bytes = read_file(path);
  for (const auto& [name, dtype] : kDtypes) {
    INFO(name);
    CHECK(bytes.find("\"t." + std::string(name) + "\":{\"dtype\":\"" + name + "\"") !=
          std::string::npos);
  }

  const SafetensorsFile file(path);
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors) names.push_back(name);
  REQUIRE(file.names() == names);
  for (const auto& [name, expected] : tensors) {
    INFO(name);
    CHECK(file.contains(name));
    CHECK(file.dtype(name) == expected.scalar_type());
    CHECK(file.shape(name) == expected.sizes().vec());
    const at::Tensor t = file.tensor(name);
    CHECK(t.device() == at::kCPU);
    CHECK(t.scalar_type() == expected.scalar_type());
    CHECK(t.sizes() == expected.sizes());
    CHECK(bytes_of(t) == bytes_of(expected));
    CHECK(bytes_of(file.tensor(name, /*copy=*/true)) == bytes_of(expected));
  }
  CHECK(file.metadata().empty());
  CHECK_FALSE(file.contains("t.missing"));

  const Tensors loaded = load_safetensors(path);
  REQUIRE(loaded.size() == tensors.size());
  for (size_t i = 0; i < loaded.size(); ++i) {
    INFO(tensors[i].first);
    CHECK(loaded[i].first == tensors[i].first);
    CHECK(bytes_of(loaded[i].second) == bytes_of(tensors[i].second));
  }
}

TEST_CASE("safetensors round trip keeps 0-dim scalars and empty tensors", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("scalars.safetensors");
  const Tensors tensors = {
      {"scalar.f32", at::scalar_tensor(2.5, at::kFloat)},
      {"empty.1d", at::empty({0}, at::kFloat)},
      {"empty.3d", at::empty({2, 0, 3}, at::kLong)},
      {"scalar.bf16", at::scalar_tensor(-0.75, at::kBFloat16)},
      {"values", at::arange(4, at::kInt)},
      {"empty.last", at::empty({0, 5}, at::kBFloat16)},
  };
  save_safetensors(path, tensors);

  const SafetensorsFile file(path);
  REQUIRE(file.names() == std::vector<std::string>{"scalar.f32", "empty.1d", "empty.3d",
                                                   "scalar.bf16", "values", "empty.last"});
  const at::Tensor f32 = file.tensor("scalar.f32");
  CHECK(f32.dim() == 0);
  CHECK(f32.item<float>() == 2.5f);
  CHECK(file.shape("scalar.bf16").empty());
  CHECK(file.tensor("scalar.bf16").item<float>() == -0.75f);
  for (const char* name : {"empty.1d", "empty.3d", "empty.last"}) {
    INFO(name);
    const at::Tensor t = file.tensor(name);
    CHECK(t.numel() == 0);
    CHECK(t.sizes() == file.shape(name));
  }
  CHECK(file.shape("empty.3d") == std::vector<int64_t>{2, 0, 3});
  CHECK(file.tensor("values").equal(at::arange(4, at::kInt)));

  SECTION("a file of empty tensors only has no data bytes") {
    const std::string empty_path = dir.file("empty.safetensors");
    save_safetensors(empty_path, {{"a", at::empty({0}, at::kHalf)}, {"b", at::empty({3, 0})}});
    const Tensors loaded = load_safetensors(empty_path);
    REQUIRE(loaded.size() == 2);
    CHECK(loaded[1].second.sizes() == at::IntArrayRef{3, 0});
    // The header runs to the end of the file.
    const std::string bytes = read_file(empty_path);
    CHECK(bytes.substr(0, 8) == le64(bytes.size() - 8));
  }
  SECTION("a file of no tensors") {
    const std::string none_path = dir.file("none.safetensors");
    save_safetensors(none_path, {});
    CHECK(load_safetensors(none_path).empty());
  }
}

TEST_CASE("safetensors round trip keeps the metadata strings", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("meta.safetensors");
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"step", "1200"}, {"empty", ""}, {"unicode", "\xc3\xbc \"quoted\" \\"}};
  save_safetensors(path, {{"w", at::ones({2, 2})}}, metadata);
  const SafetensorsFile file(path);
  CHECK(file.metadata() == metadata);
  CHECK(file.names() == std::vector<std::string>{"w"});

  // Without metadata the header has no "__metadata__" key at all.
  save_safetensors(path, {{"w", at::ones({2, 2})}});
  CHECK(SafetensorsFile(path).metadata().empty());
  CHECK(read_file(path).find("__metadata__") == std::string::npos);
}

TEST_CASE("SafetensorsFile::tensor is a zero-copy view of the mapping when aligned",
          "[checkpoint]") {
  at::manual_seed(1);
  TempDir dir;
  const std::string path = dir.file("views.safetensors");
  const at::Tensor w_expected = at::randn({64, 32});
  const at::Tensor b_expected = at::randn({17}).to(at::kBFloat16);
  save_safetensors(path, {{"w", w_expected}, {"b", b_expected}});

  at::Tensor w;
  {
    const SafetensorsFile file(path);
    w = file.tensor("w");
    const at::Tensor b = file.tensor("b");
    CHECK(is_mapped_from(w.const_data_ptr(), path));
    CHECK(is_mapped_from(b.const_data_ptr(), path));
    // Two views of one mapping: their distance is that of their data offsets.
    CHECK(static_cast<const char*>(b.const_data_ptr()) -
              static_cast<const char*>(w.const_data_ptr()) ==
          static_cast<ptrdiff_t>(w_expected.nbytes()));
    CHECK(b.equal(b_expected));

    at::Tensor owned = file.tensor("w", /*copy=*/true);
    CHECK_FALSE(is_mapped_from(owned.const_data_ptr(), path));
    owned.add_(1);
    CHECK(owned.equal(w_expected + 1));
  }
  // The view keeps the mapping after the file object is gone ...
  CHECK(is_mapped_from(w.const_data_ptr(), path));
  CHECK(w.equal(w_expected));
  // ... and the last view unmaps it.
  w = at::Tensor();
  CHECK_FALSE(is_mapped(path));

  SECTION("misaligned data is copied") {
    const std::string odd_path = dir.file("odd.safetensors");
    const at::Tensor f_expected = at::randn({5});
    save_safetensors(odd_path, {{"odd", at::arange(3, at::kByte)}, {"f", f_expected}});
    const SafetensorsFile file(odd_path);
    const at::Tensor f = file.tensor("f");  // data offset 3: not 4-byte aligned
    CHECK(reinterpret_cast<uintptr_t>(f.const_data_ptr()) % 4 == 0);
    CHECK_FALSE(is_mapped_from(f.const_data_ptr(), odd_path));
    CHECK(f.equal(f_expected));
    CHECK(is_mapped_from(file.tensor("odd").const_data_ptr(), odd_path));
  }
}

TEST_CASE("safetensors files built byte by byte from the format match the reader and the writer",
          "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("hand.safetensors");

  SECTION("the reader reads a hand-built file, tensors in data order whatever the header order") {
    // 1.5f, -2.0f; int32 7, -1; bf16 1.0: little-endian IEEE and two's complement bytes.
    const std::string data = std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8) +
                             std::string("\x07\x00\x00\x00\xff\xff\xff\xff", 8) +
                             std::string("\x80\x3f", 2);
    const std::string header =
        R"({"b":{"dtype":"I32","shape":[2],"data_offsets":[8,16]},)"
        R"("__metadata__":{"format":"pt"},)"
        R"("a":{"shape":[2,1],"dtype":"F32","data_offsets":[0,8]},)"
        R"( "c" : { "dtype" : "BF16", "shape" : [], "data_offsets" : [16, 18] } })"
        "     ";  // the trailing padding the format allows
    write_raw(path, header, data);

    const SafetensorsFile file(path);
    CHECK(file.names() == std::vector<std::string>{"a", "b", "c"});
    CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
    CHECK(file.tensor("a").equal(at::tensor({1.5f, -2.0f}).reshape({2, 1})));
    CHECK(file.tensor("b").equal(at::tensor(std::vector<int32_t>{7, -1})));
    const at::Tensor c = file.tensor("c");
    CHECK(c.scalar_type() == at::kBFloat16);
    CHECK(c.dim() == 0);
    CHECK(c.item<float>() == 1.0f);
  }
  SECTION("the writer writes the format's bytes: size, JSON padded with spaces to 8, data") {
    save_safetensors(path, {{"x", at::tensor({1.5f, -2.0f})}, {"n", at::full({1}, 7, at::kLong)}},
                     {{"k", "v"}});
    const std::string json = R"({"__metadata__":{"k":"v"},)"
                             R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("n":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})";
    const std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
    const std::string expected = le64(padded.size()) + padded +
                                 std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8) +
                                 std::string("\x07\x00\x00\x00\x00\x00\x00\x00", 8);
    CHECK(read_file(path) == expected);
    CHECK_FALSE(fs::exists(path + ".tmp"));
  }
}

TEST_CASE("SafetensorsFile rejects truncated files and bad header sizes", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  save_safetensors(path, {{"a", at::ones({4})}, {"w", at::ones({2, 3})}});
  const auto size = fs::file_size(path);

  SECTION("truncated in the data: the last tensor is named") {
    fs::resize_file(path, size - 4);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("safetensors: '" + path +
                                                        "': tensor 'w' has data_offsets [16, 40]"
                                                        " past the end of the data (36 bytes)") &&
                                                   Contains("truncated"));
  }
  SECTION("truncated in the header") {
    fs::resize_file(path, 20);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path + "'") && Contains("runs past the end of the file (20 "
                                                               "bytes): it is truncated"));
  }
  SECTION("truncated in the header size") {
    fs::resize_file(path, 5);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path + "'") && Contains("the file is 5 bytes, too short"));
  }
  SECTION("header size past the end of the file") {
    write_raw(path, "{}", "", 1000);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the header size 1000 runs past the end of the file (10 bytes)"));
  }
  SECTION("header size over the limit") {
    write_raw(path, "{}", "", uint64_t{1} << 40);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the header size 1099511627776 is over the limit"));
  }
  SECTION("no file, or not a file") {
    REQUIRE_THROWS_WITH(SafetensorsFile(dir.file("missing.safetensors")),
                        Contains("cannot open '" + dir.file("missing.safetensors") + "'"));
    fs::create_directory(dir.file("directory"));
    REQUIRE_THROWS_WITH(SafetensorsFile(dir.file("directory")), Contains("not a regular file"));
  }
}

TEST_CASE("SafetensorsFile rejects headers that are not the format's JSON", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string w = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string data(8, '\0');

  SECTION("malformed JSON") {
    write_raw(path, R"({"w":{"dtype":"F32","shape":[2])", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path + "'") && Contains("the header is not valid JSON"));
  }
  SECTION("not an object") {
    write_raw(path, "[1, 2]", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("the header must be a JSON object"));
  }
  SECTION("a duplicate tensor") {
    write_raw(path, "{" + w + "," + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("the header has the key 'w' twice"));
  }
  SECTION("a duplicate field of a tensor") {
    write_raw(path, R"({"w":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
              data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("the header has the key 'dtype' twice"));
  }
  SECTION("an entry that is not an object") {
    write_raw(path, R"({"w":[0,8]})", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'w' must be a JSON object with dtype, shape and "
                                 "data_offsets, got [0,8]"));
  }
  SECTION("a missing field") {
    write_raw(path, R"({"w":{"dtype":"F32","shape":[2]}})", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("tensor 'w' has no data_offsets"));
  }
  SECTION("non-string metadata") {
    write_raw(path, R"({"__metadata__":{"format":"pt","step":1},)" + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path + "'") &&
                            Contains("'__metadata__' entry 'step' must be a string, got number 1"));
  }
  SECTION("metadata that is not an object") {
    write_raw(path, R"({"__metadata__":"pt",)" + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'__metadata__' must be a JSON object of strings, got \"pt\""));
  }
}

TEST_CASE("SafetensorsFile rejects bad dtypes and shapes, naming the tensor", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const auto file_with = [&](const std::string& entry, size_t data_size) {
    write_raw(path,
              R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"layer.w":)" + entry + "}",
              std::string(data_size, '\1'));
  };

  SECTION("an unknown dtype") {
    file_with(R"({"dtype":"F4","shape":[2],"data_offsets":[1,2]})", 2);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path +
                                 "': tensor 'layer.w' has dtype 'F4', which is not "
                                 "one of F64, F32, F16, BF16, F8_E4M3, F8_E5M2"));
  }
  SECTION("a dtype that is not a string") {
    file_with(R"({"dtype":4,"shape":[2],"data_offsets":[1,9]})", 9);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'layer.w' has dtype 4, which is not a string"));
  }
  SECTION("shape and offsets that disagree") {
    file_with(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,10]})", 10);
    // Checked before the overlap with 'a'.
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("safetensors: '" + path +
                                 "': tensor 'layer.w' has data_offsets [0, 10] but shape [2, 3] of "
                                 "F32 needs 24 bytes"));
  }
  SECTION("a negative dimension") {
    file_with(R"({"dtype":"F32","shape":[-2,3],"data_offsets":[1,25]})", 25);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'layer.w' has shape [-2,3], which is not a list of "
                                 "non-negative integers"));
  }
  SECTION("a fractional dimension") {
    file_with(R"({"dtype":"F32","shape":[2.5],"data_offsets":[1,11]})", 11);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'layer.w' has shape [2.5], which is not a list"));
  }
  SECTION("a shape whose size overflows") {
    file_with(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[1,1]})", 1);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'layer.w' has shape [4294967296, 4294967296] of F32, "
                                 "whose size in bytes overflows 64 bits"));
  }
  SECTION("BOOL bytes other than 0 and 1, found when the tensor is read") {
    write_raw(path, R"({"flags":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
              std::string("\x01\x00\x02", 3));
    const SafetensorsFile file(path);
    REQUIRE_THROWS_WITH(file.tensor("flags"),
                        Contains("tensor 'flags' of BOOL holds the byte 2 at element 2"));
  }
}

TEST_CASE("SafetensorsFile rejects overlapping, out-of-range and holed data offsets",
          "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const auto f32x4 = [](const std::string& name, int begin, int end) {
    return "\"" + name + R"(":{"dtype":"F32","shape":[4],"data_offsets":[)" +
           std::to_string(begin) + "," + std::to_string(end) + "]}";
  };

  SECTION("overlapping tensors") {
    write_raw(path, "{" + f32x4("a", 0, 16) + "," + f32x4("w", 8, 24) + "}", std::string(24, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path +
                                 "': tensor 'w' has data_offsets [8, 24], which overlap tensor "
                                 "'a' [0, 16]"));
  }
  SECTION("an empty tensor inside another") {
    write_raw(path,
              "{" + f32x4("a", 0, 16) + R"(,"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
              std::string(16, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("tensor 'e' has data_offsets [4, 4], "
                                                        "which overlap tensor 'a' [0, 16]"));
  }
  SECTION("offsets past the end of the data") {
    write_raw(path, "{" + f32x4("a", 0, 16) + "," + f32x4("w", 16, 32) + "}",
              std::string(16, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'w' has data_offsets [16, 32] past the end of the data "
                                 "(16 bytes)"));
  }
  SECTION("offsets that begin after they end") {
    write_raw(path, R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})",
              std::string(8, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'w' has data_offsets [8, 4], which begin after they end"));
  }
  SECTION("offsets that are not two integers") {
    write_raw(path, R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[0]}})", "");
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'w' has data_offsets [0], which are not two "
                                 "non-negative integers"));
  }
  SECTION("a hole between tensors") {
    write_raw(path, "{" + f32x4("a", 0, 16) + "," + f32x4("w", 24, 40) + "}",
              std::string(40, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path +
                                 "': the data bytes [16, 24) between tensor 'a' and tensor 'w' "
                                 "belong to no tensor"));
  }
  SECTION("a hole before the first tensor") {
    write_raw(path, "{" + f32x4("w", 8, 24) + "}", std::string(24, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the data bytes [0, 8) before tensor 'w' belong to no tensor"));
  }
  SECTION("bytes after the last tensor") {
    write_raw(path, "{" + f32x4("w", 0, 16) + "}", std::string(20, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the data bytes [16, 20) after tensor 'w' belong to no tensor"));
  }
  SECTION("data bytes without tensors") {
    write_raw(path, "{}", std::string(4, '\0'));
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the data bytes [0, 4) of a file with no tensors"));
  }
}

TEST_CASE("SafetensorsFile rejects unknown tensor names", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("names.safetensors");
  save_safetensors(path, {{"w", at::ones({2})}});
  const SafetensorsFile file(path);
  const auto unknown = Contains("'" + path + "' has no tensor 'v'");
  REQUIRE_THROWS_WITH(file.tensor("v"), unknown);
  REQUIRE_THROWS_WITH(file.shape("v"), unknown);
  REQUIRE_THROWS_WITH(file.dtype("v"), unknown);
}

TEST_CASE("save_safetensors rejects bad names and tensors and leaves no file behind",
          "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  const at::Tensor t = at::ones({2});
  const auto no_file_left = [&] {
    CHECK_FALSE(fs::exists(path));
    CHECK_FALSE(fs::exists(path + ".tmp"));
  };

  SECTION("duplicate names") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"w", t}, {"b", t}, {"w", t}}),
                        Contains("'" + path + "': tensor 'w' is given twice"));
    no_file_left();
  }
  SECTION("an empty name") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"", t}}),
                        Contains("a tensor name must not be empty"));
    no_file_left();
  }
  SECTION("the metadata key as a name") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"__metadata__", t}}),
                        Contains("a tensor must not be named '__metadata__'"));
    no_file_left();
  }
  SECTION("a name that is not UTF-8") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"w\xff", t}}), Contains("is not valid UTF-8"));
    no_file_left();
  }
  SECTION("a dtype safetensors cannot hold here") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"z", at::ones({2}, at::kComplexFloat)}}),
                        Contains("tensor 'z' has dtype ComplexFloat, which safetensors cannot "
                                 "hold here"));
    no_file_left();
  }
  SECTION("an undefined or sparse tensor") {
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"u", at::Tensor()}}),
                        Contains("tensor 'u' must be a defined tensor"));
    REQUIRE_THROWS_WITH(save_safetensors(path, {{"s", at::eye(2).to_sparse()}}),
                        Contains("tensor 's' must be a strided (dense) tensor"));
    no_file_left();
  }
  SECTION("an existing file stays as it was") {
    save_safetensors(path, {{"old", t}});
    REQUIRE_THROWS(save_safetensors(path, {{"w", t}, {"w", t}}));
    CHECK(SafetensorsFile(path).names() == std::vector<std::string>{"old"});
    CHECK_FALSE(fs::exists(path + ".tmp"));
  }
}

TEST_CASE("save_safetensors copies CUDA tensors to the CPU", "[checkpoint][cuda]") {
  if (!at::hasCUDA()) {
    WARN("SKIPPED: no CUDA device");
    return;
  }
  TempDir dir;
  const std::string path = dir.file("cuda.safetensors");
  const at::Tensor expected = at::randn({3, 4}).to(at::kBFloat16);
  save_safetensors(path, {{"w", expected.to(at::kCUDA).t()}});
  const at::Tensor w = SafetensorsFile(path).tensor("w");
  CHECK(w.device() == at::kCPU);
  CHECK(w.equal(expected.t().contiguous()));
}
