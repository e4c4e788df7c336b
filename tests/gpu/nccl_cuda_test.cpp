// The NCCL engine on a GPU: every collective against values computed on the host. Skips, with the
// reason, where this libtorch has no CUDA or no device is visible (the CPU CI machines).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "shardopt/nccl.hpp"

namespace shardopt {
namespace {

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "this libtorch has no CUDA or no GPU is visible";
    comm_ = make_nccl_communicator(make_single_communicator(), 0);
  }
  CommunicatorPtr comm_;
};

TEST_F(NcclTest, CollectivesOnOneRank) {
  const auto cuda = at::TensorOptions().device(at::kCUDA, 0);
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kInt, at::kLong}) {
    at::Tensor t = at::arange(1000, cuda.dtype(dtype));
    comm_->all_reduce(t, ReduceOp::Avg);
    EXPECT_TRUE(t.cpu().equal(at::arange(1000, at::TensorOptions().dtype(dtype)))) << dtype;
    at::Tensor out = at::empty({1000}, cuda.dtype(dtype));
    comm_->reduce_scatter(t, out);
    EXPECT_TRUE(out.equal(t));
    comm_->all_gather(t, out, /*async=*/true)->wait();
    EXPECT_TRUE(out.equal(t));
  }
  comm_->barrier();
}

// Host tensors (the optimizer's flags and partial norms) travel over the bootstrap engine.
TEST_F(NcclTest, CpuTensorsGoThroughTheBootstrap) {
  at::Tensor t = at::ones({4});
  comm_->all_reduce(t, ReduceOp::Avg);
  EXPECT_TRUE(t.equal(at::ones({4})));
}

// torchrun's variables with device "cuda": NCCL over a single-rank Gloo bootstrap (or the
// single engine where Gloo is not built), on the GPU that LOCAL_RANK names.
TEST_F(NcclTest, InitFromEnvPicksNcclForCuda) {
  setenv("SHARDOPT_BACKEND", "nccl", 1);
  setenv("LOCAL_RANK", "0", 1);
  InitOptions o;
  o.device = "cuda";
  auto comm = init_from_env(o);
  unsetenv("SHARDOPT_BACKEND");
  unsetenv("LOCAL_RANK");
  EXPECT_EQ(comm->backend(), "nccl");
  at::Tensor t = at::ones({8}, at::TensorOptions().device(at::kCUDA, 0));
  comm->all_reduce(t, ReduceOp::Sum);
  EXPECT_TRUE(t.cpu().equal(at::ones({8})));
}

}  // namespace
}  // namespace shardopt
