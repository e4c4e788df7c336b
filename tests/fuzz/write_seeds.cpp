// Writes the seeds of the optimizer-state harnesses from our own writers, as *.hex text (no
// binary file in git): checkpoint directories (save_checkpoint of the tiny model, fuzz_model.hpp),
// torch::save archives of a consolidated DistributedOptimizer and of torch::optim::AdamW, and the
// torch.save files consolidate_checkpoint writes.
//   fuzz_write_seeds tests/fuzz/corpus   (writes <dir>/{checkpoint_dir,torch_load,state_dict_file})
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"

namespace {

namespace fs = std::filesystem;
using shardopt::fuzz::FuzzNet;

const char* kRuleNames[] = {"adamw", "sgd", "adagrad", "adam-amsgrad"};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_hex(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path);
  for (size_t i = 0; i < bytes.size(); ++i) {
    char two[3];
    std::snprintf(two, sizeof(two), "%02x", static_cast<unsigned char>(bytes[i]));
    out << two << ((i + 1) % 32 == 0 ? "\n" : "");
  }
  out << "\n";
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

std::map<std::string, std::string> dir_files(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    files[e.path().filename().string()] = read_file(e.path().string());
  }
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* name : {"checkpoint_dir", "torch_load", "state_dict_file"}) {
    fs::create_directories(root / name);
  }
  const shardopt::fuzz::ScratchDir tmp;
  for (int rule = 0; rule < 4; ++rule) {
    const int stage = rule % 3;  // saved at stages 0-2, loaded at another
    const FuzzNet net;
    auto opt = net.optimizer(rule, stage);
    net.train(*opt, 2);
    // A checkpoint directory with the module state, its tied alias and a trainer tensor.
    const std::string ckpt = tmp / fmt::format("ckpt-{}", rule);
    shardopt::SaveOptions so;
    so.module_state = net.module_state();
    so.aliases = {{"decoder.weight", "embed.weight"}};
    shardopt::save_checkpoint(*opt, ckpt, {R"({"step": 2})", {{"rng", at::arange(3)}}}, so);
    const int load_stage = (stage + 1 + rule) % 4;
    // flags (checkpoint_dir_fuzz.cpp): 0x01 fix checksums, stage << 1, rule << 3, 0x40
    // consolidate, 0x80 module state; half the seeds fix checksums, half do not.
    const int flags = (rule % 2) | (load_stage << 1) | (rule << 3) | (rule < 2 ? 0x40 : 0) | 0x80;
    write_hex(root / "checkpoint_dir" /
                  fmt::format("valid-{}-stage{}-into-stage{}.hex", kRuleNames[rule], stage,
                              load_stage),
              std::string(1, static_cast<char>(flags)) +
                  shardopt::fuzz::encode_files(dir_files(ckpt)));
    // torch::save of the consolidated state.
    opt->consolidate_state_dict(0);
    std::ostringstream archive;
    torch::save(*opt, archive);
    write_hex(root / "torch_load" / fmt::format("valid-{}-stage{}.hex", kRuleNames[rule], stage),
              archive.str());
    // consolidate_checkpoint's files: model.pt and the optimizer state.
    shardopt::ConsolidateOptions co;
    co.optimizer_state_out = tmp / "optimizer.pt";
    shardopt::consolidate_checkpoint(ckpt, tmp / "model.pt", co);
    std::map<std::string, std::string> files{{"model.pt", read_file(tmp / "model.pt")}};
    if (rule != 3) files["optimizer.pt"] = read_file(tmp / "optimizer.pt");  // model only once
    write_hex(root / "state_dict_file" /
                  fmt::format("valid-{}{}-stage{}.hex", kRuleNames[rule],
                              rule == 3 ? "-model-only" : "", load_stage),
              std::string(1, static_cast<char>(load_stage | (rule << 2))) +
                  shardopt::fuzz::encode_files(files));
  }
  // Issue 42's finding (Note [Tensors from files], src/checkpoint/staging.hpp): a state tensor
  // whose strides reach past its storage, as the unit test TorchArchive.StateTensorOutside* makes.
  {
    const FuzzNet net;
    auto opt = net.optimizer(0, 0);
    net.train(*opt, 2);
    opt->consolidate_state_dict(0);
    const at::Tensor t = opt->state_dict().groups[0].params[0].state.at("exp_avg");
    t.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), {1000, 1});
    std::ostringstream archive;
    torch::save(*opt, archive);
    write_hex(root / "torch_load" / "regress-strides-past-storage.hex", archive.str());
  }
  // Before the first step (no state), and torch::optim::AdamW's own archive (cross-loadable).
  {
    const FuzzNet net;
    auto opt = net.optimizer(0, 1);
    opt->consolidate_state_dict(0);
    std::ostringstream archive;
    torch::save(*opt, archive);
    write_hex(root / "torch_load" / "valid-adamw-before-first-step.hex", archive.str());
  }
  {
    const FuzzNet net;
    // Group 0 as ours lists it: the weight, its tied second name (whose state ours ignores; a
    // tensor of its own here, as torch would step a repeated one twice) and the frozen scale.
    const at::Tensor tied = at::zeros_like(net.w).set_requires_grad(true);
    torch::optim::AdamW adamw(std::vector<at::Tensor>{net.w, tied, net.frozen},
                              torch::optim::AdamWOptions(0.01));
    adamw.add_param_group(torch::optim::OptimizerParamGroup(
        {net.b}, std::make_unique<torch::optim::AdamWOptions>(0.02)));
    for (int s = 0; s < 2; ++s) {
      adamw.zero_grad();
      ((net.w.sum(0) * net.b).sum() + net.b.sum()).backward();
      adamw.step();
    }
    std::ostringstream archive;
    torch::save(adamw, archive);
    write_hex(root / "torch_load" / "valid-torch-optim-adamw.hex", archive.str());
  }
  return 0;
}
