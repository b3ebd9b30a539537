#include "torchmoe/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

namespace torchmoe::checkpoint {

// The data is little-endian and is mapped as is.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors needs a little-endian host");

namespace {

// Not nlohmann::ordered_json, whose objects find a key by a linear search: quadratic in the
// tensors of a header, which reach tens of thousands for MoE checkpoints with per-expert weights.
using Json = nlohmann::json;

// The reference implementation's limit: a header is a few MB at most, and parsing a huge JSON
// document is a way to exhaust memory.
constexpr uint64_t kMaxHeaderSize = 100'000'000;
// Arrays and objects nest at most this deep in a header (the format needs 3; serde_json, which
// the reference reader uses, stops at 128): error messages print values recursively.
constexpr int kMaxHeaderDepth = 128;
constexpr char kMetadataKey[] = "__metadata__";

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

const char* dtype_name(at::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return nullptr;
}

std::string supported_dtypes() {
  std::string out;
  for (const DtypeName& d : kDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

std::string errno_message() { return std::generic_category().message(errno); }

std::string prefix(const std::string& path) { return "safetensors: '" + path + "': "; }

std::string tensor_prefix(const std::string& path, const std::string& name) {
  return prefix(path) + "tensor '" + name + "' ";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

// A JSON value for an error message, cut short: a bad header may hold anything.
std::string excerpt(const Json& value) {
  constexpr size_t kMaxChars = 80;
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return text;
}

bool is_valid_utf8(const std::string& text) {
  try {
    Json(text).dump();
    return true;
  } catch (const Json::type_error&) {
    return false;
  }
}

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, so that the caller sees the error of a write the kernel deferred.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

// A SAX pass over a header before the DOM parser reads it: that parser keeps the last of
// duplicate keys silently (the format forbids them: two readers could see different tensors), its
// callback variant is quadratic in an object's keys, and a value nested without limit would
// overflow the stack where it is printed. Collects the top-level keys in order, which breaks the
// ties of empty tensors at one offset.
class KeyScanner {
 public:
  explicit KeyScanner(const std::string& path) : path_(path) {}

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    check_depth(++depth_);
    objects_.emplace_back();
    return true;
  }
  bool key(std::string& key) {
    TORCH_CHECK(objects_.back().insert(key).second, prefix(path_), "the header has the key '", key,
                "' twice");
    if (depth_ == 1) top_level_keys_.push_back(key);
    return true;
  }
  bool end_object() {
    --depth_;
    objects_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    check_depth(++depth_);
    return true;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const Json::exception&) { return false; }

  std::vector<std::string> take_top_level_keys() { return std::move(top_level_keys_); }

 private:
  void check_depth(int depth) const {
    TORCH_CHECK(depth <= kMaxHeaderDepth, prefix(path_), "the header nests arrays and objects ",
                "deeper than ", kMaxHeaderDepth, " levels");
  }

  const std::string& path_;
  int depth_ = 0;
  std::vector<std::set<std::string>> objects_;  // the keys of each open object
  std::vector<std::string> top_level_keys_;
};

struct Header {
  Json json;
  std::vector<std::string> keys;  // the top-level keys in the header's order
};

Header parse_header(const std::string& path, const char* begin, const char* end) {
  // The JSON parser takes a NUL byte for the end of its input and skips a byte-order mark: what
  // follows either would be ignored, where the reference reader refuses the file.
  TORCH_CHECK(begin != end && *begin == '{', prefix(path),
              "the header must be a JSON object starting at its first byte, got ",
              begin == end
                  ? std::string("an empty header")
                  : c10::str("byte ", static_cast<int>(static_cast<unsigned char>(*begin))));
  const void* nul = std::memchr(begin, 0, static_cast<size_t>(end - begin));
  TORCH_CHECK(nul == nullptr, prefix(path), "the header holds a NUL byte at offset ",
              nul ? static_cast<const char*>(nul) - begin : 0, " of ", end - begin,
              ": a header is JSON text, padded with spaces");
  KeyScanner scanner(path);
  Header header;
  if (Json::sax_parse(begin, end, &scanner)) header.keys = scanner.take_top_level_keys();
  try {
    header.json = Json::parse(begin, end);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, prefix(path), "the header is not valid JSON: ", e.what());
  }
  return header;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const Json& value) {
  TORCH_CHECK(value.is_object(), prefix(path), "'", kMetadataKey,
              "' must be a JSON object of strings, got ", excerpt(value));
  std::map<std::string, std::string> metadata;
  for (const auto& item : value.items()) {
    TORCH_CHECK(item.value().is_string(), prefix(path), "'", kMetadataKey, "' entry '", item.key(),
                "' must be a string, got ",
                item.value().is_null()
                    ? std::string("null")
                    : c10::str(item.value().type_name(), " ", excerpt(item.value())));
    metadata.emplace(item.key(), item.value().get<std::string>());
  }
  return metadata;
}

// The header's numbers are checked before any is used: every range within the data region, its
// length that of its dtype and shape, without overflow.
detail::SafetensorsEntry parse_entry(const std::string& path, const std::string& name,
                                     const Json& value, uint64_t data_size) {
  const std::string where = tensor_prefix(path, name);
  TORCH_CHECK(value.is_object(), where,
              "must be a JSON object with dtype, shape and data_offsets, got ", excerpt(value));
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    TORCH_CHECK(value.contains(key), where, "has no ", key);
  }

  const Json& dtype = value.at("dtype");
  TORCH_CHECK(dtype.is_string(), where, "has dtype ", excerpt(dtype), ", which is not a string");
  const std::string dtype_text = dtype.get<std::string>();
  const auto known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                  [&](const DtypeName& d) { return dtype_text == d.name; });
  TORCH_CHECK(known != std::end(kDtypes), where, "has dtype '", dtype_text,
              "', which is not one of ", supported_dtypes());

