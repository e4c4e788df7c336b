// Fuzz harness for torch::load(optimizer, stream) into DistributedOptimizer (torch's
// serialize::InputArchive, then DistributedOptimizer::load, src/checkpoint/torch_archive.cpp):
// the input is the archive stream. torch's own zip/TorchScript reader may refuse it with its own
// exception (c10::Error and the like: not ours to fuzz, the harness stops there); once it has
// read an archive, our load into the tiny model (fuzz_model.hpp) at four stage/rule pairs either
// succeeds, after which a step must run, or throws shardopt::Error (Checkpoint, Mismatch or
// Unsupported, as documented). Anything else escaping, a crash or a sanitizer report is a finding.
// Replayed over corpus/torch_load by CTest with the ordinary build.
#include <torch/serialize.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <sstream>
#include <string>

#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"
#include "shardopt/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  torch::serialize::InputArchive archive;
  try {
    std::istringstream stream(std::string(reinterpret_cast<const char*>(data), size));
    archive.load_from(stream);
  } catch (const std::exception& e) {
    shardopt::fuzz::note(e.what());
    return 0;  // torch's reader refused the bytes: before any code of ours
  }
  // {rule, stage}: AdamW, SGD with momentum, Adagrad, Adam with amsgrad (fuzz_rule), stages 0-3.
  for (const auto& [rule, stage] : {std::pair{0, 2}, {1, 0}, {2, 3}, {3, 1}}) {
    const shardopt::fuzz::FuzzNet net;
    const auto opt = net.optimizer(rule, stage);
    using shardopt::ErrorKind;
    if (shardopt::fuzz::returns_or_throws(
            [&] { archive >> *opt; },
            {ErrorKind::Checkpoint, ErrorKind::Mismatch, ErrorKind::Unsupported})) {
      net.train(*opt, 1);  // what was loaded is usable: no exception, no sanitizer report
    }
  }
  return 0;
}
