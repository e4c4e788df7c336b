// torch.save files read within bounds (Note [Bounds on torch.save files], torch_save_reader.hpp).
#include "checkpoint/torch_save_reader.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_set>
#include <vector>

#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

uint64_t le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// --- the zip's central directory: every entry stored -------------------------------------------

// Where the central directory starts and how many entries it lists, from the end-of-central-
// directory record (zip64's when the 32-bit fields are saturated); false where the bytes hold no
// such record, which torch's reader then refuses itself.
bool central_directory(const char* data, size_t size, uint64_t& offset, uint64_t& count) {
  constexpr size_t kEnd = 22;  // end-of-central-directory record without its comment
  if (size < kEnd) return false;
  const size_t lowest = size - kEnd > 0xffff ? size - kEnd - 0xffff : 0;
  for (size_t at = size - kEnd + 1; at-- > lowest;) {  // miniz also takes the last one
    if (le(data + at, 4) != 0x06054b50) continue;
    count = le(data + at + 10, 2);
    offset = le(data + at + 16, 4);
    if (count != 0xffff && offset != 0xffffffff) return true;
    // zip64: a locator just before this record points at the zip64 end record.
    if (at < 20 || le(data + at - 20, 4) != 0x07064b50) return false;
    const uint64_t end64 = le(data + at - 20 + 8, 8);
    if (end64 > size || size - end64 < 56 || le(data + end64, 4) != 0x06064b50) return false;
    count = le(data + end64 + 32, 8);
    offset = le(data + end64 + 48, 8);
    return true;
  }
  return false;
}

void check_entries_stored(const char* data, size_t size, const std::string& what) {
  uint64_t at = 0, count = 0;
  if (!central_directory(data, size, at, count)) return;
  constexpr uint64_t kHeader = 46;  // central directory file header without its names
  for (uint64_t i = 0; i < count; ++i) {
    if (at > size || size - at < kHeader || le(data + at, 4) != 0x02014b50) return;  // torch's to refuse
    const uint64_t method = le(data + at + 10, 2);
    const uint64_t name_len = le(data + at + 28, 2);
    const uint64_t next = at + kHeader + name_len + le(data + at + 30, 2) + le(data + at + 32, 2);
    const std::string name(data + at + kHeader, std::min<uint64_t>(name_len, size - at - kHeader));
    SHARDOPT_CHECK(method == 0, Checkpoint,
                   "{}: zip entry '{}' is compressed (method {}); torch.save stores every entry "
                   "uncompressed, and a compressed one may claim any size",
                   what, name, method);
    at = next;
  }
}

// --- the pickle: lengths inside the bytes, memo ids in order ----------------------------------

// Walks the protocol-2+ opcodes as far as it knows them (torch refuses the others): each
// length-prefixed argument must fit in the bytes after it, and each memo id be at most the number
// of values memoised so far (picklers number them 0, 1, 2, ...; torch's unpickler reserves a memo
// table as long as the id).
void check_pickle(const char* p, size_t size, const std::string& what) {
  size_t at = 0;
  uint64_t memoised = 0;
  auto need = [&](uint64_t n, const char* arg) {
    SHARDOPT_CHECK(n <= size - at, Checkpoint,
                   "{}: the pickle's {} at byte {} claims {} bytes, but only {} follow", what,
                   arg, at, n, size - at);
  };
  auto skip_line = [&] {
    const void* nl = std::memchr(p + at, '\n', size - at);
    if (nl == nullptr) return false;
    at = static_cast<const char*>(nl) - p + 1;
    return true;
  };
  auto memo = [&](uint64_t id) {
    SHARDOPT_CHECK(id <= memoised, Checkpoint,
                   "{}: the pickle memoises value {} after only {} (memo ids come in order)",
                   what, id, memoised);
    if (id == memoised) ++memoised;
  };
  auto sized = [&](int width, const char* arg) {  // a length of `width` bytes, then the bytes
    need(width, arg);
    const uint64_t n = le(p + at, width);
    at += width;
    need(n, arg);
    at += n;
  };
  while (at < size) {
    const auto op = static_cast<unsigned char>(p[at++]);
    switch (op) {
      case '.': return;  // STOP
      case '(': case '0': case '1': case '2': case 'N': case ')': case ']': case '}': case 'a':
      case 'e': case 'l': case 't': case 'R': case 'b': case 's': case 'u': case 'd': case 'Q':
      case 'o': case 0x81: case 0x85: case 0x86: case 0x87: case 0x88: case 0x89: case 0x8f:
      case 0x90: case 0x91: case 0x92: case 0x93: case 0x97: case 0x98:
        break;
      case 0x94: memo(memoised); break;  // MEMOIZE
      case 'K': case 'h': case 0x80: case 0x82: need(1, "argument"); at += 1; break;
      case 'M': case 0x83: need(2, "argument"); at += 2; break;
      case 'J': case 'j': case 0x84: need(4, "argument"); at += 4; break;
      case 'G': case 0x95: need(8, "argument"); at += 8; break;  // BINFLOAT, FRAME
      case 'q': need(1, "memo id"); memo(le(p + at, 1)); at += 1; break;
      case 'r': need(4, "memo id"); memo(le(p + at, 4)); at += 4; break;
      case 0x8a: sized(1, "long integer"); break;
      case 0x8b: sized(4, "long integer"); break;
      case 0x8c: case 'C': case 'U': sized(1, "string"); break;
      case 'X': case 'B': case 'T': sized(4, "string"); break;
      case 0x8d: case 0x8e: case 0x96: sized(8, "string"); break;
      case 'c':  // GLOBAL: module and name lines
        if (!skip_line() || !skip_line()) return;
        break;
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'g': case 'p':
        if (!skip_line()) return;
        break;
      default: return;  // not a pickle opcode torch reads: torch refuses it
    }
  }
}

