// Stage 3, one process: a parameter read while its unit is released raises an error naming it
// (it used to be a SIGSEGV, or torch's "storage of size 0" for a forward outside Units::run);
// inside Units::run and after gather_full_parameters() it reads normally.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/ordered_dict.h>

#include <functional>
#include <string>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/units.hpp"
#include "support/expect_error.hpp"

namespace shardopt {
namespace {

void expect_released_error(const std::function<void()>& read, const std::string& what) {
  SCOPED_TRACE(what);
  test::expect_error(read, ErrorKind::InvalidArgument,
                     {"parameter 'layer.weight' (unit 'layer') is released", "Units::run",
                      "gather_full_parameters()"});
}

TEST(ReleaseGuard, ReleasedParameterReadsAreNamedErrors) {
  at::manual_seed(0);
  at::Tensor w = at::randn({4, 3}).set_requires_grad(true);
  at::Tensor head = at::randn({3}).set_requires_grad(true);
  const at::Tensor w0 = w.detach().clone();
  auto units = std::make_shared<Units>();
  const int layer = units->add("layer", {w});
  torch::OrderedDict<std::string, at::Tensor> named;
  named.insert("layer.weight", w);
  named.insert("head", head);  // root unit: always gathered
  ZeroOptions zo;
  zo.stage = Stage::Parameters;
  zo.units = units;
  DistributedOptimizer opt(named, SGD(0.1), make_single_communicator(), zo);

  expect_released_error([&] { (void)w.sum(); }, "sum");
  expect_released_error([&] { (void)w.clone(); }, "clone");
  expect_released_error([&] { (void)w.t(); }, "a view");
  expect_released_error([&] { (void)at::matmul(at::ones({2, 4}), w); }, "forward outside run");
  expect_released_error([&] { (void)w.to(at::kDouble); }, "to");
  EXPECT_TRUE(head.sum().defined());  // the root unit stays readable

  // Inside run(), the values are there and training works.
  at::Tensor x = at::ones({2, 4});
  at::Tensor y = units->run(layer, [&] { return at::matmul(x, w); });
  EXPECT_TRUE(w.sizes().equals({4, 3}));  // shape kept while released
  opt.backward((y * head).sum());
  opt.step();
  expect_released_error([&] { (void)w.sum(); }, "sum after step");

  opt.gather_full_parameters();
  EXPECT_FALSE(w.detach().equal(w0));  // readable again, and updated
  EXPECT_TRUE(at::isfinite(w.detach()).all().item<bool>());
}

}  // namespace
}  // namespace shardopt
