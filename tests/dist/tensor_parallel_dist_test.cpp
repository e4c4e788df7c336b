// Tensor parallelism (shardopt/tensor_parallel.hpp) in float64 against the unsplit computation:
// each split layer, the cross entropy over a split vocabulary and one whole BERT encoder layer
// (post-LayerNorm attention and MLP), with and without sequence parallelism, forward and
// backward, at every t in {2, 4} that divides the world (the other ranks form more tensor groups
// over the same data). Bound 1e-10 (the split sums round differently, a few ulps of values ~1).
// Also the rank grid (shardopt/parallel_layout.hpp), the dropout streams, and ZeRO at stages 0-3
// over the data-parallel group of split layers against torch's AdamW on the unsplit model.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/parallel_layout.hpp"
#include "shardopt/tensor_parallel.hpp"
#include "support/counting_communicator.hpp"
#include "support/dist_env.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

constexpr double kTol = 1e-10;
// Divisible by every t of tensor_sizes (1-4), the sequence too (sequence parallelism).
constexpr int64_t kBatch = 2, kSeq = 12, kHidden = 24, kHeads = 12, kFfn = 48, kVocab = 24;

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return 1e9;
  return (a - b).abs().max().item<double>();
}

// The tensor sizes t in {2, 4} this world can split by (the test runs once per t).
// The tensor-parallel sizes a world runs: every t of 2-4 it divides into (t = 3 at 3 ranks), and
// t = 1 alone (the split layers with no communication) at one rank.
std::vector<int> tensor_sizes(int world) {
  if (world == 1) return {1};
  std::vector<int> out;
  for (int t : {2, 3, 4}) {
    if (world % t == 0) out.push_back(t);
  }
  return out;
}

at::Tensor chunk_of(const at::Tensor& full, int64_t dim, const Communicator& group) {
  return full.chunk(group.size(), dim)[group.rank()];
}

tp::TensorParallel options(const ParallelGroups& g, bool sequence_parallel) {
  return {g.tp, sequence_parallel, 1};
}

// Runs body(groups, sequence_parallel) for each t and both modes; skips with a reason when the
// world has no such t.
template <class Body>
void for_each_layout(Body body) {
  auto world = test::world();
  const auto sizes = tensor_sizes(world->size());
  if (sizes.empty()) GTEST_SKIP() << "tensor parallelism runs at 1-4 ranks";
  for (int t : sizes) {
    const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
    for (bool sp : {false, true}) {
      SCOPED_TRACE("t=" + std::to_string(t) + (sp ? " sequence parallel" : ""));
      body(g, sp);
    }
  }
}

DIST_TEST(ParallelLayoutTest, GroupsFollowMegatronsOrder) {
  auto world = test::world();
  const int n = world->size();
  for (int t : {1, 2, 4}) {
    if (n % t != 0) continue;
    const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
    EXPECT_EQ(g.layout.dp, n / t);
    EXPECT_EQ(g.tp->size(), t);
    EXPECT_EQ(g.dp->size(), n / t);
    EXPECT_EQ(g.pp->size(), 1);
    EXPECT_EQ(g.tp->rank(), world->rank() % t);  // tensor ranks innermost
    EXPECT_EQ(g.dp->rank(), world->rank() / t);
    // The tensor group really is the consecutive ranks: their world ranks, summed over it.
    at::Tensor r = at::full({1}, static_cast<double>(world->rank()), at::kDouble);
    g.tp->all_reduce(r);
    const int first = world->rank() / t * t;
    EXPECT_EQ(r.item<double>(), t * first + t * (t - 1) / 2.0);
  }
  // The embedding group: the first and the last stage's ranks of a tensor rank, first stage first.
  for (int p : {2, 4}) {
    if (n % p != 0) continue;
    const ParallelGroups g = make_parallel_groups(world, ParallelLayout{1, p});
    const int d = n / p;
    EXPECT_EQ(g.pp->size(), p);
    EXPECT_EQ(g.pp_rank, world->rank() / d);
    ASSERT_EQ(g.embedding != nullptr, g.first_stage() || g.last_stage());
    if (!g.embedding) continue;
    EXPECT_EQ(g.embedding->size(), 2 * d);
    EXPECT_EQ(g.embedding->rank(), (g.first_stage() ? 0 : d) + g.dp_rank);
  }
  EXPECT_EQ(make_parallel_groups(world, ParallelLayout{1}).embedding, nullptr);
  if (n != 3) {
    test::expect_error([&] { make_parallel_groups(world, ParallelLayout{3, 1, 1}); },
                       ErrorKind::InvalidArgument, {"needs 3 ranks", "has " + std::to_string(n)});
  }
  test::expect_error([&] { make_parallel_groups(world, ParallelLayout{0}); },
                     ErrorKind::InvalidArgument, {"tp and pp must be at least 1"});
}

