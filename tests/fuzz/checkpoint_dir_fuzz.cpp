// Fuzz harness for a whole checkpoint directory (src/checkpoint/: manifest.json and the shard
// files): the input is a flags byte and a small archive of files (fuzz_files.hpp) written into a
// fresh directory, which the real readers then read on one rank: read_checkpoint_info,
// read_full_state (with the optimizer state), consolidate_checkpoint (flag 0x40) and
// load_checkpoint into the tiny model (fuzz_model.hpp) at the stage and rule the flags pick. Each
// returns or throws shardopt::Error of a documented kind (Checkpoint; Mismatch for a load);
// anything else, a crash or a sanitizer report is a finding. Flags: 0x01 sets each listed file's
// "bytes" and "crc32" or "crc32c" (and the manifest's own checksum) to the truth before reading,
// so that mutated files reach past the checksums; 0x06 stage; 0x18 rule (fuzz_rule); 0x80 restore
// the module state. Replayed over corpus/checkpoint_dir by CTest with the ordinary build.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "fuzz/fuzz_files.hpp"
#include "fuzz/fuzz_model.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"

namespace {

std::string crc_text(std::string bytes) {
  const at::Tensor view =
      at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
  return shardopt::detail::crc_text(shardopt::detail::crc_of(view));
}

// Flag 0x01: what a writer with the checksums right would have written.
void fix_checksums(std::map<std::string, std::string>& files) {
  const auto it = files.find(shardopt::detail::kManifest);
  if (it == files.end()) return;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
    if (!j.is_object() || !j.contains("files") || !j["files"].is_array()) return;
    for (auto& f : j["files"]) {
      if (!f.is_object() || !f.contains("path") || !f["path"].is_string()) continue;
      const auto file = files.find(f["path"].get<std::string>());
      if (file == files.end()) continue;
      f["bytes"] = file->second.size();
      if (f.contains("crc32c")) {  // format version 2 (Note [Block checksums])
        f["crc32c"] = shardopt::detail::crc_text(shardopt::detail::checksum_of(
            shardopt::detail::ShardChecksum::Crc32c, file->second.data(),
            static_cast<int64_t>(file->second.size())));
      } else {
        f["crc32"] = crc_text(file->second);
      }
    }
    if (j.contains("manifest_crc32")) {  // Note [Manifest checksum] in manifest.cpp
      j.erase("manifest_crc32");
      j["manifest_crc32"] = crc_text(shardopt::detail::dump(j));
    }
  } catch (const nlohmann::json::exception&) {
    return;
  }
  it->second = shardopt::detail::dump(j, 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  auto files = shardopt::fuzz::decode_files(data + 1, size - 1);
  if (flags & 0x01) fix_checksums(files);
  const shardopt::fuzz::ScratchDir root;
  const std::string dir = root / "ckpt";
  std::filesystem::create_directory(dir);
  root.write(files, "ckpt");

  using shardopt::ErrorKind;
  using shardopt::fuzz::returns_or_throws;
  returns_or_throws([&] { shardopt::read_checkpoint_info(dir); }, {ErrorKind::Checkpoint});
  returns_or_throws([&] { shardopt::read_full_state(dir, true); }, {ErrorKind::Checkpoint});
  if (flags & 0x40) {
    shardopt::ConsolidateOptions co;
    co.optimizer_state_out = root / "optimizer.pt";
    returns_or_throws([&] { shardopt::consolidate_checkpoint(dir, root / "model.pt", co); },
                      {ErrorKind::Checkpoint});
  }
  const shardopt::fuzz::FuzzNet net;
  const auto opt = net.optimizer((flags >> 3) & 3, (flags >> 1) & 3);
  shardopt::LoadOptions lo;
  if (flags & 0x80) lo.module_state = net.module_state();
  returns_or_throws([&] { shardopt::load_checkpoint(*opt, dir, lo); },
                    {ErrorKind::Checkpoint, ErrorKind::Mismatch});
  return 0;
}
