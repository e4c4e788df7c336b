// safetensors reader and writer (see shardopt/safetensors.hpp).
#include "shardopt/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <unistd.h>  // fsync

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace shardopt::safetensors {
namespace {

constexpr uint64_t kMaxHeader = uint64_t{100} << 20;  // the reference implementation's limit

bool little_endian() {
  const uint16_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

void need_little_endian() {
  if (!little_endian()) throw std::runtime_error("safetensors: big-endian hosts are not supported");
}

}  // namespace

size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) throw std::invalid_argument("safetensors: unsupported dtype '" + dtype + "'");
  return it->second;
}

size_t TensorInfo::nbytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

Writer::Writer(std::string path, const std::vector<TensorInfo>& tensors,
               const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  need_little_endian();
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& t : tensors) {
    if (header.contains(t.name)) throw std::runtime_error(fmt::format("safetensors: '{}' twice", t.name));
    const size_t n = t.nbytes();
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {total_, total_ + n}}};
    total_ += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  FILE* f = std::fopen(path_.c_str(), "wb");
  if (f == nullptr) {
    throw std::runtime_error(fmt::format("cannot write '{}': {}", path_, std::strerror(errno)));
  }
  const uint64_t n = text.size();
  if (std::fwrite(&n, sizeof n, 1, f) != 1 || std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    const int err = errno;
    std::fclose(f);  // no destructor runs for a constructor that throws
    throw std::runtime_error(fmt::format("cannot write '{}': {}", path_, std::strerror(err)));
  }
  file_ = f;
}

Writer::~Writer() {
  if (file_ != nullptr) std::fclose(static_cast<FILE*>(file_));
}

void Writer::append(const void* bytes, size_t n) {
  if (file_ == nullptr) throw std::runtime_error(fmt::format("'{}': written after close()", path_));
  if (n > total_ - written_) {
    throw std::runtime_error(fmt::format("'{}': {} more bytes than the {} its tensors declare",
                                         path_, written_ + n - total_, total_));
  }
  if (n > 0 && std::fwrite(bytes, 1, n, static_cast<FILE*>(file_)) != n) {
    throw std::runtime_error(fmt::format("cannot write '{}' (disk full?): {}", path_, std::strerror(errno)));
  }
  written_ += n;
}

void Writer::close() {
  if (written_ != total_) {
    throw std::runtime_error(fmt::format("'{}': {} bytes written of the {} its tensors declare",
                                         path_, written_, total_));
  }
  FILE* f = static_cast<FILE*>(file_);
  file_ = nullptr;
  const bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const int err = errno;
  if (std::fclose(f) != 0 || !ok) {
    throw std::runtime_error(fmt::format("cannot write '{}' (disk full?): {}", path_, std::strerror(err)));
  }
}