DIST_TEST(TensorParallelLayers, ColumnAndRowLinearMatchTheUnsplitLinear) {
  for_each_layout([](const ParallelGroups& g, bool sp) {
    auto draws = test::seeded_draws(11);
    torch::nn::Linear full_col(kHidden, kFfn), full_row(kFfn, kHidden);
    full_col->to(at::kDouble);
    full_row->to(at::kDouble);
    tp::ColumnParallelLinear col(kHidden, kFfn, options(g, sp));
    tp::RowParallelLinear row(kFfn, kHidden, options(g, sp));
    col->to(at::kDouble);
    row->to(at::kDouble);
    col->load_full(full_col->weight.detach(), full_col->bias.detach());
    row->load_full(full_row->weight.detach(), full_row->bias.detach());
    const at::Tensor x = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    const at::Tensor grad_out = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    draws.unlock();
    // Unsplit.
    at::Tensor xr = x.clone().requires_grad_(true);
    full_row->forward(at::tanh(full_col->forward(xr))).backward(grad_out);
    // Split: under sequence parallelism the input and output are this rank's sequence shard.
    at::Tensor xs = (sp ? chunk_of(x, 1, *g.tp) : x).clone().requires_grad_(true);
    at::Tensor y = row->forward(at::tanh(col->forward(xs)));
    y.backward(sp ? chunk_of(grad_out, 1, *g.tp) : grad_out);
    const at::Tensor y_ref = full_row->forward(at::tanh(full_col->forward(x))).detach();
    EXPECT_LE(max_diff(y, sp ? chunk_of(y_ref, 1, *g.tp) : y_ref), kTol);
    EXPECT_LE(max_diff(xs.grad(), sp ? chunk_of(xr.grad(), 1, *g.tp) : xr.grad()), kTol);
    EXPECT_LE(max_diff(col->weight.grad(), chunk_of(full_col->weight.grad(), 0, *g.tp)), kTol);
    EXPECT_LE(max_diff(col->bias.grad(), chunk_of(full_col->bias.grad(), 0, *g.tp)), kTol);
    EXPECT_LE(max_diff(row->weight.grad(), chunk_of(full_row->weight.grad(), 1, *g.tp)), kTol);
    EXPECT_LE(max_diff(row->bias.grad(), full_row->bias.grad()), kTol);  // summed under SP
  });
}

DIST_TEST(TensorParallelLayers, GatheredColumnOutputAndSplitRowInput) {
  for_each_layout([](const ParallelGroups& g, bool sp) {
    if (sp) return;  // gather_output / !input_is_parallel are the non-sequence-parallel forms
    auto draws = test::seeded_draws(12);
    torch::nn::Linear full(kHidden, kFfn);
    full->to(at::kDouble);
    tp::ColumnParallelLinear col(kHidden, kFfn, options(g, false), true, /*gather_output=*/true);
    tp::RowParallelLinear row(kFfn, kHidden, options(g, false), false, /*input_is_parallel=*/false);
    col->to(at::kDouble);
    row->to(at::kDouble);
    col->load_full(full->weight.detach(), full->bias.detach());
    const at::Tensor w2 = at::randn({kHidden, kFfn}, at::kDouble);
    row->load_full(w2);
    const at::Tensor x = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    draws.unlock();
    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor ref = at::linear(full->forward(xr), w2);
    ref.sum().backward();
    at::Tensor xs = x.clone().requires_grad_(true);
    at::Tensor y = row->forward(col->forward(xs));
    y.sum().backward();
    EXPECT_LE(max_diff(y, ref.detach()), kTol);
    EXPECT_LE(max_diff(xs.grad(), xr.grad()), kTol);
    EXPECT_LE(max_diff(col->weight.grad(), chunk_of(full->weight.grad(), 0, *g.tp)), kTol);
  });
}

