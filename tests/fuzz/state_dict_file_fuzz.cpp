// Fuzz harness for full state dicts read from torch.save files (src/checkpoint/full_state.cpp):
// read_state_dict(model file) and load_full_state_dict(optimizer, model file, optimizer state
// file), both through torch's pickle_load. The input is a flags byte and a small archive of files
// (fuzz_files.hpp): "model.pt" and, when present, "optimizer.pt" (as consolidate_checkpoint and
// its ConsolidateOptions::optimizer_state_out write them). Each call returns or throws
// shardopt::Error (Checkpoint; Mismatch for the load into the tiny model, fuzz_model.hpp, at the
// stage (flags & 3) and rule ((flags >> 2) & 3) the flags pick); after a successful load a step
// must run. Anything else, a crash or a sanitizer report is a finding. Replayed over
// corpus/state_dict_file by CTest with the ordinary build.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const auto files = shardopt::fuzz::decode_files(data + 1, size - 1);
  const shardopt::fuzz::ScratchDir root;
  root.write(files);
  const std::string model = root / "model.pt";
  const std::string optimizer = files.count("optimizer.pt") ? root / "optimizer.pt" : "";
  using shardopt::ErrorKind;
  using shardopt::fuzz::returns_or_throws;
  returns_or_throws([&] { shardopt::read_state_dict(model); }, {ErrorKind::Checkpoint});
  const shardopt::fuzz::FuzzNet net;
  const auto opt = net.optimizer((flags >> 2) & 3, flags & 3);
  if (returns_or_throws([&] { shardopt::load_full_state_dict(*opt, model, optimizer); },
                        {ErrorKind::Checkpoint, ErrorKind::Mismatch})) {
    net.train(*opt, 1);
  }
  return 0;
}