  const Json& shape = value.at("shape");
  const bool shape_ok =
      shape.is_array() && std::all_of(shape.begin(), shape.end(), [](const Json& dim) {
        return dim.is_number_unsigned() &&
               dim.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()};
      });
  TORCH_CHECK(shape_ok, where, "has shape ", excerpt(shape),
              ", which is not a list of non-negative integers");

  const Json& offsets = value.at("data_offsets");
  const bool offsets_ok = offsets.is_array() && offsets.size() == 2 &&
                          offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned();
  TORCH_CHECK(offsets_ok, where, "has data_offsets ", excerpt(offsets),
              ", which are not two non-negative integers [begin, end]");

  detail::SafetensorsEntry entry{
      known->dtype, {}, offsets[0].get<uint64_t>(), offsets[1].get<uint64_t>()};
  for (const Json& dim : shape) entry.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  TORCH_CHECK(entry.begin <= entry.end, where, "has data_offsets [", entry.begin, ", ", entry.end,
              "], which begin after they end");
  TORCH_CHECK(entry.end <= data_size, where, "has data_offsets [", entry.begin, ", ", entry.end,
              "] past the end of the data (", data_size,
              " bytes): the file is truncated or the offsets are wrong");

  // The tensor's strides are products of its nonzero dimensions, which must fit in int64 even
  // where a zero dimension leaves it empty (at::empty computes them).
  const bool empty = std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end();
  uint64_t extent = c10::elementSize(entry.dtype);
  bool overflow = false;
  for (int64_t dim : entry.shape) {
    overflow |=
        __builtin_mul_overflow(extent, static_cast<uint64_t>(std::max<int64_t>(dim, 1)), &extent);
  }
  TORCH_CHECK(!overflow && extent <= uint64_t{std::numeric_limits<int64_t>::max()}, where,
              "has shape ", shape_string(entry.shape), " of ", dtype_text,
              ", whose size in bytes or strides overflow int64");
  const uint64_t needed = empty ? 0 : extent;
  TORCH_CHECK(entry.end - entry.begin == needed, where, "has data_offsets [", entry.begin, ", ",
              entry.end, "] but shape ", shape_string(entry.shape), " of ", dtype_text, " needs ",
              needed, " bytes");
  return entry;
}

}  // namespace

