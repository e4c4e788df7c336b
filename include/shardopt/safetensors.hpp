/// \file
/// A small reader and writer of the safetensors format (Hugging Face's model.safetensors), torch-
/// free; the library's one owner of the format (the streaming export, shardopt/hf_export.hpp, and
/// the BERT example's --init-checkpoint / --dump-logits use it). The format: an unsigned 64-bit little-endian header length N, N bytes of a JSON object
// {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}
// (padded with spaces to a multiple of 8), then the tensors' raw little-endian bytes, row-major,
// each at its offsets relative to the end of the header, together covering the data section
// without holes or overlaps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardopt::safetensors {

/// Bytes per element of a dtype name ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8",
/// "U8", "BOOL"); throws std::invalid_argument for other names.
size_t dtype_size(const std::string& dtype);

/// One tensor to write, its bytes in memory (write()).
struct TensorView {
  std::string dtype;           ///< "F32", ...
  std::vector<int64_t> shape;  ///< row-major
  const void* data = nullptr;  ///< prod(shape) * dtype_size(dtype) bytes
};

/// One tensor of a file whose bytes come later (Writer).
struct TensorInfo {
  ///@{
  /// A unique name; its dtype ("F32", ...).
  std::string name, dtype;
  ///@}
  std::vector<int64_t> shape;  ///< row-major
  size_t nbytes() const;       ///< prod(shape) * dtype_size(dtype)
};

/// Writes one file whose tensors' names, dtypes and shapes are known before their bytes: the
/// header goes out at construction, then each tensor's bytes in the order declared, appended in
/// pieces of any size, so no tensor has to be whole in memory at once (the streaming export). Not
/// atomic by itself: it writes `path` directly (write() below and the export's temporary
/// directory make it so). Throws std::runtime_error naming the file.
class Writer {
 public:
  /// Creates `path` and writes the header of `tensors` (in that order) and `metadata`.
  Writer(std::string path, const std::vector<TensorInfo>& tensors,
         const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~Writer();  ///< closes the file if close() was not reached (an error); the file stays partial
  Writer(const Writer&) = delete;             ///< one owner of the file
  Writer& operator=(const Writer&) = delete;  ///< one owner of the file
  /// The next `n` bytes of the data section; more than the tensors declared is an error.
  void append(const void* bytes, size_t n);
  /// Checks that every declared byte came, flushes and fsyncs the file and closes it.
  void close();
  size_t data_bytes() const { return total_; }  ///< the data section's size (the tensors' bytes)

 private:
  std::string path_;
  void* file_ = nullptr;  // FILE*
  size_t total_ = 0, written_ = 0;
};

/// Writes the tensors in the order given (names must be unique) and the metadata, atomically:
/// a temporary file renamed over `path`. Throws std::runtime_error naming the file.
void write(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
           const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// One tensor of a file read (File).
struct Entry {
  ///@{
  /// Its name and dtype ("F32", ...).
  std::string name, dtype;
  ///@}
  std::vector<int64_t> shape;  ///< row-major
  ///@{
  /// Where its bytes lie within File::data, and how many.
  size_t offset = 0, nbytes = 0;
  ///@}
};

/// A whole file read and checked (read(), parse()).
struct File {
  std::vector<Entry> entries;                    ///< in data order
  std::map<std::string, std::string> metadata;   ///< the header's __metadata__
  std::vector<char> data;                        ///< the data section
  const Entry* find(const std::string& name) const;  ///< the entry named `name`, or null
  /// The first byte of entry `e`'s data.
  const char* bytes(const Entry& e) const { return data.data() + e.offset; }
};

/// Reads and checks a whole file: header size and JSON, dtypes, shapes against byte counts,
/// offsets inside the data section and tiling it. Throws std::runtime_error naming the file and
/// what is wrong.
File read(const std::string& path);
/// The same checks on a file's bytes in memory; `name` stands for the file in messages (the fuzz
/// harness tests/fuzz/safetensors_fuzz.cpp).
File parse(const char* bytes, size_t size, const std::string& name);

/// Whether `path` starts like a safetensors file (a plausible header length, then '{').
bool looks_like(const std::string& path);

}  // namespace shardopt::safetensors
