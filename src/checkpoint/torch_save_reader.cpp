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

// Where the central directory starts and how many entries it lists, as miniz (torch's zip reader)
// finds them: the last end-of-central-directory record, and zip64's figures whenever a zip64
// locator precedes it (torch writes one into every file, so a reader of the 32-bit fields alone
// could check another directory than the one miniz reads); false where the bytes hold no such
// record or a broken zip64 one, which miniz then refuses itself.
bool central_directory(const char* data, size_t size, uint64_t& offset, uint64_t& count) {
  constexpr size_t kEnd = 22;  // end-of-central-directory record without its comment
  if (size < kEnd) return false;
  const size_t lowest = size - kEnd > 0xffff ? size - kEnd - 0xffff : 0;
  for (size_t at = size - kEnd + 1; at-- > lowest;) {
    if (le(data + at, 4) != 0x06054b50) continue;
    count = le(data + at + 10, 2);
    offset = le(data + at + 16, 4);
    if (at < 20 || le(data + at - 20, 4) != 0x07064b50) return true;
    const uint64_t end64 = le(data + at - 20 + 8, 8);
    if (end64 > size || size - end64 < 56 || le(data + end64, 4) != 0x06064b50) return false;
    count = le(data + end64 + 32, 8);
    offset = le(data + end64 + 48, 8);
    return true;
  }
  return false;
}

// A central directory entry's sizes where the 32-bit fields say 0xFFFFFFFF: from its zip64 extra
// field (id 1: the uncompressed, then the compressed size, each present only when its field is
// saturated), as miniz reads them; left as they are when there is none.
void zip64_sizes(const char* extra, uint64_t length, uint64_t& uncompressed, uint64_t& compressed) {
  constexpr uint64_t kSaturated = 0xFFFFFFFF;
  if (uncompressed != kSaturated && compressed != kSaturated) return;
  for (uint64_t at = 0; at + 4 <= length;) {
    const uint64_t id = le(extra + at, 2), field = le(extra + at + 2, 2);
    if (at + 4 + field > length) return;
    if (id == 1) {
      uint64_t in = at + 4;
      for (uint64_t* value : {&uncompressed, &compressed}) {
        if (*value != kSaturated) continue;
        if (in + 8 > at + 4 + field) return;
        *value = le(extra + in, 8);
        in += 8;
      }
      return;
    }
    at += 4 + field;
  }
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
    // torch allocates the size an entry states before reading it: a stored entry holds as many
    // bytes as it states, which the file must hold (a 4 GiB claim in a 4 kB file was the fuzzer's).
    uint64_t stored = le(data + at + 20, 4), stated = le(data + at + 24, 4);
    zip64_sizes(data + at + kHeader + name_len,
                std::min<uint64_t>(le(data + at + 30, 2), size - std::min(size, at + kHeader + name_len)),
                stated, stored);
    SHARDOPT_CHECK(stated == stored && stated <= size, Checkpoint,
                   "{}: zip entry '{}' states {} bytes and stores {} in a file of {}; the file is "
                   "corrupt",
                   what, name, stated, stored, size);
    at = next;
  }
}

// --- the pickle: lengths inside the bytes, memo ids in order, a stack that holds -------------

// Runs the opcodes torch's unpickler reads (any other is refused: torch would refuse it too) on
// a model of its stack: each length-prefixed argument must fit in the bytes after it; each memo
// id be at most the number of values memoised so far (picklers number them 0, 1, 2, ...; torch
// reserves a memo table as long as the id); and no opcode may take more values than the stack
// holds above the innermost MARK, nor a MARK be missing (torch 1.13 reads such a pickle from an
// empty stack, a SEGV found by the fuzzer) or a dict get an odd number of keys and values.
class PickleCheck {
 public:
  PickleCheck(const char* p, size_t size, const std::string& what)
      : p_(p), size_(size), what_(what) {}

