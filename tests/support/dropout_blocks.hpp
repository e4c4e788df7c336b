// DropoutBlocks: residual MLP blocks with dropout 0.1, run plainly or through shardopt::recompute
// (directly, inside Units::run, or as units declared to recompute). Shared by the recompute unit
// and multi-rank tests. Parameters are leaves built from a fixed seed.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/recompute.hpp"
#include "shardopt/units.hpp"

namespace shardopt::test {

enum class Mode {
  Plain,     // every block called directly
  Direct,    // shardopt::recompute(block, {x}) (inside units->run(i, fn) when units are used)
  Declared,  // units declared with recompute = true, run(i, fn, {x})
};

struct DropoutBlocks {
  struct Block {
    at::Tensor w1, b1, w2, b2;
  };
  std::vector<Block> blocks;
  std::vector<std::pair<std::string, at::Tensor>> named;
  UnitsPtr units = std::make_shared<Units>();

  DropoutBlocks(int n, int64_t dim, int64_t hidden, Mode mode = Mode::Plain) {
    at::manual_seed(4321);
    for (int i = 0; i < n; ++i) {
      Block b{leaf(at::randn({dim, hidden}) * 0.2), leaf(at::randn({hidden}) * 0.1),
              leaf(at::randn({hidden, dim}) * 0.2), leaf(at::randn({dim}) * 0.1)};
      const std::string p = "block" + std::to_string(i) + ".";
      named.insert(named.end(), {{p + "w1", b.w1}, {p + "b1", b.b1}, {p + "w2", b.w2}, {p + "b2", b.b2}});
      units->add(p + "unit", {b.w1, b.b1, b.w2, b.b2}, {/*recompute=*/mode == Mode::Declared});
      blocks.push_back(b);
    }
  }
  static at::Tensor leaf(at::Tensor t) { return t.contiguous().set_requires_grad(true); }

  // One block: x + dropout(gelu(x W1 + b1) W2 + b2). Captures by value (recompute.hpp).
  static at::Tensor block(const Block& b, const at::Tensor& x) {
    auto h = at::gelu(at::matmul(x, b.w1) + b.b1);
    return x + at::dropout(at::matmul(h, b.w2) + b.b2, 0.1, /*train=*/true);
  }

  at::Tensor forward(at::Tensor x, Mode mode, bool with_units) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Block b = blocks[i];
      auto fn = [b](const std::vector<at::Tensor>& in) { return block(b, in[0]); };
      const int u = static_cast<int>(i);
      if (mode == Mode::Declared) {
        x = units->run(u, fn, {x});
      } else if (mode == Mode::Direct) {
        x = with_units ? units->run(u, [&] { return recompute(fn, {x}); }) : recompute(fn, {x});
      } else {
        x = with_units ? units->run(u, [&] { return block(b, x); }) : block(b, x);
      }
    }
    return x;
  }
};

}  // namespace shardopt::test
