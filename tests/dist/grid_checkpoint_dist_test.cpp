// Grid checkpoints (shardopt/grid_checkpoint.hpp): a test model of split layers (a vocab-parallel
// embedding tied to the decoder, column- and row-parallel layers) on pipeline stages, saved at
// (t, p, d) = (2, 2, 1) ZeRO stage 1 and resumed at (1, 1, 4) stage 3, (1, 4, 1) stage 0 and
// (4, 1, 1) stage 2, each continuing the uninterrupted run's losses within 1e-4, reading a bounded
// multiple of its share of the state (plus the manifests); a crash between two folders' writes
// leaves the previous commit the one that loads; keep-last-K; clear errors for a folder of another
// save, a missing folder and a piece whose shape disagrees. World of 4 ranks (threads or mpirun).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardopt/async_checkpoint.hpp"
#include "shardopt/estimate.hpp"
#include "shardopt/grid_checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/pipeline.hpp"
#include "shardopt/pipeline_runner.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 64, kHidden = 64, kFfn = 128;
constexpr int kLayers = 4;                // one per stage at p = 4
constexpr int64_t kRows = 2, kMicro = 4;  // a global batch: 4 micro-batches of 2 rows

struct Whole {  // the unsplit model's initial values, alike on every rank
  at::Tensor embedding;
  std::vector<at::Tensor> w1, b1, w2, b2;
};

Whole whole_model() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(23);
  Whole m;
  m.embedding = at::randn({kVocab, kHidden}, gen) * 0.5;
  for (int l = 0; l < kLayers; ++l) {
    m.w1.push_back(at::randn({kFfn, kHidden}, gen) * 0.3);
    m.b1.push_back(at::randn({kFfn}, gen) * 0.1);
    m.w2.push_back(at::randn({kHidden, kFfn}, gen) * 0.3);
    m.b2.push_back(at::randn({kHidden}, gen) * 0.1);
  }
  return m;
}

// Step `step`'s token ids and targets, kMicro * kRows of each.
std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randint(0, kVocab, {kMicro * kRows}, gen),
          at::randint(0, kVocab, {kMicro * kRows}, gen)};
}

// One rank's part of the model in a grid, its optimizer and a training loop.
struct GridModel {
  ParallelGroups g;
  tp::VocabParallelEmbedding embedding{nullptr};
  std::vector<tp::ColumnParallelLinear> up;
  std::vector<tp::RowParallelLinear> down;
  std::vector<int> layers;
  std::unique_ptr<DistributedOptimizer> opt;
  PipelineChunk chunk;
  at::Tensor targets;  // this step's
  int m = 1;           // micro-batches per data-parallel rank

  GridModel(const ParallelLayout& layout, int zero_stage) {
    g = make_parallel_groups(test::world(), layout);
    const Whole w = whole_model();
    const tp::TensorParallel tpo{g.tp};
    const bool holds_embedding = g.first_stage() || g.last_stage();
    ParamGroup group;
    {
      auto lock = test::seeded_draws(7);  // the layers draw from the default generator
      if (holds_embedding) embedding = tp::VocabParallelEmbedding(kVocab, kHidden, tpo);
      const int per_stage = kLayers / g.layout.pp;
      for (int l = g.pp_rank * per_stage; l < (g.pp_rank + 1) * per_stage; ++l) {
        layers.push_back(l);
        up.emplace_back(kHidden, kFfn, tpo);
        down.emplace_back(kFfn, kHidden, tpo);
      }
    }
    if (holds_embedding) {
      embedding->load_full(w.embedding);
      mark_pipeline_shared(embedding->weight);  // tied: the lookup and the decoder
      group.params.push_back({"embedding", embedding->weight});
    }
    for (size_t k = 0; k < layers.size(); ++k) {
      const int l = layers[k];
      up[k]->load_full(w.w1[l], w.b1[l]);
      down[k]->load_full(w.w2[l], w.b2[l]);
      group.params.push_back({fmt::format("layer{}.up.weight", l), up[k]->weight});
      group.params.push_back({fmt::format("layer{}.up.bias", l), up[k]->bias});
      group.params.push_back({fmt::format("layer{}.down.weight", l), down[k]->weight});
      group.params.push_back({fmt::format("layer{}.down.bias", l), down[k]->bias});
    }
    m = static_cast<int>(kMicro / g.layout.dp);
    ZeroOptions zo;
    zo.stage = stage_from_int(zero_stage);
    zo.bucket_bytes = 64 << 10;  // several buckets, parameters split across them
    zo.unit_policy.persist_below = 0;
    zo.timeout = std::chrono::seconds(60);
    zo.grad_accumulation_steps = m;
    zo.grid = g;
    opt = std::make_unique<DistributedOptimizer>(std::vector<ParamGroup>{group},
                                                 AdamW(0.005).weight_decay(0.01), g.dp, zo);
    chunk.forward = [this](const at::Tensor& input, int mb) { return forward(input, mb); };
    for (const auto& p : group.params) chunk.parameters.push_back(p.tensor);
  }

