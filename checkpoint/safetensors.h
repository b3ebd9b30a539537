#pragma once
// Checkpoints in Hugging Face's safetensors format: an 8-byte little-endian header size N, N bytes
// of JSON naming each tensor's dtype, shape and byte range, then the tensors' bytes, packed
// row-major with no holes. The reader memory-maps the file and checks the whole header before any
// tensor is read, so that a bad file (truncated, wrong dtype or shape, overlapping or missing
// bytes) fails when it is opened, with an error naming the file and the tensor, never by a read
// out of bounds. dtypes: F64, F32, F16, BF16, F8_E4M3 (float8_e4m3fn), F8_E5M2, I64, I32, I16, I8,
// U8, BOOL.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchmoe::checkpoint {

namespace detail {

// One tensor's record in a checked header: its bytes are [begin, end) of the data region.
struct SafetensorsEntry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

}  // namespace detail

/// One open safetensors file: its header parsed and checked, its bytes memory-mapped read-only.
/// Every method is const and safe to call from several threads at once. Errors are c10::Error.
class SafetensorsFile {
 public:
  /// Opens and checks `path`; throws c10::Error naming the file (and the tensor, where there is
  /// one) when it is not a valid safetensors file. As the format's reference reader, it takes a
  /// header that starts with '{', holds no NUL byte or duplicate key and nests at most 128 deep.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  /// The tensor names in file order (by data offset).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const;
  /// The tensor as a CPU tensor. Without `copy`, when its bytes lie at an address aligned for its
  /// dtype (so for every tensor of files that put wider dtypes first, as Python's safetensors
  /// does and save_safetensors does when given them in that order), it is a zero-copy view of the
  /// read-only mapping, which stays mapped for as long as any such tensor lives, after this object
  /// is gone too. Writing into such a view is undefined (the process gets SIGSEGV): pass `copy`
  /// for a tensor of its own that may be written, or clone the view. The file must not be changed
  /// in place meanwhile (the views would change, or fault if it shrinks); save_safetensors
  /// replaces a file, which leaves the old mapping intact. Misaligned bytes are always copied.
  /// BOOL bytes are checked to be 0 or 1 here, as a torch bool holding anything else is undefined.
  at::Tensor tensor(const std::string& name, bool copy = false) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  /// The header's "__metadata__" map; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Mapping;
  using Entry = detail::SafetensorsEntry;

  const Entry& entry(const std::string& name) const;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // the data region: the mapping past the header
  std::vector<std::string> names_;
  std::unordered_map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// All tensors of the file at `path` in file order, as SafetensorsFile::tensor returns them
/// (zero-copy read-only views where aligned).
std::vector<std::pair<std::string, at::Tensor>> load_safetensors(const std::string& path);

/// Writes `tensors` to `path` in the given order, with `metadata` as the header's "__metadata__"
/// (left out when empty). Tensors may live on any device (each is copied to the CPU in turn) and
/// have any strides; names must be unique, non-empty, valid UTF-8 and not "__metadata__". The
/// header is padded with spaces to a multiple of 8 bytes, so the data region starts 8-byte
/// aligned; each tensor then stays aligned for its dtype when wider dtypes come first. The file is
/// written to `path` + ".tmp" and renamed over `path` once complete, so that an error leaves no
/// half-written file (and an existing `path` untouched).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace torchmoe::checkpoint