void write(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  std::vector<TensorInfo> infos;
  for (const auto& [name, t] : tensors) infos.push_back({name, t.dtype, t.shape});
  const std::string tmp = path + ".tmp";
  {
    Writer out(tmp, infos, metadata);
    for (size_t i = 0; i < tensors.size(); ++i) out.append(tensors[i].second.data, infos[i].nbytes());
    out.close();
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
}

const Entry* File::find(const std::string& name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

namespace {

// The header's JSON and the data section, checked (read() and parse() share it).
File parse_header(const std::string& text, std::vector<char> data, const std::string& path) {
  auto bad = [&](const std::string& what) {
    return std::runtime_error(fmt::format("{}: not a valid safetensors file: {}", path, what));
  };
  const auto header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) throw bad("the header is not a JSON object");
  File f;
  f.data = std::move(data);
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) throw bad(fmt::format("__metadata__ '{}' is not a string", k));
        f.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    Entry e;
    e.name = name;
    try {
      e.dtype = v.at("dtype").get<std::string>();
      // Only JSON integers: nlohmann casts a float to an integer, undefined past the integer's
      // range (found by the fuzzer, issue 42).
      for (const char* field : {"shape", "data_offsets"}) {
        for (const auto& x : v.at(field)) {
          if (!x.is_number_integer()) {
            throw bad(fmt::format("'{}': field {} holds {}, not an integer", name, field, x.dump()));
          }
        }
      }
      e.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto offsets = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > f.data.size()) {
        throw bad(fmt::format("'{}': field data_offsets {} outside the {} data bytes", name,
                              v.at("data_offsets").dump(), f.data.size()));
      }
      e.offset = offsets[0];
      e.nbytes = offsets[1] - offsets[0];
    } catch (const nlohmann::json::exception&) {
      throw bad(fmt::format("'{}': expected dtype, shape and data_offsets, got {}", name, v.dump()));
    }
    size_t want = 0;
    try {
      want = dtype_size(e.dtype);
    } catch (const std::invalid_argument&) {
      throw bad(fmt::format("'{}': unknown dtype '{}'", name, e.dtype));
    }
    // Checked: a product that wraps around could match the offsets and make a tensor of 10^15
    // elements over a few bytes (Note [Sizes from files] in src/checkpoint/format.hpp).
    for (int64_t d : e.shape) {
      if (d < 0) throw bad(fmt::format("'{}': field shape [{}] has a negative dimension", name,
                                       fmt::join(e.shape, ", ")));
    }
    const bool empty = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
    for (int64_t d : e.shape) {
      if (empty) {
        want = 0;
        break;
      }
      if (__builtin_mul_overflow(want, static_cast<size_t>(d), &want)) {
        throw bad(fmt::format("'{}': field shape [{}] of {} needs more than 2^64 bytes", name,
                              fmt::join(e.shape, ", "), e.dtype));
      }
    }
    if (want != e.nbytes) {
      throw bad(fmt::format("'{}': {} bytes for shape [{}] of {}, the offsets span {}", name, want,
                            fmt::join(e.shape, ", "), e.dtype, e.nbytes));
    }
    f.entries.push_back(std::move(e));
  }
  std::sort(f.entries.begin(), f.entries.end(),
            [](const Entry& a, const Entry& b) { return a.offset < b.offset; });
  size_t end = 0;
  for (const auto& e : f.entries) {
    if (e.offset != end) throw bad(fmt::format("'{}' does not start where the previous tensor ends", e.name));
    end = e.offset + e.nbytes;
  }
  if (end != f.data.size()) throw bad(fmt::format("{} bytes after the last tensor", f.data.size() - end));
  return f;
}

}  // namespace

File read(const std::string& path) {
  need_little_endian();
  auto bad = [&](const std::string& what) {
    return std::runtime_error(fmt::format("{}: not a valid safetensors file: {}", path, what));
  };
  // A directory opens as a stream whose size is meaningless (tellg -1): only regular files.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw std::runtime_error(fmt::format("{}: cannot read the file (not a regular file)", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot read the file", path));
  in.seekg(0, std::ios::end);
  const std::streamoff end_pos = in.tellg();
  if (end_pos < 0) throw std::runtime_error(fmt::format("{}: cannot read the file's size", path));
  const auto file_size = static_cast<uint64_t>(end_pos);
  in.seekg(0);
  uint64_t n = 0;
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(&n), sizeof n)) throw bad("shorter than 8 bytes");
  if (n > kMaxHeader || n > file_size - 8) {
    throw bad(fmt::format("header length {} beyond the file's {} bytes (or 100 MiB)", n, file_size));
  }
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  std::vector<char> data(file_size - 8 - n);
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  if (!in) throw bad("the data section could not be read");
  return parse_header(text, std::move(data), path);
}

File parse(const char* bytes, size_t size, const std::string& name) {
  need_little_endian();
  auto bad = [&](const std::string& what) {
    return std::runtime_error(fmt::format("{}: not a valid safetensors file: {}", name, what));
  };
  uint64_t n = 0;
  if (size < 8) throw bad("shorter than 8 bytes");
  std::memcpy(&n, bytes, sizeof n);
  if (n > kMaxHeader || n > size - 8) {
    throw bad(fmt::format("header length {} beyond the file's {} bytes (or 100 MiB)", n, size));
  }
  return parse_header(std::string(bytes + 8, n), std::vector<char>(bytes + 8 + n, bytes + size),
                      name);
}

bool looks_like(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  char brace = 0;
  return in.read(reinterpret_cast<char*>(&n), sizeof n) && n > 0 && n <= kMaxHeader &&
         in.read(&brace, 1) && brace == '{';
}

}  // namespace shardopt::safetensors