  at::Tensor forward(const at::Tensor& input, int mb) {
    at::Tensor h = g.first_stage() ? embedding->forward(input) : input;
    for (size_t k = 0; k < layers.size(); ++k)
      h = h + down[k]->forward(at::tanh(up[k]->forward(h)));
    if (!g.last_stage()) return h;
    const at::Tensor logits = at::matmul(tp::copy_to_region(h, g.tp), embedding->weight.t());
    const at::Tensor y = targets.narrow(0, (int64_t{g.dp_rank} * m + mb) * kRows, kRows);
    return tp::vocab_parallel_cross_entropy(logits, y, g.tp).mean() / m;
  }

  // Trains steps [first, last); returns every step's loss of the global batch (on every rank).
  std::vector<double> train(int64_t first, int64_t last) {
    std::vector<double> losses;
    for (int64_t step = first; step < last; ++step) {
      auto [ids, y] = batch(step);
      targets = y;
      auto rows = [&](int mb) {
        return ids.narrow(0, (int64_t{g.dp_rank} * m + mb) * kRows, kRows);
      };
      opt->zero_grad();
      double loss = 0;
      if (g.layout.pp == 1) {
        for (int mb = 0; mb < m; ++mb) {
          at::Tensor l = forward(rows(mb), mb);
          l.backward();  // the micro-batch's share of the mean, as in the pipeline
          loss += l.item<double>();
        }
      } else {
        PipelineRunOptions run;
        run.activation_shape = {kRows, kHidden};
        run.activation_dtype = at::kFloat;
        const auto out =
            run_pipeline(compile_schedule(PipelineScheduleKind::OneFOneB, g.layout.pp, m, 1), *g.pp,
                         {chunk}, rows, run);
        for (const auto& l : out) loss += l.item<double>();
      }
      opt->step();
      // The global batch's loss: the last stage's tensor rank 0 of each data-parallel rank.
      at::Tensor sum =
          at::tensor({g.last_stage() && g.tp->rank() == 0 ? loss / g.layout.dp : 0.0}, at::kDouble);
      g.world->all_reduce(sum);
      losses.push_back(sum.item<double>());
    }
    return losses;
  }
};

constexpr int kSteps = 6, kSaveAt = 3;

// Removes a test's directory once every rank is done with it.
void remove_shared(const std::string& dir) {
  test::world()->barrier();
  if (test::world()->rank() == 0) fs::remove_all(dir);
}

