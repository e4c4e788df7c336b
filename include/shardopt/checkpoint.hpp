/// \file
/// Sharded checkpoints of a DistributedOptimizer: every rank writes its shard of the fp32 master
/// parameters and optimizer state, rank 0 a JSON manifest keyed by parameter name; loading works
/// on any world size and stage (resharding), and consolidation writes one full state dict.
///
///   shardopt::save_checkpoint(opt, "out/checkpoint", {R"({"step": 100})", {{"rng", rng}}});
///   auto trainer = shardopt::load_checkpoint(opt, "out/checkpoint");   // trainer.json, .tensors
///   shardopt::consolidate_checkpoint("out/checkpoint", "model.pt");   // torch.load() -> {name: t}
///
/// Note [Atomic checkpoints]
/// A save writes everything into the sibling directory `.<name>.tmp`, fsyncs every file and the
/// directory, and only when all ranks succeeded makes it visible with one rename: an exchange with
/// the previous `<name>` (renameat2 RENAME_EXCHANGE), after which the old one is deleted. A crash
/// at any point leaves the previous checkpoint complete and loadable; a leftover `.<name>.tmp` is
/// never read and is removed by the next save. All ranks must see the same filesystem.
///
/// Note [Agreement before state changes]
/// Save and load run every fallible step first (files, checksums, model checks), then all ranks
/// exchange their outcome; if any rank failed, every rank throws an Error of the failing rank's
/// kind and message, and no rank has changed its optimizer. Only then is the state replaced.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"

namespace shardopt {

/// Format of the manifest and shard files this build writes. It reads versions 1 to this one
/// (version 1's shard files carry zlib's CRC-32 where later ones have CRC-32C; version 3's end
/// with their block checksums, which versions 1 and 2 list in the manifest: docs/checkpoints.md).
inline constexpr int kCheckpointFormatVersion = 3;

/// The trainer's own state, stored in the same atomic checkpoint: `json` (a JSON object as text)
/// from rank 0, and per-rank tensors (e.g. the torch CPU generator state), saved by every rank.
struct TrainerState {
  std::string json = "{}";  ///< JSON object (text), rank 0's
  std::map<std::string, at::Tensor> tensors;  ///< this rank's tensors by key (e.g. "rng")
};

/// What save_checkpoint stores besides the optimizer (module_save_options() fills the first two).
struct SaveOptions {
  /// What a model holds besides the optimizer's parameters, so that the consolidated model.pt
  /// loads with load_state_dict(strict=True): its buffers and frozen parameters by state-dict
  /// name (world rank 0's values are stored), and aliases of optimizer parameters (a decoder
  /// tied to the embedding: alias -> the name the optimizer knows it by). load_checkpoint returns
  /// the stored tensors on rank 0 as TrainerState::tensors["module/<name>"].
  std::map<std::string, at::Tensor> module_state;
  /// Second names of optimizer parameters (tied weights): alias -> the name the optimizer knows.
  std::map<std::string, std::string> aliases;
  /// Tests only: this rank throws right after its shard file is written and synced, as if the
  /// process died there; the partial temporary directory is left behind like after a real crash.
  int simulate_crash_after_shard_on_rank = -1;
  /// Tests only (fault injection): called on every rank once its shard file is written and synced,
  /// before the ranks agree that the save succeeded; a process killed here leaves the partial
  /// temporary directory behind, as a real crash would.
  std::function<void(int rank)> after_shard_written;
};

/// How load_checkpoint restores.
struct LoadOptions {
  /// Restore each param group's hyper-parameters (lr, betas, ...) as saved, as torch's
  /// load_state_dict does; false keeps the current ones.
  bool restore_hyperparameters = true;
  /// The model's tensors to restore from what the save stored in SaveOptions::module_state (world
  /// rank 0's buffers and frozen parameters), by the same names, e.g.
  /// module_save_options(model->named_parameters(), model->named_buffers()).module_state. Each is
  /// overwritten in place, on every rank, with the stored value (rank 0's, as DDP's
  /// broadcast_buffers makes every rank hold), once all ranks succeeded. A name the checkpoint
  /// does not store, or another shape or dtype, is Error{Mismatch} on every rank; stored tensors
  /// not named here are left alone. Empty (the default): the model's tensors are not touched.
  std::map<std::string, at::Tensor> module_state;
};

/// SaveOptions::module_state and aliases of a model: its buffers, its frozen parameters, and each
/// parameter name that is a second name of an earlier one (tied weights). Not collective.
SaveOptions module_save_options(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                const torch::OrderedDict<std::string, at::Tensor>& named_buffers);

/// Writes a checkpoint of `optimizer` (and `trainer`) into directory `dir`, atomically (see Note
/// [Atomic checkpoints]); an existing checkpoint there is replaced only once the new one is
/// complete. Collective: call on all ranks with the same `dir`. Throws Error{Checkpoint} when the
/// directory cannot be written, Error{Unsupported} for factory-built (ShardOptimizerFactory)
/// optimizers, whose state lives inside the torch optimizer.
void save_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                     const TrainerState& trainer = {}, const SaveOptions& options = {});

/// Restores parameters, optimizer state, step count and (optionally) hyper-parameters from `dir`,
/// whatever world size and stage wrote it, and the model's buffers named in
/// LoadOptions::module_state; returns the trainer state (`json` on every rank, `tensors` saved by
/// this rank number, empty for ranks the saving run did not have). Gradients are cleared.
/// Collective. On any rank's failure every rank throws (see Note [Agreement before state
/// changes]): Error{Checkpoint} for a missing manifest or shard file, a checksum mismatch or an
/// unknown format version; Error{Mismatch} when the checkpoint is of another model (parameter
/// names or shapes, stored buffers) or optimizer (rule, state buffers, parameter groups);
/// Error{Checkpoint} when a parameter's tensor-parallel split (its split record, Note [Split
/// records] in shardopt/tensor_parallel.hpp) differs from the one the checkpoint recorded.
TrainerState load_checkpoint(DistributedOptimizer& optimizer, const std::string& dir,
                             const LoadOptions& options = {});

