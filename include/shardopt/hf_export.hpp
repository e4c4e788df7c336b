/// \file
/// Streaming export in Hugging Face's sharded safetensors layout, from any layout (tensor,
/// pipeline, data parallel, any ZeRO stage), written by the ranks that hold the pieces:
///
///   shardopt::HfExportOptions o;
///   o.names["bert.embeddings.word_embeddings.weight"] = {"bert.embeddings.word_embeddings.weight",
///                                                        "cls.predictions.decoder.weight"};
///   o.write_extra = [&](const std::string& dir) { /* config.json, tokenizer files */ };
///   shardopt::export_hf_safetensors("out/hf", held_parameters, groups, &optimizer, o);  // all ranks
///
/// Note [Streaming Hugging Face export]
/// The result is what transformers' save_pretrained writes: `model-0000k-of-0000n.safetensors`
/// and `model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name:
/// file}}`), or one `model.safetensors` and no index when the whole export is one file, fp32. Each
/// pipeline stage's data-parallel rank 0 of tensor rank 0 writes its stage's file(s), at most
/// max_shard_bytes each; the other ranks only help gather. Tensors go one at a time, in the order
/// given: a parameter the optimizer shards (ZeRO stage 3, or a master copy in another dtype than
/// the model's) is assembled on data-parallel rank 0 from the owned slices of its fp32 master, one
/// broadcast per owner; a tensor-split one (its split record, Note [Split records]) is then
/// all-gathered over its tensor group into one buffer and written rank chunk by rank chunk in the
/// unsplit tensor's row-major order without the padding (no transposed copy); a tensor marked
/// pipeline-shared (the tied embedding) is written by the first stage only. So no rank holds more
/// than one tensor beyond the model, plus pieces of 64K elements on their way to the file. Sizes
/// are known before any byte is written (shapes and split records), so the file names and the
/// index are agreed first; files go to a temporary directory next to `dir`, the world agrees on
/// the outcome (any rank's failure is every rank's Error, and the temporary directory is
/// removed), and world rank 0 writes the index and the caller's extra files there and puts it in
/// place of `dir` with one rename (an atomic exchange with an earlier export's directory).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shardopt/parallel_layout.hpp"

namespace shardopt {

class DistributedOptimizer;

/// How export_hf_safetensors names and splits what it writes.
struct HfExportOptions {
  /// The names a tensor has in the export, by its given name: absent, the given name; several,
  /// the same values under each (a tied copy, as transformers' cls.predictions.decoder.weight);
  /// an empty list leaves the tensor out.
  std::map<std::string, std::vector<std::string>> names;
  /// A file is closed before a tensor would take it past this size (save_pretrained's
  /// max_shard_size, 5 GB by default); a larger tensor gets a file of its own. > 0.
  int64_t max_shard_bytes = int64_t{5} * 1000 * 1000 * 1000;
  /// Called on world rank 0 with the temporary directory before it is put in place: the files
  /// that go with the weights (config.json, the tokenizer's). Its exception fails the export.
  std::function<void(const std::string& dir)> write_extra;
  /// Tests only (fault injection): called on every rank once its files are written, before the
  /// world agrees; a throw fails the export on every rank and leaves `dir` as it was.
  std::function<void(int world_rank)> after_files_written;
};

/// What export_hf_safetensors did.
struct HfExportReport {
  std::vector<std::string> files;  ///< the weight files and the index, every rank's (the same list)
  int64_t total_bytes = 0;         ///< the tensors' bytes in all files (the index's total_size)
  int64_t rank_bytes = 0;          ///< tensor bytes this rank wrote
  int64_t rank_tensors = 0;        ///< tensors (names) this rank wrote
  int64_t largest_tensor_bytes = 0;  ///< the largest unsplit tensor of the export, fp32 bytes
  /// The largest buffer one tensor takes on a rank while it is gathered (a split tensor's padded
  /// rank chunks, in its own dtype): what the export adds to a rank's memory, at most, besides
  /// pieces of 64K elements.
  int64_t largest_buffer_bytes = 0;
};

/// Writes `tensors` (this rank's: a stage's held parameters, tensor-parallel slices, buffers) as
/// one Hugging Face safetensors export into directory `dir` (Note [Streaming Hugging Face
/// export]). `groups` is the grid; `optimizer`, when given, is this rank's over groups.dp: the
/// parameters it steps are exported from its fp32 master values (stage 3 included, no
/// gather_full_parameters needed); other tensors (buffers, frozen parameters, or all of them
/// without an optimizer) as they are, whole on every data-parallel rank. The ranks of one
/// pipeline stage must give the same names and shapes in the same order. Collective over
/// groups.world; on any rank's failure every rank throws the same Error and `dir` is unchanged:
/// Error{InvalidArgument} for a name written twice (two stages, or a name map that repeats one)
/// or a `dir` that holds what no export writes, Error{Mismatch} for ranks of one stage that
/// disagree, Error{Checkpoint} for what the file system refused.
HfExportReport export_hf_safetensors(const std::string& dir,
                                     const torch::OrderedDict<std::string, at::Tensor>& tensors,
                                     const ParallelGroups& groups,
                                     DistributedOptimizer* optimizer = nullptr,
                                     const HfExportOptions& options = {});

}  // namespace shardopt