struct SafetensorsFile::Mapping {
  Mapping(void* addr, size_t size) : addr(addr), size(size) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(addr, size); }

  void* addr;
  size_t size;
};

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TORCH_CHECK(fd.get() >= 0, "safetensors: cannot open '", path, "': ", errno_message());
  struct stat info {};
  TORCH_CHECK(::fstat(fd.get(), &info) == 0, prefix(path), "cannot stat: ", errno_message());
  TORCH_CHECK(S_ISREG(info.st_mode), prefix(path), "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  TORCH_CHECK(file_size >= 8, prefix(path), "the file is ", file_size,
              " bytes, too short for the 8-byte header size: it is truncated");
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  TORCH_CHECK(addr != MAP_FAILED, prefix(path), "cannot mmap: ", errno_message());
  mapping_ = std::make_shared<const Mapping>(addr, file_size);
  const auto* bytes = static_cast<const uint8_t*>(addr);

  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes, sizeof(header_size));
  TORCH_CHECK(header_size <= kMaxHeaderSize, prefix(path), "the header size ", header_size,
              " is over the limit of ", kMaxHeaderSize, " bytes");
  TORCH_CHECK(header_size <= file_size - 8, prefix(path), "the header size ", header_size,
              " runs past the end of the file (", file_size, " bytes): it is truncated");
  const auto* text = reinterpret_cast<const char*>(bytes + 8);
  const Header header = parse_header(path, text, text + header_size);
  TORCH_CHECK(header.json.is_object(), prefix(path), "the header must be a JSON object, got ",
              header.json.type_name());
  data_ = bytes + 8 + header_size;
  const uint64_t data_size = file_size - 8 - header_size;

  std::vector<std::pair<std::string, Entry>> parsed;
  for (const std::string& key : header.keys) {
    const Json& value = header.json.at(key);
    if (key == kMetadataKey) {
      metadata_ = parse_metadata(path, value);
    } else {
      parsed.emplace_back(key, parse_entry(path, key, value, data_size));
    }
  }

  // The ranges must tile the data region exactly: overlapping tensors would alias each other, and
  // bytes of no tensor could hide another file in this one.
  std::stable_sort(parsed.begin(), parsed.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.second.begin, a.second.end) <
           std::make_pair(b.second.begin, b.second.end);
  });
  const std::pair<std::string, Entry>* previous = nullptr;
  for (const auto& current : parsed) {
    const auto& [name, entry] = current;
    const uint64_t covered = previous ? previous->second.end : 0;
    TORCH_CHECK(entry.begin >= covered, tensor_prefix(path, name), "has data_offsets [",
                entry.begin, ", ", entry.end, "], which overlap tensor '", previous->first, "' [",
                previous->second.begin, ", ", previous->second.end, "]");
    TORCH_CHECK(entry.begin == covered, prefix(path), "the data bytes [", covered, ", ",
                entry.begin, ") ",
                previous ? "between tensor '" + previous->first + "' and " : std::string("before "),
                "tensor '", name, "' belong to no tensor (the format allows no holes)");
    previous = &current;
  }
  const uint64_t covered = previous ? previous->second.end : 0;
  TORCH_CHECK(covered == data_size, prefix(path), "the data bytes [", covered, ", ", data_size,
              ") ",
              previous ? "after tensor '" + previous->first + "'"
                       : std::string("of a file with no tensors"),
              " belong to no tensor (the format allows no holes)");

  for (auto& [name, entry] : parsed) {
    names_.push_back(name);
    entries_.emplace(std::move(name), std::move(entry));
  }
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) > 0; }

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "safetensors: '", path_, "' has no tensor '", name, "'");
  return it->second;
}

std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const {
  return entry(name).shape;
}

at::ScalarType SafetensorsFile::dtype(const std::string& name) const { return entry(name).dtype; }