DIST_TEST(GridCheckpoint, ResumesInAnyLayoutReadingItsShare) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_ckpt");
  std::vector<double> full;
  {
    GridModel run(ParallelLayout{2, 2, 1}, 1);
    full = run.train(0, kSaveAt);
    save_grid_checkpoint(*run.opt, run.g, dir, {R"({"step": 3})", {}});
    const auto rest = run.train(kSaveAt, kSteps);
    full.insert(full.end(), rest.begin(), rest.end());
  }
  struct Case {
    ParallelLayout layout;
    int stage;
  };
  for (const Case& c :
       {Case{{1, 1, 4}, 3}, Case{{1, 4, 1}, 0}, Case{{4, 1, 1}, 2}, Case{{4, 1, 1}, 1},
        Case{{2, 2, 1}, 1}, Case{{2, 1, 2}, 1}, Case{{2, 1, 2}, 0}}) {
    SCOPED_TRACE(fmt::format("resumed at {} stage {}", c.layout.to_string(), c.stage));
    GridModel run(c.layout, c.stage);
    GridLoadStats stats;
    GridLoadOptions lo;
    lo.stats = &stats;
    const TrainerState t = load_grid_checkpoint(*run.opt, run.g, dir, lo);
    EXPECT_EQ(t.json, R"({"step":3})");
    EXPECT_EQ(read_grid_commit(dir).step, kSaveAt);
    const auto losses = run.train(kSaveAt, kSteps);
    double gap = 0;
    for (int k = 0; k < kSteps - kSaveAt; ++k)
      gap = std::max(gap, std::abs(losses[k] - full[kSaveAt + k]));
    EXPECT_LE(gap, 1e-4);
    const double ratio =
        static_cast<double>(stats.data_bytes) / std::max<int64_t>(stats.share_bytes, 1);
    // Whole 4 KiB checksum blocks are read around every range (Note [Block checksums]): on this
    // small model that is up to 2.03x the share where the tensor split changes (rows of a
    // row-parallel weight cut in half), 1.0-1.2x at the same layout. Never the whole model.
    EXPECT_LE(ratio, 1.1) << stats.data_bytes << " bytes read for a share of " << stats.share_bytes;
    if (test::world()->rank() == 0) {
      std::printf(
          "[grid checkpoint] %s stage %d: loss gap %.2e; rank 0 read %lld data bytes for "
          "a share of %lld (%.3fx) + %lld bytes of metadata\n",
          c.layout.to_string().c_str(), c.stage, gap, static_cast<long long>(stats.data_bytes),
          static_cast<long long>(stats.share_bytes), ratio,
          static_cast<long long>(stats.metadata_bytes));
    }
  }
  remove_shared(dir);
}

// The parameters and Adam state of this rank's folder (read back from the committed save).
at::Tensor fingerprint(GridModel& run) {
  run.opt->gather_full_parameters();
  std::vector<at::Tensor> flat;
  for (const auto& p : run.chunk.parameters) flat.push_back(p.detach().flatten());
  return at::cat(flat);
}

