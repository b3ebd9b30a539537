// Every kind of bad safetensors file and every bad save, rejected with an error naming the file and
// the tensor, before anything is read (and, saving, with no file left behind).

#include <torchmoe/checkpoint/safetensors.h>

#include <string>
#include <vector>

#include "checkpoint/safetensors_test_utils.h"

using Catch::Matchers::Contains;
using torchmoe::checkpoint::load_safetensors;
using torchmoe::checkpoint::SafetensorsFile;
using torchmoe::checkpoint::save_safetensors;
using namespace torchmoe::test::safetensors;

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
  SECTION("null metadata") {
    write_raw(path, R"({"__metadata__":{"format":null},)" + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'__metadata__' entry 'format' must be a string, got null") &&
                            !Contains("null null"));
  }
  SECTION("values nested past the limit, which printing them would overflow the stack") {
    // 100,000 levels: about 65,000 overflowed an 8 MiB stack where a message printed them.
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    write_raw(path, R"({"__metadata__":)" + deep + "," + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("'" + path + "'") &&
                            Contains("the header nests arrays and objects deeper than 128 levels"));
  }
  SECTION("a NUL byte, which would end the header early") {
    // The second tensor after the NUL would be ignored.
    write_raw(path, "{" + w + std::string(1, '\0') + "," + w + "}", data);
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("the header holds a NUL byte at offset " +
                                                        std::to_string(w.size() + 1) + " of "));
  }
  SECTION("a header that does not start with its object") {
    write_raw(path, "\xEF\xBB\xBF{" + w + "}", data);  // a byte-order mark
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("the header must be a JSON object starting at its first byte, "
                                 "got byte 239"));
    write_raw(path, "", "");
    REQUIRE_THROWS_WITH(SafetensorsFile(path), Contains("got an empty header"));
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
                                 "whose size in bytes or strides overflow int64"));
  }
  SECTION("an empty shape whose strides overflow") {
    // Zero bytes, but at::empty would compute strides of 2^64.
    file_with(R"({"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[1,1]})", 1);
    REQUIRE_THROWS_WITH(SafetensorsFile(path),
                        Contains("tensor 'layer.w' has shape [0, 4294967296, 4294967296] of U8, "
                                 "whose size in bytes or strides overflow int64"));
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
