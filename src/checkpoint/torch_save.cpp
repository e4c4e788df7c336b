// torch.save's zip format written from C++ (see torch_save.hpp). Note [torch.load-able files]:
// torch::jit::pickle_save writes the TorchScript pickle, which tags typed dicts with the global
// torch.jit._pickle.restore_type_tag; torch >= 2.6 loads with weights_only=True by default and
// refuses that global. This writer emits exactly what Python's torch.save emits for a dict of
// tensors: _rebuild_tensor_v2 over persistent storages ('storage', torch.<T>Storage, key, 'cpu',
// numel), collections.OrderedDict() hooks, plain dicts, all of them on weights_only's allow list.
#include "checkpoint/torch_save.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <string>

#include "shardopt/error.hpp"

namespace shardopt::detail {
namespace {

const char* storage_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kHalf: return "HalfStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    case at::kComplexFloat: return "ComplexFloatStorage";
    case at::kComplexDouble: return "ComplexDoubleStorage";
    default: return nullptr;
  }
}

// A protocol-2 pickle writer for the few opcodes a state dict needs; no memo.
class Pickle {
 public:
  explicit Pickle(caffe2::serialize::PyTorchStreamWriter& zip) : zip_(zip) { op('\x80'), op(2); }

  void value(const c10::IValue& v) {
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isString()) return str(v.toStringRef());
    if (v.isInt()) return integer(v.toInt());
    if (v.isDouble()) return real(v.toDouble());
    if (v.isBool()) return op(v.toBool() ? '\x88' : '\x89');
    if (v.isNone()) return op('N');
    if (v.isGenericDict()) {
      op('}');
      const auto dict = v.toGenericDict();
      if (dict.empty()) return;
      op('(');
      for (const auto& entry : dict) {
        value(entry.key());
        value(entry.value());
      }
      return op('u');
    }
    if (v.isList()) {
      op(']');
      const auto list = v.toListRef();
      if (list.empty()) return;
      op('(');
      for (const auto& item : list) value(item);
      return op('e');
    }
    SHARDOPT_FAIL(InvalidArgument,
                  "checkpoint: cannot write a {} into a torch.save file (supported: dict, list, "
                  "str, int, float, bool, None, tensor)",
                  v.tagKind());
  }

  void finish() {
    op('.');
    zip_.writeRecord("data.pkl", out_.data(), out_.size());
  }

 private:
  void op(char c) { out_.push_back(c); }
  void raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  void global(const char* module, const char* name) {
    op('c');
    out_ += module;
    op('\n');
    out_ += name;
    op('\n');
  }
  void str(const std::string& s) {
    op('X');
    const uint32_t n = static_cast<uint32_t>(s.size());
    raw(&n, 4);  // little-endian, like the rest of the format (see the byteorder record)
    out_ += s;
  }
  void integer(int64_t i) {
    if (i >= INT32_MIN && i <= INT32_MAX) {
      op('J');
      const int32_t v = static_cast<int32_t>(i);
      return raw(&v, 4);
    }
    op('\x8a');  // LONG1: 8 bytes of two's complement, little-endian
    op(8);
    raw(&i, 8);
  }
  void real(double d) {
    op('G');  // BINFLOAT is big-endian
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    for (int b = 7; b >= 0; --b) op(static_cast<char>((bits >> (8 * b)) & 0xff));
  }
  void int_tuple(at::IntArrayRef xs) {
    op('(');
    for (int64_t x : xs) integer(x);
    op('t');
  }

  void tensor(const at::Tensor& t) {
    const char* type = storage_type(t.scalar_type());
    SHARDOPT_CHECK(type != nullptr, InvalidArgument,
                   "checkpoint: cannot write a tensor of dtype {} into a torch.save file",
                   c10::toString(t.scalar_type()));
    SHARDOPT_CHECK(t.layout() == at::kStrided, InvalidArgument,
                   "checkpoint: cannot write a {} tensor into a torch.save file (strided only)",
                   c10::str(t.layout()));
    const at::Tensor data = t.detach().to(at::kCPU).contiguous();
    const std::string key = std::to_string(storages_++);
    zip_.writeRecord("data/" + key, data.data_ptr(), data.numel() * data.element_size());

    global("torch._utils", "_rebuild_tensor_v2");
    op('(');
    op('(');  // persistent id: ('storage', torch.<T>Storage, key, location, numel)
    str("storage");
    global("torch", type);
    str(key);
    str("cpu");
    integer(data.numel());
    op('t');
    op('Q');
    integer(0);  // storage offset
    int_tuple(data.sizes());
    int_tuple(data.strides());
    op('\x89');  // requires_grad = False
    global("collections", "OrderedDict");  // backward hooks: OrderedDict()
    op(')');
    op('R');
    op('t');
    op('R');
  }

  caffe2::serialize::PyTorchStreamWriter& zip_;
  std::string out_;
  int64_t storages_ = 0;
};

}  // namespace

std::vector<char> torch_save_bytes(const c10::IValue& value) {
  std::vector<char> bytes;
  caffe2::serialize::PyTorchStreamWriter zip([&bytes](const void* p, size_t n) {
    bytes.insert(bytes.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    return n;
  });
  Pickle pickle(zip);
  pickle.value(value);
  pickle.finish();
  zip.writeRecord("byteorder", "little", 6);
  zip.writeEndOfFile();
  return bytes;
}

}  // namespace shardopt::detail
