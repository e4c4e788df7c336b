// The optimizer-state readers of outside bytes in one process (issue 42's fuzz findings, each
// input kept under tests/fuzz/corpus as regress-*.hex): torch::save / torch::load of a
// consolidated DistributedOptimizer, and the torch.save files of full state dicts.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"
#include "checkpoint/torch_save.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

using fuzz::FuzzNet;
using test::expect_error;

// Makes `t` claim more elements than its storage holds, as a crafted file's sizes and strides do
// (Note [Tensors from files] in src/checkpoint/staging.hpp): the last row starts past the end.
void stretch_past_storage(const at::Tensor& t) {
  t.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), {1000, 1});
}

// The archive of a consolidated optimizer of `rule` (fuzz_rule) after two steps.
std::string saved_archive(int rule) {
  const FuzzNet net;
  auto opt = net.optimizer(rule, 0);
  net.train(*opt, 2);
  opt->consolidate_state_dict(0);
  std::ostringstream out;
  torch::save(*opt, out);
  return out.str();
}

// Every rule's hyper-parameters, bools included, come back from its own archive.
TEST(TorchArchive, EveryRuleRoundTrips) {
  for (int rule = 0; rule < 4; ++rule) {
    const FuzzNet net;
    auto opt = net.optimizer(rule, 1);
    std::istringstream in(saved_archive(rule));
    torch::load(*opt, in);
    net.train(*opt, 1);
    // SGD keeps no step in torch: a state with momentum buffers loads as step 1.
    EXPECT_EQ(opt->last_step().step, rule == 1 ? 2 : 3) << "rule " << rule;
  }
}

// torch's reader rebuilds a tensor whose strides reach past its storage without a complaint; a
// load must refuse it before a copy reads beyond the storage (regress-strides-past-storage.hex).
TEST(TorchArchive, StateTensorOutsideItsStorageIsRefused) {
  const FuzzNet source;
  auto saver = source.optimizer(0, 0);
  source.train(*saver, 2);
  saver->consolidate_state_dict(0);
  stretch_past_storage(saver->state_dict().groups[0].params[0].state.at("exp_avg"));
  std::ostringstream out;
  torch::save(*saver, out);
  const FuzzNet net;
  auto opt = net.optimizer(0, 1);
  std::istringstream in(out.str());
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(in);
  } catch (const c10::Error& e) {  // torch 2.x's reader checks the storage itself
    EXPECT_NE(std::string(e.what()).find("storage"), std::string::npos) << e.what();
    return;
  }
  expect_error([&] { archive >> *opt; }, ErrorKind::Checkpoint,
               {"'exp_avg'", "lies outside its storage of 48 bytes"});
}

// The same in a torch.save file of a state dict (read_state_dict, load_full_state_dict); torch
// 2.x's pickle_load refuses it itself, which the readers report as Error{Checkpoint} too.
TEST(TorchArchive, StateDictTensorOutsideItsStorageIsRefused) {
  const FuzzNet source;
  const at::Tensor w = source.w.detach().clone();
  stretch_past_storage(w);
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("embed.weight", w);
  dict.insert("fc.bias", source.b.detach());
  const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
  const fuzz::ScratchDir dir;
  std::ofstream(dir / "model.pt", std::ios::binary).write(bytes.data(), bytes.size());
  expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
               {"model.pt", "storage", "48 bytes"});
  const FuzzNet net;
  auto opt = net.optimizer(0, 2);
  expect_error([&] { load_full_state_dict(*opt, dir / "model.pt"); }, ErrorKind::Checkpoint,
               {"model.pt", "storage", "48 bytes"});
}

// --- Note [Bounds on torch.save files] (src/checkpoint/torch_save_reader.hpp) -------------------