DIST_TEST(TensorParallelLayers, VocabParallelEmbeddingMatchesTheLookup) {
  for_each_layout([](const ParallelGroups& g, bool sp) {
    auto draws = test::seeded_draws(13);
    const at::Tensor table = at::randn({kVocab, kHidden}, at::kDouble);
    tp::VocabParallelEmbedding emb(kVocab, kHidden, options(g, sp));
    emb->to(at::kDouble);
    emb->load_full(table);
    EXPECT_EQ(emb->vocab_begin(), g.tp->rank() * kVocab / g.tp->size());
    const at::Tensor ids = at::randint(kVocab, {kBatch, kSeq}, at::kLong);
    const at::Tensor grad_out = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    draws.unlock();
    at::Tensor ref_table = table.clone().requires_grad_(true);
    at::Tensor ref = at::embedding(ref_table, ids);
    ref.backward(grad_out);
    at::Tensor out = emb->forward(ids);
    out.backward(sp ? chunk_of(grad_out, 1, *g.tp) : grad_out);
    EXPECT_LE(max_diff(out, sp ? chunk_of(ref.detach(), 1, *g.tp) : ref.detach()), kTol);
    EXPECT_LE(max_diff(emb->weight.grad(), chunk_of(ref_table.grad(), 0, *g.tp)), kTol);
  });
}

DIST_TEST(TensorParallelLayers, VocabParallelCrossEntropyMatchesCrossEntropy) {
  for_each_layout([](const ParallelGroups& g, bool sp) {
    if (sp) return;  // the loss has no sequence-parallel form
    auto draws = test::seeded_draws(14);
    const at::Tensor logits = at::randn({kBatch, kSeq, kVocab}, at::kDouble) * 3;
    at::Tensor target = at::randint(kVocab, {kBatch, kSeq}, at::kLong);
    target.index_put_({0, 1}, -100);  // ignored positions
    target.index_put_({1, 5}, -100);
    const at::Tensor grad_loss = at::rand({kBatch, kSeq}, at::kDouble);
    draws.unlock();
    at::Tensor ref_logits = logits.clone().requires_grad_(true);
    at::Tensor ref = at::cross_entropy_loss(ref_logits.reshape({-1, kVocab}), target.reshape(-1),
                                            {}, at::Reduction::None, -100)
                         .view({kBatch, kSeq});
    ref.backward(grad_loss);
    at::Tensor mine = chunk_of(logits, -1, *g.tp).clone().requires_grad_(true);
    at::Tensor loss = tp::vocab_parallel_cross_entropy(mine, target, g.tp);
    loss.backward(grad_loss);
    EXPECT_LE(max_diff(loss, ref.detach()), kTol);
    EXPECT_EQ(loss[0][1].item<double>(), 0.0);
    EXPECT_LE(max_diff(mine.grad(), chunk_of(ref_logits.grad(), -1, *g.tp)), kTol);
  });
}

// One post-LayerNorm BERT encoder layer, unsplit (reference) or split.
struct EncoderWeights {
  at::Tensor q, k, v, o, up, down;           // [out, in]
  at::Tensor bq, bk, bv, bo, bup, bdown;     // [out]
  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;     // [hidden]
  EncoderWeights() {
    auto draws = test::seeded_draws(21);
    auto w = [](int64_t out, int64_t in) { return at::randn({out, in}, at::kDouble) * 0.3; };
    auto b = [](int64_t n) { return at::randn({n}, at::kDouble) * 0.1; };
    q = w(kHidden, kHidden), k = w(kHidden, kHidden), v = w(kHidden, kHidden);
    o = w(kHidden, kHidden), up = w(kFfn, kHidden), down = w(kHidden, kFfn);
    bq = b(kHidden), bk = b(kHidden), bv = b(kHidden), bo = b(kHidden), bup = b(kFfn);
    bdown = b(kHidden);
    ln1_w = 1 + b(kHidden), ln1_b = b(kHidden), ln2_w = 1 + b(kHidden), ln2_b = b(kHidden);
  }
};

