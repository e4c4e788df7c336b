// Automatic stage-3 units from parameter names (shardopt/unit_policy.hpp).
#include <gtest/gtest.h>

#include "shardopt/error.hpp"
#include "shardopt/unit_policy.hpp"

namespace shardopt {
namespace {

struct Named {
  std::vector<std::string> names;
  std::vector<int64_t> numels, ids;
  void add(std::string name, int64_t numel, int64_t id = -1) {
    names.push_back(std::move(name));
    numels.push_back(numel);
    ids.push_back(id >= 0 ? id : static_cast<int64_t>(ids.size()));
  }
  DerivedUnits derive(const UnitPolicy& p) const { return derive_units(names, numels, ids, p); }
};

std::vector<std::string> member_names(const Named& n, const DerivedUnits& d, size_t unit) {
  std::vector<std::string> out;
  for (int i : d.members[unit]) out.push_back(n.names[i]);
  return out;
}

// A scripted nn.TransformerEncoder with a tied decoder, as torch names it.
Named transformer() {
  Named n;
  n.add("embedding.weight", 1000, 0);
  for (int l = 0; l < 2; ++l) {
    for (const char* p : {"self_attn.in_proj_weight", "self_attn.in_proj_bias",
                          "self_attn.out_proj.weight", "linear1.weight", "norm1.weight"}) {
      n.add("encoder.layers." + std::to_string(l) + "." + p, 300);
    }
  }
  n.add("decoder.weight", 1000, 0);  // tied: the same tensor as embedding.weight
  n.add("decoder.bias", 10);
  n.add("scale", 1);  // the root module's own parameter
  return n;
}

TEST(UnitPolicy, DefaultRuleMakesListElementsAndTopLevelChildrenUnits) {
  const Named n = transformer();
  UnitPolicy p;
  p.persist_below = 0;
  const DerivedUnits d = n.derive(p);
  ASSERT_EQ(d.names, (std::vector<std::string>{"embedding", "encoder.layers.0", "encoder.layers.1",
                                               "decoder", "(root)"}));
  EXPECT_EQ(member_names(n, d, 1).size(), 5u);
  EXPECT_EQ(member_names(n, d, 1).front(), "encoder.layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(member_names(n, d, 3),
            (std::vector<std::string>{"decoder.weight", "decoder.bias"}));
  EXPECT_EQ(member_names(n, d, 4), (std::vector<std::string>{"scale"}));
  EXPECT_TRUE(d.persistent.empty());
}

TEST(UnitPolicy, SmallGroupsPersistAndTiedTensorsCountOnce) {
  const Named n = transformer();
  UnitPolicy p;
  p.persist_below = 1001;  // a layer has 1500 elements; the decoder 1010; the embedding 1000
  p.persist_share = 1.0;   // the per-group size alone (the share: next test)
  const DerivedUnits d = n.derive(p);
  EXPECT_EQ(d.names, (std::vector<std::string>{"encoder.layers.0", "encoder.layers.1",
                                               "decoder"}));
  EXPECT_EQ(d.persistent, (std::vector<std::string>{"embedding", "(root)"}));
  Named tied_twice;  // one tensor under two names in one group counts once
  tied_twice.add("head.a", 600, 7);
  tied_twice.add("head.b", 600, 7);
  p.persist_below = 1000;
  EXPECT_TRUE(tied_twice.derive(p).names.empty());
}

// Persistence within persist_share of the model's elements (4011 here), smallest groups first:
// (root) 1, then the embedding 1000 (cumulative 1001), then the decoder 1010 (its weight is the
// embedding's, counted again in its group: 2011).
TEST(UnitPolicy, PersistenceStaysWithinItsShareSmallestFirst) {
  const Named n = transformer();
  UnitPolicy p;
  p.persist_below = 2000;  // every group but the layers (1500 each is under it too)
  const auto persistent = [&](double share) {
    p.persist_share = share;
    const DerivedUnits d = n.derive(p);
    EXPECT_EQ(d.numel, 4011);
    return std::make_pair(d.persistent, d.persistent_numel);
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(persistent(0.0), std::make_pair(V{}, int64_t{0}));
  EXPECT_EQ(persistent(0.1), std::make_pair(V{"(root)"}, int64_t{1}));          // budget 401
  EXPECT_EQ(persistent(0.25), std::make_pair(V{"embedding", "(root)"}, int64_t{1001}));
  EXPECT_EQ(persistent(0.6), std::make_pair(V{"embedding", "decoder", "(root)"}, int64_t{2011}));
  // The default: a tenth of the model.
  EXPECT_EQ(UnitPolicy{}.persist_share, 0.1);
  p.persist_share = 1.5;
  EXPECT_THROW(p.validate(), Error);
  p.persist_share = -0.1;
  EXPECT_THROW(p.validate(), Error);
}

TEST(UnitPolicy, PatternsNameUnitsAndTheRestPersists) {
  const Named n = transformer();
  UnitPolicy p;
  p.persist_below = 0;
  p.patterns = {R"(encoder\.layers\.\d+)", "decoder"};
  const DerivedUnits d = n.derive(p);
  EXPECT_EQ(d.names, (std::vector<std::string>{"encoder.layers.0", "encoder.layers.1",
                                               "decoder"}));
  EXPECT_EQ(d.persistent, (std::vector<std::string>{"(matched by no pattern)"}));
  // A pattern matches at the start of the name only.
  p.patterns = {"layers"};
  EXPECT_TRUE(n.derive(p).names.empty());
}

TEST(UnitPolicy, DeepNumberedPathsAndBadInput) {
  Named n;
  n.add("bert.encoder.layer.11.attention.self.query.weight", 10);
  n.add("bert.embeddings.word_embeddings.weight", 10);
  n.add("layers.0.weight", 10);  // a numbered component right below the root
  UnitPolicy p;
  p.persist_below = 0;
  // "bert" holds a list, so its other children are groups of their own (not all of "bert").
  EXPECT_EQ(n.derive(p).names,
            (std::vector<std::string>{"bert.encoder.layer.11", "bert.embeddings", "layers.0"}));
  p.patterns = {"("};
  EXPECT_THROW(p.validate(), Error);
  p.patterns.clear();
  p.persist_below = -1;
  EXPECT_THROW(p.validate(), Error);
  EXPECT_THROW(derive_units({"a"}, {}, {}, UnitPolicy{}), Error);
}

// Below a module holding a list, each child is its own group; elsewhere the top-level child.
TEST(UnitPolicy, GroupsDescendToTheChildrenOfModulesHoldingALayerList) {
  Named n;
  n.add("bert.embeddings.word_embeddings.weight", 10);
  n.add("bert.embeddings.LayerNorm.weight", 10);
  n.add("bert.encoder.layer.0.output.dense.weight", 10);
  n.add("bert.encoder.layer.1.output.dense.weight", 10);
  n.add("bert.encoder.scale", 10);  // the own parameter of a module holding the list
  n.add("bert.pooler.dense.weight", 10);
  n.add("cls.predictions.transform.dense.weight", 10);
  n.add("cls.predictions.bias", 10);
  n.add("cls.seq_relationship.weight", 10);
  n.add("model.norm.weight", 10);  // a second top-level child without a list: one group
  n.add("model.head.weight", 10);
  UnitPolicy p;
  p.persist_below = 0;
  const DerivedUnits d = n.derive(p);
  EXPECT_EQ(d.names, (std::vector<std::string>{"bert.embeddings", "bert.encoder.layer.0",
                                               "bert.encoder.layer.1", "bert.encoder",
                                               "bert.pooler", "cls", "model"}));
  EXPECT_EQ(member_names(n, d, 0), (std::vector<std::string>{
                                       "bert.embeddings.word_embeddings.weight",
                                       "bert.embeddings.LayerNorm.weight"}));
  EXPECT_EQ(member_names(n, d, 5).size(), 3u);
}

}  // namespace
}  // namespace shardopt