/// What a checkpoint's manifest says (one process, not collective).
struct CheckpointParam {
  std::string name;  ///< the parameter's name
  std::vector<int64_t> shape;  ///< its full (unsharded) shape
  std::string dtype;  ///< "float32", ...
  int group = 0;  ///< its parameter group
  /// Tensor parallelism: {dim, full_size, padded_size} of its split (tp::Split, Note [Split
  /// records]); empty where it is not split.
  std::vector<int64_t> split;
};
/// A checkpoint's manifest, read by read_checkpoint_info().
struct CheckpointInfo {
  std::string dir;  ///< the directory read
  int format_version = 0;  ///< kCheckpointFormatVersion of the writer
  int world_size = 0;  ///< ranks of the run that saved
  int stage = 0;  ///< ZeRO stage of the run that saved (0-3)
  std::string precision;  ///< "fp32", "bf16", "fp16"
  int64_t step = 0;  ///< optimizer steps taken
  std::string rule;                      ///< "adamw", ...
  std::vector<std::string> state_names;  ///< "exp_avg", "exp_avg_sq", ...
  std::vector<CheckpointParam> params;   ///< layout order
  std::string trainer_json;  ///< the TrainerState::json given at save
  std::string manifest_json;  ///< the whole manifest
};
/// Reads `dir`'s manifest (one process, not collective); throws Error{Checkpoint} when it is
/// missing or invalid.
CheckpointInfo read_checkpoint_info(const std::string& dir);

/// The full fp32 parameters by name, and optionally the full optimizer state, assembled from all
/// shards of `dir` (checksums verified). One process, not collective.
struct FullState {
  torch::OrderedDict<std::string, at::Tensor> params;  ///< the full fp32 parameters, layout order
  /// SaveOptions::module_state and aliases, when the save had them.
  std::map<std::string, at::Tensor> module_state;
  /// Second names of tied parameters, when the save had them.
  std::map<std::string, std::string> aliases;
  /// state name ("exp_avg", ...) -> parameter name -> tensor of the parameter's shape.
  std::map<std::string, torch::OrderedDict<std::string, at::Tensor>> optimizer_state;
  int64_t step = 0;  ///< optimizer steps taken
  std::string rule;  ///< the rule's name ("adamw", ...)
  std::string hyperparameters_json;  ///< per param group, as in the manifest
};
/// Assembles read_full_state's FullState from all shards of `dir` (the optimizer state only when
/// `with_optimizer_state`); throws Error{Checkpoint} on a missing or corrupt file.
FullState read_full_state(const std::string& dir, bool with_optimizer_state = false);

/// Options of consolidate_checkpoint.
struct ConsolidateOptions {
  /// Also write the full optimizer state here: {"format", "step", "rule", "param_groups" (JSON
  /// text), "state": {param name: {state name: tensor}}}.
  std::string optimizer_state_out;
};

/// Writes the full fp32 state dict {name: tensor} of checkpoint `dir` to file `out` in torch's
/// zip/pickle format, with the module state and aliases the save was given (SaveOptions):
/// `torch::pickle_load` in C++ and `torch.load` in Python read it. `dir` may also be a grid
/// checkpoint's base (save_grid_checkpoint): its committed save, whatever (t, p, V, d) wrote it,
/// with split parameters put back together and a tied parameter taken once; the optimizer state
/// (`optimizer_state_out`) only from a grid of one folder. The write is atomic (temporary file +
/// rename). One process, not collective (shardopt-consolidate CLI).
void consolidate_checkpoint(const std::string& dir, const std::string& out,
                            const ConsolidateOptions& options = {});

/// The {name: tensor} of a file consolidate_checkpoint or Python's torch.save(dict(...)) wrote (one
/// process, not collective); entries that are not tensors are skipped. Throws Error{Checkpoint}
/// naming the file when it cannot be read or holds no dict. Safe on a file from anywhere: every
/// tensor lies inside its storage and every storage inside the file, and no size the file claims
/// is allocated before it is read, so memory stays proportional to the file (torch's own
/// pickle_load keeps neither bound: Note [Bounds on torch.save files]).
torch::OrderedDict<std::string, at::Tensor> read_state_dict(const std::string& model_file);

/// The reverse: starts a sharded run from a full state. Every optimizer parameter must be present
/// with its shape (Error{Mismatch} otherwise); other entries (buffers, tied aliases, frozen
/// parameters) are ignored and their names returned. When `state.optimizer_state` is not empty,
/// the step count and every state buffer are restored too (the rule must match); otherwise the
/// optimizer state is left as it is. Collective; every rank passes the same values.
std::vector<std::string> load_full_state(DistributedOptimizer& optimizer, const FullState& state);
/// Parameters only, e.g. a model's named_parameters() or a pickle-loaded {name: tensor}.
std::vector<std::string> load_full_state_dict(
    DistributedOptimizer& optimizer, const torch::OrderedDict<std::string, at::Tensor>& params);
/// From files: `model_file` as consolidate_checkpoint or Python's torch.save(model.state_dict())
/// writes; `optimizer_file` (optional) as ConsolidateOptions::optimizer_state_out writes. Every
/// rank reads the files; Error{Checkpoint} names a file that cannot be read.
std::vector<std::string> load_full_state_dict(DistributedOptimizer& optimizer,
                                              const std::string& model_file,
                                              const std::string& optimizer_file = "");

}  // namespace shardopt