DIST_TEST(GridCheckpoint, OneCommitForTheGrid) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_commit");
  const int world_rank = test::world()->rank();
  GridModel run(ParallelLayout{2, 2, 1}, 1);
  run.train(0, 2);
  save_grid_checkpoint(*run.opt, run.g, dir, {R"({"step": 2})", {}});
  const at::Tensor at_two = fingerprint(run);
  run.train(2, 3);
  // A crash between two folders: stage 1's ranks fail once their folders are written, stage 0's
  // have written theirs. Every rank throws; the commit of step 2 stays the one that loads.
  GridSaveOptions crash;
  crash.after_folder_written = [&](int rank) {
    if (run.g.pp_rank == 1) {
      throw Error(ErrorKind::Checkpoint, rank, fmt::format("simulated crash on rank {}", rank));
    }
  };
  test::expect_error([&] { save_grid_checkpoint(*run.opt, run.g, dir, {}, {}, crash); },
                     ErrorKind::Checkpoint, {"simulated crash"});
  EXPECT_EQ(read_grid_commit(dir).step, 2);
  EXPECT_TRUE(test::all_ranks(fs::exists(fs::path(dir) / "save-000002" / "pp0-of-2")));
  // ... also when the commit itself is cut off (world rank 0 fails just before writing it).
  GridSaveOptions no_commit;
  no_commit.before_commit = [] {
    throw Error(ErrorKind::Checkpoint, 0, "simulated crash before the commit");
  };
  test::expect_error([&] { save_grid_checkpoint(*run.opt, run.g, dir, {}, {}, no_commit); },
                     ErrorKind::Checkpoint, {"simulated crash before the commit"});
  {
    GridModel resumed(ParallelLayout{2, 2, 1}, 1);
    const TrainerState t = load_grid_checkpoint(*resumed.opt, resumed.g, dir);
    EXPECT_EQ(t.json, R"({"step":2})");
    EXPECT_TRUE(test::all_ranks(at::equal(fingerprint(resumed), at_two)));
  }
  // The next save removes the uncommitted folder and commits; keep = 2 keeps two saves.
  GridSaveOptions keep2;
  keep2.keep = 2;
  save_grid_checkpoint(*run.opt, run.g, dir, {}, {}, keep2);
  run.train(3, 4);
  save_grid_checkpoint(*run.opt, run.g, dir, {}, {}, keep2);
  const GridCommit c = read_grid_commit(dir);
  EXPECT_EQ(c.step, 4);
  EXPECT_EQ(c.kept, (std::vector<std::string>{"save-000002", "save-000003"}));
  EXPECT_TRUE(test::all_ranks(!fs::exists(fs::path(dir) / "save-000001")));
  test::world()->barrier();
  // Consolidation takes a grid's parameters, but its optimizer state only from one folder.
  if (world_rank == 0) {
    ConsolidateOptions with_state;
    with_state.optimizer_state_out = dir + "-state.pt";
    test::expect_error([&] { consolidate_checkpoint(dir, dir + "-model.pt", with_state); },
                       ErrorKind::Unsupported, {"consolidated from one folder", "tp=2 x pp=2"});
    consolidate_checkpoint(dir, dir + "-model.pt");
    EXPECT_GT(read_state_dict(dir + "-model.pt").size(), 0u);
    fs::remove(dir + "-model.pt");
  }
  test::world()->barrier();
  // A flipped bit in a piece another layout reads: its element checksum names the parameter.
  const fs::path shard =
      fs::path(dir) / "save-000003" / "pp0-of-2" / "tp1-of-2" / "shard-00000-of-00001.bin";
  auto flip = [&] {
    if (world_rank != 0) return;
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(66632);  // inside the embedding (split: every layout reads it)
    const char c = static_cast<char>(f.get() ^ 0x10);
    f.seekp(66632);
    f.put(c);
  };
  flip();
  test::world()->barrier();
  {
    GridModel other(ParallelLayout{1, 1, 4}, 2);
    test::expect_error([&] { load_grid_checkpoint(*other.opt, other.g, dir); },
                       ErrorKind::Checkpoint, {"element checksum", "a shard file is corrupt"});
  }
  flip();
  test::world()->barrier();
  // A folder of another save: refused on every rank, naming it.
  if (world_rank == 0) {
    fs::remove_all(fs::path(dir) / "save-000003" / "pp1-of-2");
    fs::copy(fs::path(dir) / "save-000002" / "pp1-of-2", fs::path(dir) / "save-000003" / "pp1-of-2",
             fs::copy_options::recursive);
  }
  test::world()->barrier();
  test::expect_error([&] { load_grid_checkpoint(*run.opt, run.g, dir); }, ErrorKind::Checkpoint,
                     {"does not belong to the committed save save-000003 of step 4"});
  test::world()->barrier();
  // A missing folder.
  if (world_rank == 0) fs::remove_all(fs::path(dir) / "save-000003" / "pp1-of-2");
  test::world()->barrier();
  test::expect_error([&] { load_grid_checkpoint(*run.opt, run.g, dir); }, ErrorKind::Checkpoint,
                     {"pp1-of-2/tp0-of-2", "is missing"});
  // No commit at all.
  test::expect_error([&] { load_grid_checkpoint(*run.opt, run.g, dir + "/none"); },
                     ErrorKind::Checkpoint, {"no committed checkpoint"});
  remove_shared(dir);
}

// A model whose parameter is a piece of another shape than the checkpoint's: Mismatch naming it.
DIST_TEST(GridCheckpoint, PieceOfAnotherShapeIsRefused) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_shape");
  {
    GridModel run(ParallelLayout{2, 2, 1}, 1);
    save_grid_checkpoint(*run.opt, run.g, dir, {});
  }
  const auto g = make_parallel_groups(test::world(), ParallelLayout{1, 1, 4});
  at::Tensor w = at::zeros({kFfn + 1, kHidden}).requires_grad_(true);
  ParamGroup group;
  group.params.push_back({"layer0.up.weight", w});
  DistributedOptimizer opt({group}, AdamW(0.01), g.dp, ZeroOptions{});
  test::expect_error([&] { load_grid_checkpoint(opt, g, dir); }, ErrorKind::Mismatch,
                     {"layer0.up.weight", "[128, 64]", "[129, 64]"});
  remove_shared(dir);
}