// A torch.save zip holding `pickle` as data.pkl and `record` as data/0.
std::vector<char> torch_save_file(const std::string& pickle, const std::string& record) {
  std::vector<char> bytes;
  caffe2::serialize::PyTorchStreamWriter zip([&bytes](const void* p, size_t n) {
    bytes.insert(bytes.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    return n;
  });
  zip.writeRecord("data.pkl", pickle.data(), pickle.size());
  zip.writeRecord("data/0", record.data(), record.size());
  zip.writeEndOfFile();
  return bytes;
}

// {'w': a float tensor of `elements` over storage '0' of `numel` elements}, as Python's
// torch.save writes it (BININT1 counts, so both below 256).
std::string state_dict_pickle(int numel, int elements) {
  using namespace std::string_literals;
  auto str = [](const std::string& s) {
    return "X"s + static_cast<char>(s.size()) + "\0\0\0"s + s;
  };
  return "\x80\x02}("s + str("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" + str("storage") +
         "ctorch\nFloatStorage\n" + str("0") + str("cpu") + "K" + static_cast<char>(numel) +
         "tQK\0K"s + static_cast<char>(elements) + "\x85K\x01\x85\x89" +
         "ccollections\nOrderedDict\n)RtRu.";
}

void write_file(const std::filesystem::path& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

// torch's unpickler makes a storage as large as the pickle's element count says over a record
// that may hold fewer bytes (no check in torch 1.13 or 2.x): the reader compares the two.
TEST(TorchSaveFile, StorageLargerThanItsRecordIsRefused) {
  const fuzz::ScratchDir dir;
  write_file(dir / "ok.pt", torch_save_file(state_dict_pickle(2, 2), std::string(8, '\0')));
  EXPECT_EQ(read_state_dict(dir / "ok.pt").find("w")->numel(), 2);  // the pickle is torch's
  write_file(dir / "model.pt", torch_save_file(state_dict_pickle(64, 64), std::string(8, '\0')));
  expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
               {"model.pt", "claims 256 bytes", "holds 8"});
}

// A string length or a memo id the pickle states is what torch allocates for, before reading.
TEST(TorchSaveFile, AbsurdPickleLengthsAndMemoIdsAreRefused) {
  using namespace std::string_literals;
  const fuzz::ScratchDir dir;
  write_file(dir / "long.pt", torch_save_file("\x80\x02X\xff\xff\xff\x7f"s + "abc.", ""));
  expect_error([&] { read_state_dict(dir / "long.pt"); }, ErrorKind::Checkpoint,
               {"long.pt", "string", "claims 2147483647 bytes, but only 4 follow"});
  write_file(dir / "memo.pt", torch_save_file("\x80\x02}r\x00\x00\x00\xf0."s, ""));
  expect_error([&] { read_state_dict(dir / "memo.pt"); }, ErrorKind::Checkpoint,
               {"memo.pt", "memoises value 4026531840 after only 0"});
}

// torch 1.13's unpickler pops from an empty stack (a SEGV the state_dict_file fuzzer found:
// regress-pickle-stack-underflow-*.hex) and reads past the stack for a dict of odd length; the
// reader runs the opcodes on a model of the stack first, and refuses opcodes torch cannot read.
// An empty data.pkl (the fuzzer's; torch hands back no buffer for it) is a clear error.
TEST(TorchSaveFile, EmptyPickleIsRefused) {
  const fuzz::ScratchDir dir;
  write_file(dir / "empty.pt", torch_save_file("", ""));
  expect_error([&] { read_state_dict(dir / "empty.pt"); }, ErrorKind::Checkpoint, {"empty.pt"});
}

TEST(TorchSaveFile, PickleThatBreaksTheStackIsRefused) {
  using namespace std::string_literals;
  const fuzz::ScratchDir dir;
  const std::vector<std::pair<std::string, std::string>> cases{
      {"\x80\x02\x85."s, "opcode 0x85 at byte 2 takes 1 value(s), but the stack holds 0"},
      {"\x80\x02(NR."s, "opcode 0x52 at byte 4 takes 2 value(s), but the stack holds 1 above"},
      {"\x80\x02Nt."s, "opcode 0x74 at byte 3 needs a MARK"},
      {"\x80\x02}(Nu."s, "gets 1 values for a dict's keys and values"},
      {"\x80\x02\x8c\x01a."s, "opcode 0x8c at byte 2, which torch's unpickler does not read"}};
  for (const auto& [pickle, message] : cases) {
    write_file(dir / "model.pt", torch_save_file(pickle, ""));
    expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
                 {"model.pt", message});
  }
}

// A deflated zip entry may claim any uncompressed size, which torch's reader allocates first.
TEST(TorchSaveFile, CompressedEntriesAreRefused) {
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("w", at::ones({2}));
  std::vector<char> bytes = detail::torch_save_bytes(c10::IValue(dict));
  const char signature[] = {'P', 'K', 1, 2};
  const auto cd = std::search(bytes.begin(), bytes.end(), signature, signature + 4);
  ASSERT_NE(cd, bytes.end());
  cd[10] = 8;  // method: deflate
  const fuzz::ScratchDir dir;
  write_file(dir / "model.pt", bytes);
  expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
               {"model.pt", "is compressed (method 8)"});
  // torch writes zip64 end records, whose figures miniz reads: a 32-bit directory offset that
  // points elsewhere must not hide the entry from the check.
  const char end[] = {'P', 'K', 5, 6};
  const auto eocd = std::find_end(bytes.begin(), bytes.end(), end, end + 4);
  ASSERT_NE(eocd, bytes.end());
  std::fill(eocd + 16, eocd + 20, 0);
  write_file(dir / "model.pt", bytes);
  expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
               {"model.pt", "is compressed (method 8)"});
}