// --- reading: torch's unpickler over records we keep the sizes of ------------------------------

class BytesReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  BytesReader(const char* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = std::min<uint64_t>(n, size_ - pos);
    std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

// Every tensor reachable from `root` (dicts, lists, tuples; a pickle may share or nest them
// arbitrarily, so no recursion and each container once) lies inside the record its storage was
// read from.
void check_storages(const c10::IValue& root, const std::map<const void*, size_t>& records,
                    const std::string& what) {
  std::vector<c10::IValue> todo{root};
  std::unordered_set<const void*> seen;
  while (!todo.empty()) {
    const c10::IValue v = std::move(todo.back());
    todo.pop_back();
    if (v.isPtrType() && !seen.insert(v.internalToPointer()).second) continue;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || !t.has_storage()) continue;
      const size_t bytes = t.storage().nbytes();
      const auto record = records.find(t.storage().data_ptr().get());
      const size_t held = record == records.end() ? 0 : record->second;
      SHARDOPT_CHECK(bytes <= held, Checkpoint,
                     "{}: a tensor's storage claims {} bytes, but its record in the file holds "
                     "{}; the file is corrupt",
                     what, bytes, held);
    } else if (v.isGenericDict()) {
      for (const auto& entry : v.toGenericDict()) {
        todo.push_back(entry.key());
        todo.push_back(entry.value());
      }
    } else if (v.isList()) {
      for (const c10::IValue& item : v.toListRef()) todo.push_back(item);
    } else if (v.isTuple()) {
      for (const c10::IValue& item : v.toTupleRef().elements()) todo.push_back(item);
    }
  }
}

}  // namespace

c10::IValue read_torch_save(const char* data, size_t size, const std::string& what) {
  check_entries_stored(data, size, what);
  caffe2::serialize::PyTorchStreamReader zip(std::make_shared<BytesReader>(data, size));
  at::DataPtr pickle;
  size_t pickle_size = 0;
  std::tie(pickle, pickle_size) = zip.getRecord("data.pkl");
  const auto* pickle_bytes = static_cast<const char*>(pickle.get());
  check_pickle(pickle_bytes, pickle_size, what);

  size_t read = 0;
  auto reader = [&](char* buf, size_t n) -> size_t {
    n = std::min(n, pickle_size - read);
    std::memcpy(buf, pickle_bytes + read, n);
    read += n;
    return n;
  };
  std::map<const void*, size_t> records;  // storage data -> bytes its record holds
  auto read_record = [&](const std::string& key) {
    auto [ptr, bytes] = zip.getRecord("data/" + key);
    records[ptr.get()] = bytes;
    return std::move(ptr);
  };
  // As torch::jit::pickle_load (no type resolver or object loader: plain values only), but every
  // storage stays on the CPU: a tensor saved from a GPU would otherwise be copied there, whole
  // storage and all, before check_storages can look at it.
  torch::jit::Unpickler unpickler(reader, nullptr, nullptr, read_record, at::Device(at::kCPU));
  unpickler.set_version(zip.version());
  c10::IValue value = unpickler.parse_ivalue();
  check_storages(value, records, what);
  return value;
}

}  // namespace shardopt::detail