  void run() {
    while (at_ < size_) {
      const size_t op_at = at_;
      const auto op = static_cast<unsigned char>(p_[at_++]);
      switch (op) {
        case 0x80: SHARDOPT_CHECK(op_at == 0, Checkpoint, "{}: a PROTO opcode at byte {} of the "
                                  "pickle", what_, op_at);
                   skip(1); break;
        case '.': return;  // STOP
        case '(': marks_.push_back(depth_); break;
        case 'N': case ')': case ']': case '}': case 0x88: case 0x89: push(); break;
        case 'K': case 'h': skip(1), push(); break;   // BININT1, BINGET
        case 'M': skip(2), push(); break;              // BININT2
        case 'J': case 'j': skip(4), push(); break;   // BININT, LONG_BINGET
        case 'G': skip(8), push(); break;              // BINFLOAT
        case 0x8a: sized(1, "long integer"), push(); break;
        case 'X': sized(4, "string"), push(); break;   // BINUNICODE
        case 'c': line(), line(), push(); break;       // GLOBAL module\nname\n
        case 'q': need(1, "memo id"), memo(le(p_ + at_, 1)), at_ += 1, take(op, 1), push(); break;
        case 'r': need(4, "memo id"), memo(le(p_ + at_, 4)), at_ += 4, take(op, 1), push(); break;
        case 't': case 'l': to_mark(op), push(); break;                   // TUPLE, LIST
        case 'd': pairs(op, to_mark(op)), push(); break;                  // DICT
        case 'u': pairs(op, to_mark(op)), take(op, 1), push(); break;     // SETITEMS
        case 'e': to_mark(op), take(op, 1), push(); break;                // APPENDS
        case 'a': take(op, 2), push(); break;                             // APPEND
        case 's': take(op, 3), push(); break;                             // SETITEM
        case 0x85: case 0x86: case 0x87: take(op, op - 0x84), push(); break;  // TUPLE1-3
        case 'R': case 'b': case 0x81: take(op, 2), push(); break;  // REDUCE, BUILD, NEWOBJ
        case 'Q': take(op, 1), push(); break;                       // BINPERSID
        default:
          SHARDOPT_FAIL(Checkpoint, "{}: the pickle holds opcode 0x{:02x} at byte {}, which "
                        "torch's unpickler does not read", what_, op, op_at);
      }
    }
  }

 private:
  void need(uint64_t n, const char* arg) const {
    SHARDOPT_CHECK(n <= size_ - at_, Checkpoint,
                   "{}: the pickle's {} at byte {} claims {} bytes, but only {} follow", what_,
                   arg, at_, n, size_ - at_);
  }
  void skip(uint64_t n) { need(n, "argument"), at_ += n; }
  void sized(int width, const char* arg) {  // a length of `width` bytes, then the bytes
    need(width, arg);
    const uint64_t n = le(p_ + at_, width);
    at_ += width;
    need(n, arg);
    at_ += n;
  }
  void line() {
    const void* nl = std::memchr(p_ + at_, '\n', size_ - at_);
    SHARDOPT_CHECK(nl != nullptr, Checkpoint, "{}: the pickle ends inside a GLOBAL's name", what_);
    at_ = static_cast<const char*>(nl) - p_ + 1;
  }
  void memo(uint64_t id) {
    SHARDOPT_CHECK(id <= memoised_, Checkpoint,
                   "{}: the pickle memoises value {} after only {} (memo ids come in order)",
                   what_, id, memoised_);
    if (id == memoised_) ++memoised_;
  }
  void push() { ++depth_; }
  // Pops n values from above the innermost mark.
  void take(unsigned char op, uint64_t n) {
    const uint64_t floor = marks_.empty() ? 0 : marks_.back();
    SHARDOPT_CHECK(depth_ - floor >= n, Checkpoint,
                   "{}: the pickle's opcode 0x{:02x} at byte {} takes {} value(s), but the stack "
                   "holds {} above its mark",
                   what_, op, at_ - 1, n, depth_ - floor);
    depth_ -= n;
  }
  // Pops everything above the innermost mark and the mark; returns how many values.
  uint64_t to_mark(unsigned char op) {
    SHARDOPT_CHECK(!marks_.empty(), Checkpoint,
                   "{}: the pickle's opcode 0x{:02x} at byte {} needs a MARK before it", what_,
                   op, at_ - 1);
    const uint64_t n = depth_ - marks_.back();
    depth_ = marks_.back();
    marks_.pop_back();
    return n;
  }
  void pairs(unsigned char op, uint64_t n) const {
    SHARDOPT_CHECK(n % 2 == 0, Checkpoint,
                   "{}: the pickle's opcode 0x{:02x} at byte {} gets {} values for a dict's keys "
                   "and values",
                   what_, op, at_ - 1, n);
  }

  const char* p_;
  size_t size_;
  const std::string& what_;
  size_t at_ = 0;
  uint64_t memoised_ = 0;
  uint64_t depth_ = 0;
  std::vector<uint64_t> marks_;  // depth_ at each open MARK
};

// --- reading: torch's unpickler over records we keep the sizes of ------------------------------

// torch's MemoryReadAdapter would do, but torch 1.13's copies past the end when crafted zip
// metadata asks it to (2.x clamps, as this does).
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
  PickleCheck(pickle_bytes, pickle_size, what).run();

  size_t read = 0;
  auto reader = [&](char* buf, size_t n) -> size_t {
    n = std::min(n, pickle_size - read);
    if (n == 0) return n;  // an empty data.pkl has no bytes at all (a null pointer)
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