// Attention over `heads` heads of q, k, v [b, s, heads * d].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads) {
  const int64_t d = q.size(-1) / heads;
  auto split = [&](const at::Tensor& t) {
    return t.view({t.size(0), t.size(1), heads, d}).transpose(1, 2);
  };
  at::Tensor scores = at::matmul(split(q), split(k).transpose(-1, -2)) / std::sqrt(double(d));
  at::Tensor ctx = at::matmul(at::softmax(scores, -1), split(v));
  return ctx.transpose(1, 2).reshape({q.size(0), q.size(1), heads * d});
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::layer_norm(x, {kHidden}, w, b, 1e-12);
}

struct SplitEncoder {
  tp::ColumnParallelLinear q, k, v, up;
  tp::RowParallelLinear o, down;
  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
  int64_t local_heads;

  SplitEncoder(const EncoderWeights& w, const ParallelGroups& g, bool sp)
      : q(kHidden, kHidden, options(g, sp)), k(kHidden, kHidden, options(g, sp)),
        v(kHidden, kHidden, options(g, sp)), up(kHidden, kFfn, options(g, sp)),
        o(kHidden, kHidden, options(g, sp)), down(kFfn, kHidden, options(g, sp)),
        local_heads(kHeads / g.tp->size()) {
    for (auto* m : {&q, &k, &v, &up}) (*m)->to(at::kDouble);
    for (auto* m : {&o, &down}) (*m)->to(at::kDouble);
    q->load_full(w.q, w.bq), k->load_full(w.k, w.bk), v->load_full(w.v, w.bv);
    o->load_full(w.o, w.bo), up->load_full(w.up, w.bup), down->load_full(w.down, w.bdown);
    using Pair = std::pair<at::Tensor*, const at::Tensor*>;
    for (auto [mine, full] : std::initializer_list<Pair>{
             {&ln1_w, &w.ln1_w}, {&ln1_b, &w.ln1_b}, {&ln2_w, &w.ln2_w}, {&ln2_b, &w.ln2_b}}) {
      *mine = full->clone().requires_grad_(true);
      if (sp) tp::mark_sequence_parallel(*mine, g.tp);  // used on sequence shards
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto qkv = tp::fused_column_forward(x, {q, k, v});
    at::Tensor a = o->forward(attention(qkv[0], qkv[1], qkv[2], local_heads));
    at::Tensor h = layer_norm(x + a, ln1_w, ln1_b);
    return layer_norm(h + down->forward(at::gelu(up->forward(h))), ln2_w, ln2_b);
  }
};

DIST_TEST(TensorParallelLayers, BertEncoderLayerMatchesTheUnsplitLayer) {
  for_each_layout([](const ParallelGroups& g, bool sp) {
    const EncoderWeights w;
    // Reference: every weight a leaf, the same computation unsplit.
    std::vector<at::Tensor*> ref_params;
    EncoderWeights r = w;
    for (at::Tensor* t : {&r.q, &r.k, &r.v, &r.o, &r.up, &r.down, &r.bq, &r.bk, &r.bv, &r.bo,
                          &r.bup, &r.bdown, &r.ln1_w, &r.ln1_b, &r.ln2_w, &r.ln2_b}) {
      *t = t->clone().requires_grad_(true);
      ref_params.push_back(t);
    }
    auto draws = test::seeded_draws(22);
    const at::Tensor x = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    const at::Tensor grad_out = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
    draws.unlock();
    at::Tensor xr = x.clone().requires_grad_(true);
    {
      at::Tensor a = at::linear(attention(at::linear(xr, r.q, r.bq), at::linear(xr, r.k, r.bk),
                                          at::linear(xr, r.v, r.bv), kHeads),
                                r.o, r.bo);
      at::Tensor h = layer_norm(xr + a, r.ln1_w, r.ln1_b);
      at::Tensor out = layer_norm(h + at::linear(at::gelu(at::linear(h, r.up, r.bup)), r.down,
                                                 r.bdown),
                                  r.ln2_w, r.ln2_b);
      out.backward(grad_out);
      draws.lock();  // the split layers draw their initial weights (load_full replaces them)
      SplitEncoder enc(w, g, sp);
      draws.unlock();
      at::Tensor xs = (sp ? chunk_of(x, 1, *g.tp) : x).clone().requires_grad_(true);
      at::Tensor y = enc.forward(xs);
      y.backward(sp ? chunk_of(grad_out, 1, *g.tp) : grad_out);
      const at::Tensor expected = sp ? chunk_of(out.detach(), 1, *g.tp) : out.detach();
      EXPECT_LE(max_diff(y, expected), kTol);
      EXPECT_LE(max_diff(xs.grad(), sp ? chunk_of(xr.grad(), 1, *g.tp) : xr.grad()), kTol);
      const auto& G = *g.tp;
      EXPECT_LE(max_diff(enc.q->weight.grad(), chunk_of(r.q.grad(), 0, G)), kTol);
      EXPECT_LE(max_diff(enc.k->bias.grad(), chunk_of(r.bk.grad(), 0, G)), kTol);
      EXPECT_LE(max_diff(enc.v->weight.grad(), chunk_of(r.v.grad(), 0, G)), kTol);
      EXPECT_LE(max_diff(enc.o->weight.grad(), chunk_of(r.o.grad(), 1, G)), kTol);
      EXPECT_LE(max_diff(enc.o->bias.grad(), r.bo.grad()), kTol);
      EXPECT_LE(max_diff(enc.up->weight.grad(), chunk_of(r.up.grad(), 0, G)), kTol);
      EXPECT_LE(max_diff(enc.up->bias.grad(), chunk_of(r.bup.grad(), 0, G)), kTol);
      EXPECT_LE(max_diff(enc.down->weight.grad(), chunk_of(r.down.grad(), 1, G)), kTol);
      EXPECT_LE(max_diff(enc.down->bias.grad(), r.bdown.grad()), kTol);
      EXPECT_LE(max_diff(enc.ln1_w.grad(), r.ln1_w.grad()), kTol);
      EXPECT_LE(max_diff(enc.ln2_b.grad(), r.ln2_b.grad()), kTol);
      // Not trivially equal: the gradients are really nonzero.
      EXPECT_GT(r.q.grad().abs().max().item<double>(), 1e-3);
    }
  });
}

// Megatron's cost: an encoder layer's backward makes 2 input-gradient all-reduces, one for the
// fused q, k and v (tp::fused_column_forward) and one for the up-projection, where three separate
// q, k, v layers make 4 (the row-parallel layers' all-reduces are in the forward).
DIST_TEST(TensorParallelLayers, EncoderBackwardMakesTwoInputGradientAllReduces) {
  for_each_layout([](const ParallelGroups& base, bool sp) {
    if (sp) return;  // sequence parallelism moves shards instead (and sums its LayerNorms' grads)
    auto counting = std::make_shared<test::CountingCommunicator>(base.tp);
    ParallelGroups g = base;
    g.tp = counting;
    const EncoderWeights w;
    auto draws = test::seeded_draws(23);
    SplitEncoder enc(w, g, sp);
    const at::Tensor x = at::randn({kBatch, kSeq, kHidden}, at::kDouble).requires_grad_(true);
    draws.unlock();
    const at::Tensor y = enc.forward(x);
    const int64_t forward_calls = counting->traffic().calls;
    y.backward(at::ones_like(y));
    const int64_t backward_calls = counting->traffic().calls - forward_calls;
    const bool split = base.tp->size() > 1;
    EXPECT_EQ(forward_calls, split ? 2 : 0) << "the two row-parallel sums";
    EXPECT_EQ(backward_calls, split ? 2 : 0) << "input-gradient all-reduces of one layer";
    EXPECT_GT(x.grad().abs().max().item<double>(), 0.0);
  });
}

// Note [Sequence-parallel sums]: a DistributedOptimizer holding the sequence-parallel parameters
// (the LayerNorms' and the row-parallel biases': 6 in a layer) sums their gradients once a step,
// so the backward pass makes 6 all-reduces fewer than the hooks alone; with the optimizer gone the
// hooks sum again. The sums' values are checked by the sequence-parallel runs of
// TensorParallelZero.DataParallelOptimizerOverSplitLayersMatchesTorch.
DIST_TEST(TensorParallelLayers, OptimizerTakesOverSequenceParallelSums) {
  for_each_layout([](const ParallelGroups& base, bool sp) {
    if (!sp || base.tp->size() == 1) return;
    auto counting = std::make_shared<test::CountingCommunicator>(base.tp);
    ParallelGroups g = base;
    g.tp = counting;
    const EncoderWeights w;
    auto draws = test::seeded_draws(24);
    SplitEncoder enc(w, g, sp);
    const at::Tensor x = at::randn({kBatch, kSeq / g.tp->size(), kHidden}, at::kDouble);
    draws.unlock();
    const auto backward_calls = [&](const std::function<void(const at::Tensor&)>& backward) {
      const at::Tensor y = enc.forward(x);
      const int64_t before = counting->traffic().calls;
      backward(y.sum());
      return counting->traffic().calls - before;
    };
    const auto plain = [](const at::Tensor& loss) { loss.backward(); };
    const int64_t hooks = backward_calls(plain);
    ParamGroup group;
    int index = 0;
    for (const at::Tensor& t : {enc.q->weight, enc.q->bias, enc.k->weight, enc.k->bias,
                                enc.v->weight, enc.v->bias, enc.up->weight, enc.up->bias,
                                enc.o->weight, enc.o->bias, enc.down->weight, enc.down->bias,
                                enc.ln1_w, enc.ln1_b, enc.ln2_w, enc.ln2_b}) {
      group.params.push_back({fmt::format("p{}", index++), t});
    }
    {
      ZeroOptions zo;
      zo.stage = Stage::Gradients;
      zo.grid = g;
      zo.grid.tp = counting;
      DistributedOptimizer opt({group}, AdamW(1e-3), g.dp, zo);
      opt.zero_grad();
      const int64_t claimed = backward_calls([&](const at::Tensor& loss) { opt.backward(loss); });
      EXPECT_EQ(hooks - claimed, 6) << "the LayerNorms' and row-parallel biases' sums";
      const int64_t before_step = counting->traffic().calls;
      opt.step();
      EXPECT_GE(counting->traffic().calls - before_step, 1) << "the optimizer's one sum";
    }
    for (const auto& p : group.params) p.tensor.mutable_grad() = at::Tensor();
    EXPECT_EQ(backward_calls(plain), hooks) << "the optimizer released the sums to the hooks";
  });
}

DIST_TEST(TensorParallelLayers, ClearErrors) {
  auto world = test::world();
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{world->size()});
  if (world->size() > 1) {
    test::expect_error(
        [&] { (void)tp::ColumnParallelLinear(kHidden, world->size() + 1, options(g, false)); },
        ErrorKind::InvalidArgument, {"must divide by the tensor-parallel size"});
  }
  test::expect_error([&] { tp::copy_to_region(at::ones({2}), nullptr); },
                     ErrorKind::InvalidArgument, {"the group is null"});
  tp::ColumnParallelLinear col(kHidden, 4 * world->size(), options(g, false));
  test::expect_error([&] { col->load_full(at::zeros({3, 3})); }, ErrorKind::InvalidArgument,
                     {"the unsplit weight must be"});
  EXPECT_EQ(tp::padded_vocab(30522, 2), 30720);
  EXPECT_EQ(tp::padded_vocab(30522, 1), 30592);
}

