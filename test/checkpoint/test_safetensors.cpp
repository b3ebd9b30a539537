// The safetensors reader and writer: bit-exact round trips of every dtype, scalars, empty tensors
// and metadata; zero-copy views that live in the file's mapping (and keep it mapped) when aligned;
// and files built byte by byte from the format's description, read by the reader and compared with
// the writer's output. Bad files: test_safetensors_errors.cpp.

#include <torchmoe/checkpoint/safetensors.h>

#include <string>
#include <vector>

#include "checkpoint/safetensors_test_utils.h"

using Catch::Matchers::Contains;
using torchmoe::checkpoint::load_safetensors;
using torchmoe::checkpoint::SafetensorsFile;
using torchmoe::checkpoint::save_safetensors;
using namespace torchmoe::test::safetensors;

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