// Asynchronous saves (Note [Asynchronous saves]): steps run while the background writes; the
// commit is the synchronous save's, and a background failure is thrown on every rank by the next
// call, the previous commit staying the one that loads.
DIST_TEST(GridCheckpoint, AsynchronousSaves) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_async");
  GridModel run(ParallelLayout{2, 2, 1}, 2);
  AsyncCheckpoint saver(*run.opt, run.g);
  run.train(0, 2);
  saver.save_checkpoint_async(dir, {R"({"step": 2})", {}});
  const int64_t bytes = saver.snapshot_bytes();
  EXPECT_GT(bytes, 0);
  const auto after = run.train(2, 4);  // while it writes
  saver.wait();
  EXPECT_EQ(read_grid_commit(dir).step, 2);
  {
    GridModel resumed(ParallelLayout{1, 1, 4}, 3);
    EXPECT_EQ(load_grid_checkpoint(*resumed.opt, resumed.g, dir).json, R"({"step":2})");
    const auto again = resumed.train(2, 4);
    for (size_t k = 0; k < again.size(); ++k) EXPECT_NEAR(again[k], after[k], 1e-4);
  }
  // A failure in the background (one folder's ranks) reaches every rank at the next call.
  GridSaveOptions crash;
  crash.after_folder_written = [&](int rank) {
    if (run.g.pp_rank == 0) throw Error(ErrorKind::Checkpoint, rank, "simulated background crash");
  };
  saver.save_checkpoint_async(dir, {}, {}, crash);
  EXPECT_EQ(saver.snapshot_bytes(), bytes);  // the buffer is reused
  run.train(4, 5);
  test::expect_error([&] { saver.wait(); }, ErrorKind::Checkpoint, {"simulated background crash"});
  EXPECT_EQ(read_grid_commit(dir).step, 2);
  saver.save_checkpoint_async(dir);
  saver.wait();
  EXPECT_EQ(read_grid_commit(dir).step, 5);
  const AsyncSaveTiming t = saver.last_timing();
  EXPECT_GT(t.background_s, 0);
  if (test::world()->rank() == 0) {
    std::printf("[grid checkpoint] async save: %.4f s blocking, %.4f s in the background, "
                "%lld bytes of snapshot\n",
                t.blocking_s, t.background_s, static_cast<long long>(bytes));
  }
  remove_shared(dir);
}

// The estimator counts the snapshot an AsyncCheckpoint keeps (Estimate::checkpoint_snapshot, with
// Options::async_checkpoint): the rank's slice of the master parameters and of the optimizer
// state, at every stage.
DIST_TEST(GridCheckpoint, EstimateCountsTheAsyncSnapshot) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_async_snapshot");
  for (int stage = 0; stage <= 3; ++stage) {
    GridModel run(ParallelLayout{1, 1, 4}, stage);
    run.train(0, 1);
    AsyncCheckpoint saver(*run.opt, run.g);
    EXPECT_EQ(saver.snapshot_bytes(), 0);
    saver.save_checkpoint_async(dir);
    saver.wait();
    estimate::Options o;
    o.params = run.opt->padded_numel();  // the layout's padding, per bucket
    o.world = 4;
    o.stage = stage;
    o.params_on_host = true;
    o.async_checkpoint = true;
    const estimate::Estimate e = estimate::model_states(o);
    EXPECT_EQ(saver.snapshot_bytes(), e.checkpoint_snapshot) << "stage " << stage;
    o.async_checkpoint = false;
    EXPECT_EQ(e.total() - estimate::model_states(o).total(), e.checkpoint_snapshot);
  }
  remove_shared(dir);
}

#ifdef __linux__
// AsyncCheckpointOptions::writer_niceness lowers the background thread's priority only: the
// callbacks of a save run on it (GridSaveOptions::after_folder_written), the caller keeps its own.
DIST_TEST(GridCheckpoint, WriterNiceness) {
  if (test::world()->size() != 4) GTEST_SKIP() << "a grid of 4 ranks";
  const std::string dir = test::shared_dir("grid_async_nice");
  GridModel run(ParallelLayout{1, 1, 4}, 2);
  test::expect_error([&] { AsyncCheckpoint bad(*run.opt, run.g, {20}); },
                     ErrorKind::InvalidArgument, {"writer_niceness must be in [0, 19], got 20"});
  auto nice_of_this_thread = [] {
    return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  };
  const int caller = nice_of_this_thread();
  AsyncCheckpoint saver(*run.opt, run.g, {5});
  int writer = -100;
  GridSaveOptions grid;
  grid.after_folder_written = [&](int) { writer = nice_of_this_thread(); };
  run.train(0, 1);
  saver.save_checkpoint_async(dir, {}, {}, grid);
  saver.wait();
  EXPECT_EQ(writer, std::min(19, caller + 5));
  EXPECT_EQ(nice_of_this_thread(), caller);
  remove_shared(dir);
}
#endif

}  // namespace
}  // namespace shardopt