TEST(TensorParallelRng, SplitRegionsDrawPerRankStreamsTheRestTheSame) {
  auto world = test::world();
  const ParallelGroups g = make_parallel_groups(world, ParallelLayout{world->size()});
  at::manual_seed(5);
  tp::RngTracker tracker(/*seed=*/5, g.tp_rank);
  at::Tensor first, second, outside;
  {
    auto fork = tracker.fork();
    first = at::rand({4}, at::kDouble);
  }
  outside = at::rand({4}, at::kDouble);  // the default stream, as if no fork had happened
  {
    auto fork = tracker.fork();
    second = at::rand({4}, at::kDouble);  // the rank's stream goes on
  }
  at::manual_seed(5);
  EXPECT_TRUE(at::rand({4}, at::kDouble).equal(outside));
  EXPECT_FALSE(first.equal(second));
  // Across the tensor group: the forked draws differ, the default ones agree.
  at::Tensor all = at::empty({4 * g.tp->size()}, at::kDouble);
  g.tp->all_gather(first, all);
  at::Tensor same = at::empty({4 * g.tp->size()}, at::kDouble);
  g.tp->all_gather(outside, same);
  for (int r = 0; r < g.tp->size(); ++r) {
    EXPECT_TRUE(same.narrow(0, 4 * r, 4).equal(outside));
    if (r != g.tp->rank()) EXPECT_FALSE(all.narrow(0, 4 * r, 4).equal(first));
  }
}