// torch allocates the size an entry states before reading it: a stored entry claiming 4 GiB in a
// small file (the fuzzer's out-of-memory input, kept as
// tests/fuzz/corpus/state_dict_file/regress-entry-states-4-gib.hex) is refused, and so is one
// whose stated and stored sizes differ.
TEST(TorchSaveFile, EntrySizesPastTheFileAreRefused) {
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("w", at::ones({2}));
  const std::vector<char> good = detail::torch_save_bytes(c10::IValue(dict));
  const char signature[] = {'P', 'K', 1, 2};
  const fuzz::ScratchDir dir;
  for (const uint32_t stated : {0xFFFFFFFFu, 1u << 20}) {
    std::vector<char> bytes = good;
    const auto cd = std::search(bytes.begin(), bytes.end(), signature, signature + 4);
    ASSERT_NE(cd, bytes.end());
    for (int i = 0; i < 4; ++i) cd[24 + i] = static_cast<char>(stated >> (8 * i));
    write_file(dir / "model.pt", bytes);
    expect_error([&] { read_state_dict(dir / "model.pt"); }, ErrorKind::Checkpoint,
                 {"model.pt", "states " + std::to_string(stated) + " bytes", "corrupt"});
  }
}

// A step count the file states is the next step()'s too: the fuzzer's -117506045
// (regress-negative-step.hex) loaded and threw from the fused kernel at the next step. Refused on
// load, before any state changes, as is one past 2^53.
TEST(TorchSaveFile, StepCountsOutsideTheirRangeAreRefused) {
  const fuzz::ScratchDir dir;
  const FuzzNet net;
  auto opt = net.optimizer(0, 0);
  net.train(*opt, 2);
  opt->save_checkpoint(dir / "ckpt");
  ConsolidateOptions co;
  co.optimizer_state_out = dir / "optim.pt";
  consolidate_checkpoint(dir / "ckpt", dir / "model.pt", co);
  std::ifstream in(dir / "optim.pt", std::ios::binary);
  const std::vector<char> saved((std::istreambuf_iterator<char>(in)), {});
  for (const int64_t step : {int64_t{-117506045}, (int64_t{1} << 53) + 1}) {
    auto dict = torch::jit::pickle_load(saved).toGenericDict();
    dict.insert_or_assign("step", step);
    write_file(dir / "bad.pt", detail::torch_save_bytes(c10::IValue(dict)));
    auto fresh = net.optimizer(0, 0);
    expect_error([&] { load_full_state_dict(*fresh, dir / "model.pt", dir / "bad.pt"); },
                 ErrorKind::Checkpoint, {"step count " + std::to_string(step), "outside 0..2^53"});
    fresh->consolidate_state_dict(0);
    EXPECT_EQ(fresh->state_dict().step, 0);  // unchanged
  }
  auto fresh = net.optimizer(0, 0);
  load_full_state_dict(*fresh, dir / "model.pt", dir / "optim.pt");
  fresh->consolidate_state_dict(0);
  EXPECT_EQ(fresh->state_dict().step, 2);
}

}  // namespace
}  // namespace shardopt
