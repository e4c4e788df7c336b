// The optimizer-state readers of outside bytes in one process (issue 42's fuzz findings, each
// input kept under tests/fuzz/corpus as regress-*.hex): torch::save / torch::load of a
// consolidated DistributedOptimizer, and the torch.save files of full state dicts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>

#include <fstream>

#include <sstream>
#include <string>

#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"
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

}  // namespace
}  // namespace shardopt
