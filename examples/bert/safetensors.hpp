// A small reader and writer of the safetensors format (Hugging Face's model.safetensors), torch-
// free. The format: an unsigned 64-bit little-endian header length N, N bytes of a JSON object
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

namespace bert::safetensors {

// Bytes per element of a dtype name ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8",
// "BOOL"); throws std::invalid_argument for other names.
size_t dtype_size(const std::string& dtype);

struct TensorView {
  std::string dtype;            // "F32", ...
  std::vector<int64_t> shape;   // row-major
  const void* data = nullptr;   // prod(shape) * dtype_size(dtype) bytes
};

// Writes the tensors in the order given (names must be unique) and the metadata, atomically:
// a temporary file renamed over `path`. Throws std::runtime_error naming the file.
void write(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
           const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  size_t offset = 0, nbytes = 0;  // within File::data
};

struct File {
  std::vector<Entry> entries;  // in data order
  std::map<std::string, std::string> metadata;
  std::vector<char> data;      // the data section
  const Entry* find(const std::string& name) const;
  const char* bytes(const Entry& e) const { return data.data() + e.offset; }
};

// Reads and checks a whole file: header size and JSON, dtypes, shapes against byte counts,
// offsets inside the data section and tiling it. Throws std::runtime_error naming the file and
// what is wrong.
File read(const std::string& path);
// The same checks on a file's bytes in memory; `name` stands for the file in messages (the fuzz
// harness tests/fuzz/safetensors_fuzz.cpp).
File parse(const char* bytes, size_t size, const std::string& name);

// Whether `path` starts like a safetensors file (a plausible header length, then '{').
bool looks_like(const std::string& path);

}  // namespace bert::safetensors