at::Tensor SafetensorsFile::tensor(const std::string& name, bool copy) const {
  const Entry& e = entry(name);
  const uint8_t* bytes = data_ + e.begin;
  const size_t nbytes = e.end - e.begin;
  if (e.dtype == at::kBool) {
    const auto* bad = std::find_if(bytes, bytes + nbytes, [](uint8_t b) { return b > 1; });
    TORCH_CHECK(bad == bytes + nbytes, tensor_prefix(path_, name), "of BOOL holds the byte ",
                static_cast<int>(*bad), " at element ", bad - bytes,
                ", where only 0 and 1 are bools");
  }
  const at::TensorOptions options = at::TensorOptions().dtype(e.dtype).device(at::kCPU);
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % c10::elementSize(e.dtype) == 0;
  if (!copy && aligned && nbytes > 0) {
    // The tensor's deleter holds the mapping. const_cast: the pages are PROT_READ, and the
    // header says that writing into the view is undefined.
    return at::from_blob(
        const_cast<uint8_t*>(bytes), e.shape, [mapping = mapping_](void*) {}, options);
  }
  at::Tensor out = at::empty(e.shape, options);
  if (nbytes > 0) std::memcpy(out.data_ptr(), bytes, nbytes);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> load_safetensors(const std::string& path) {
  const SafetensorsFile file(path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  tensors.reserve(file.names().size());
  for (const std::string& name : file.names()) tensors.emplace_back(name, file.tensor(name));
  return tensors;
}

namespace {

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    TORCH_CHECK(written >= 0, "safetensors: cannot write '", path, "': ", errno_message());
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

// Removes the temporary file unless the write got as far as renaming it.
class RemoveOnError {
 public:
  explicit RemoveOnError(std::string path) : path_(std::move(path)) {}
  RemoveOnError(const RemoveOnError&) = delete;
  RemoveOnError& operator=(const RemoveOnError&) = delete;
  ~RemoveOnError() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Everything is checked before the file is created. The header is written as "{key:value,...}"
  // of pieces the JSON library writes, keeping the given order in linear time.
  std::string text = "{";
  const auto append = [&text](const std::string& key, const auto& value) {
    if (text.size() > 1) text += ',';
    text += Json(key).dump() + ':' + value.dump();
  };
  if (!metadata.empty()) {
    for (const auto& [key, value] : metadata) {
      TORCH_CHECK(is_valid_utf8(key) && is_valid_utf8(value), prefix(path), "the metadata entry '",
                  key, "' is not valid UTF-8");
    }
    append(kMetadataKey, Json(metadata));
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(!name.empty(), prefix(path), "a tensor name must not be empty");
    TORCH_CHECK(name != kMetadataKey, prefix(path), "a tensor must not be named '", kMetadataKey,
                "', the header's metadata key");
    TORCH_CHECK(is_valid_utf8(name), prefix(path), "the tensor name '", name,
                "' is not valid UTF-8");
    TORCH_CHECK(seen.insert(name).second, tensor_prefix(path, name),
                "is given twice: names must be unique");
    const std::string where = tensor_prefix(path, name);
    TORCH_CHECK(tensor.defined(), where, "must be a defined tensor");
    TORCH_CHECK(tensor.layout() == at::kStrided, where, "must be a strided (dense) tensor, got ",
                tensor.layout());
    const char* dtype = dtype_name(tensor.scalar_type());
    TORCH_CHECK(dtype != nullptr, where, "has dtype ", tensor.scalar_type(),
                ", which safetensors cannot hold here (supported: ", supported_dtypes(), ")");
    const uint64_t nbytes = tensor.numel() * tensor.element_size();
    // Ordered: the fields in the order of the format's description, as other writers have them.
    append(name, nlohmann::ordered_json{{"dtype", dtype},
                                        {"shape", tensor.sizes().vec()},
                                        {"data_offsets", {offset, offset + nbytes}}});
    offset += nbytes;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_size = text.size();

  const std::string tmp = path + ".tmp";
  FileDescriptor fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  TORCH_CHECK(fd.get() >= 0, "safetensors: cannot create '", tmp, "': ", errno_message());
  RemoveOnError remove(tmp);
  write_all(fd.get(), &header_size, sizeof(header_size), tmp);
  write_all(fd.get(), text.data(), text.size(), tmp);
  for (const auto& [name, tensor] : tensors) {
    // One tensor on the CPU at a time. resolve_neg: a negative view's bytes are not its values.
    const at::Tensor host = tensor.to(at::kCPU).resolve_neg().contiguous();
    write_all(fd.get(), host.const_data_ptr(), host.nbytes(), tmp);
  }
  // fsync before the rename, so that a crash cannot leave `path` renamed but empty.
  TORCH_CHECK(::fsync(fd.get()) == 0, "safetensors: cannot sync '", tmp, "': ", errno_message());
  TORCH_CHECK(fd.close() == 0, "safetensors: cannot close '", tmp, "': ", errno_message());
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "safetensors: cannot rename '", tmp,
              "' to '", path, "': ", errno_message());
  remove.release();
}

}  // namespace torchmoe::checkpoint