// A checkpoint keeps the stream (state()); a tracker restored from it draws what the saved one
// would have drawn next, whatever its own seed. Not a generator state: a clear error.
TEST(TensorParallelRng, StateRoundTripsThroughACheckpoint) {
  tp::RngTracker saved(/*seed=*/5, /*tp_rank=*/1);
  { auto fork = saved.fork(); (void)at::rand({3}); }
  const at::Tensor state = saved.state();
  at::Tensor expected, got;
  { auto fork = saved.fork(); expected = at::rand({4}, at::kDouble); }
  tp::RngTracker restored(/*seed=*/99, /*tp_rank=*/0);
  restored.set_state(state);
  { auto fork = restored.fork(); got = at::rand({4}, at::kDouble); }
  EXPECT_TRUE(got.equal(expected));
  test::expect_error([&] { restored.set_state(at::zeros({3}, at::kByte)); },
                     ErrorKind::InvalidArgument, {"not a generator state of cpu"});
  { auto fork = restored.fork(); EXPECT_FALSE(at::rand({4}, at::kDouble).equal(got)); }
}


// ZeRO over the data-parallel group (Note [Split regions]): each tensor rank's optimizer shards
// its slices over the d ranks that hold the same slices; the replicated LayerNorm gets the same
// gradient on every tensor rank, so its copies stay equal (under sequence parallelism its shard
// gradients are summed over the group before the optimizer's hooks see them). A (t, d) grid
// trains as torch's AdamW on the unsplit model over the global batch (float64: <= 1e-10 after 5
// steps), stages 0-3 (3: automatic units, gathered on use through the split layers), with and
// without sequence parallelism. Clipping spans the grid (ZeroOptions::grid): the norm each
// step reports is torch's clip_grad_norm_ on the unsplit model's.
DIST_TEST(TensorParallelZero, DataParallelOptimizerOverSplitLayersMatchesTorch) {
  auto world = test::world();
  const auto sizes = tensor_sizes(world->size());
  if (sizes.empty()) GTEST_SKIP() << "tensor parallelism runs at 1-4 ranks";
  constexpr int64_t kRows = 8, kSteps = 5;
  constexpr double kMaxNorm = 0.05;  // below every step's norm here: every step clips
  const AdamW rule = AdamW(0.01).weight_decay(0.05);
  auto draws = test::seeded_draws(31);
  torch::nn::Linear ref_up(kHidden, kFfn), ref_down(kFfn, kHidden);
  ref_up->to(at::kDouble);
  ref_down->to(at::kDouble);
  const at::Tensor ln_w0 = 1 + 0.1 * at::randn({kHidden}, at::kDouble);
  const at::Tensor ln_b0 = 0.1 * at::randn({kHidden}, at::kDouble);
  const at::Tensor up_w0 = ref_up->weight.detach().clone(), up_b0 = ref_up->bias.detach().clone();
  const at::Tensor down_w0 = ref_down->weight.detach().clone();
  const at::Tensor down_b0 = ref_down->bias.detach().clone();
  draws.unlock();
  auto batch = [](int64_t step) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
    return std::pair{at::randn({kRows, kSeq, kHidden}, gen).to(at::kDouble),
                     at::randn({kRows, kSeq, kHidden}, gen).to(at::kDouble)};
  };
  auto mlp = [](const at::Tensor& x, auto&& up, auto&& down, const at::Tensor& w,
                const at::Tensor& b) { return layer_norm(x + down(at::gelu(up(x))), w, b); };
  // Reference: one process, the whole batch.
  at::Tensor ref_ln_w = ln_w0.clone().requires_grad_(true), ref_ln_b = ln_b0.clone().requires_grad_(true);
  torch::optim::AdamW ref_opt(
      {ref_up->weight, ref_up->bias, ref_down->weight, ref_down->bias, ref_ln_w, ref_ln_b},
      torch::optim::AdamWOptions(rule.lr()).betas({rule.beta1(), rule.beta2()}).eps(rule.eps())
          .weight_decay(rule.weight_decay()));
  std::vector<double> ref_norms;
  for (int64_t s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    ref_opt.zero_grad();
    auto fwd = [&](const at::Tensor& t, auto& m) { return m->forward(t); };
    at::Tensor out = mlp(x, [&](const at::Tensor& t) { return fwd(t, ref_up); },
                         [&](const at::Tensor& t) { return fwd(t, ref_down); }, ref_ln_w, ref_ln_b);
    (out - y).pow(2).mean().backward();
    ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref_opt.param_groups()[0].params(),
                                                          kMaxNorm));
    ref_opt.step();
  }
  for (int t : sizes) {
    const ParallelGroups g = make_parallel_groups(world, ParallelLayout{t});
    const int d = g.dp->size();
    for (int run = 0; run < 8; ++run) {
      const int stage = run % 4;
      const bool sp = run >= 4;
      SCOPED_TRACE(fmt::format("t={} d={} stage {}{}", t, d, stage, sp ? " sequence parallel" : ""));
      draws.lock();  // their initial draws, replaced by load_full
      tp::ColumnParallelLinear up(kHidden, kFfn, options(g, sp));
      tp::RowParallelLinear down(kFfn, kHidden, options(g, sp));
      draws.unlock();
      up->to(at::kDouble);
      down->to(at::kDouble);
      up->load_full(up_w0, up_b0);
      down->load_full(down_w0, down_b0);
      at::Tensor ln_w = ln_w0.clone().requires_grad_(true), ln_b = ln_b0.clone().requires_grad_(true);
      if (sp) {
        tp::mark_sequence_parallel(ln_w, g.tp);
        tp::mark_sequence_parallel(ln_b, g.tp);
      }
      ParamGroup group;
      group.params = {{"up.weight", up->weight}, {"up.bias", up->bias},
                      {"down.weight", down->weight}, {"down.bias", down->bias},
                      {"ln.weight", ln_w}, {"ln.bias", ln_b}};
      ZeroOptions zo;
      zo.stage = stage_from_int(stage);
      zo.bucket_bytes = 512;
      zo.unit_policy.persist_below = 0;  // stage 3: every module a unit, gathered on use
      zo.timeout = std::chrono::seconds(60);
      zo.max_grad_norm = kMaxNorm;
      // Note [Split records]: the split layers marked their parameters; the LayerNorm's, never
      // marked, are replicated. Odd runs leave the tensor group to the records.
      if (run % 2 == 0) zo.grid = g;
      DistributedOptimizer opt({group}, rule, g.dp, zo);
      double norm_error = 0.0;
      const int64_t rows = kRows / d;  // this data-parallel rank's rows; every tensor rank the same
      for (int64_t s = 0; s < kSteps; ++s) {
        auto [x, y] = batch(s);
        x = x.narrow(0, g.dp_rank * rows, rows);
        y = y.narrow(0, g.dp_rank * rows, rows);
        if (sp) {  // this tensor rank's part of the sequence
          x = chunk_of(x, 1, *g.tp);
          y = chunk_of(y, 1, *g.tp);
        }
        opt.zero_grad();
        at::Tensor out = mlp(x, [&](const at::Tensor& v) { return up->forward(v); },
                             [&](const at::Tensor& v) { return down->forward(v); }, ln_w, ln_b);
        // The mean over this data-parallel rank's rows and the whole sequence (a shard's sum
        // divided by the full count: the tensor ranks' shards add up to it).
        opt.backward((out - y).pow(2).sum() / static_cast<double>(rows * kSeq * kHidden));
        opt.step();
        EXPECT_TRUE(opt.last_step().clipped);
        norm_error = std::max(norm_error, std::abs(opt.last_step().grad_norm / ref_norms[s] - 1));
      }
      EXPECT_LE(norm_error, 1e-9) << "the grid's gradient norm is not the unsplit model's";
      opt.gather_full_parameters();
      const auto& G = *g.tp;
      const double diff = std::max(
          {max_diff(up->weight, chunk_of(ref_up->weight, 0, G)),
           max_diff(up->bias, chunk_of(ref_up->bias, 0, G)),
           max_diff(down->weight, chunk_of(ref_down->weight, 1, G)),
           max_diff(down->bias, ref_down->bias), max_diff(ln_w, ref_ln_w), max_diff(ln_b, ref_ln_b)});
      EXPECT_LE(diff, 1e-10);
      EXPECT_GT(max_diff(down->bias, down_b0), 1e-3);  // it trained
      EXPECT_TRUE(test::all_ranks(diff <= 1e-10 && norm_error <= 1e-9));
    }
  }
}

}  // namespace
}  // namespace shardopt
