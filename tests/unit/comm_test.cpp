// One-process checks of the communication front end: the single engine, error messages, and
// init_from_env's choice of engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardopt/comm.hpp"
#include "plugins.hpp"
#include "shardopt/error.hpp"

namespace shardopt {
namespace {

TEST(SingleCommunicator, CollectivesAreIdentities) {
  auto c = make_single_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "single");
  at::Tensor t = at::arange(10, at::kFloat);
  c->all_reduce(t, ReduceOp::Avg);
  EXPECT_TRUE(t.equal(at::arange(10, at::kFloat)));
  at::Tensor out = at::zeros({10});
  c->reduce_scatter(t, out);
  EXPECT_TRUE(out.equal(t));
  at::Tensor gathered = at::zeros({10});
  c->all_gather(t, gathered, /*async=*/true)->wait();
  EXPECT_TRUE(gathered.equal(t));
}

TEST(SingleCommunicator, ErrorsNameTheOperationAndShapes) {
  auto c = make_single_communicator();
  try {
    c->reduce_scatter(at::zeros({5}), at::zeros({4}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(what.find("comm.reduce_scatter"), std::string::npos) << what;
    EXPECT_NE(what.find("[5] Float cpu"), std::string::npos) << what;
    EXPECT_NE(what.find("shardopt[rank 0/1]"), std::string::npos) << what;
  }
  // An output that overlaps the input but is not this rank's slice would corrupt the result.
  at::Tensor buffer = at::zeros({12});
  EXPECT_THROW(c->reduce_scatter(buffer.narrow(0, 0, 8), buffer.narrow(0, 2, 8)), Error);
}

TEST(InitFromEnv, PicksSingleWithoutLauncherAndRejectsUnknownBackends) {
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("PMI_SIZE");
  unsetenv("PMIX_RANK");
  unsetenv("RANK");
  unsetenv("SHARDOPT_BACKEND");
  EXPECT_EQ(init_from_env()->backend(), "single");
  InitOptions bad;
  bad.backend = "carrier-pigeon";
  try {
    init_from_env(bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown backend 'carrier-pigeon'"), std::string::npos);
  }
}

// A single process with device "cuda" stays on the single engine (it serves CUDA tensors);
// only launched jobs take NCCL. Devices other than cpu/cuda are refused by name.
TEST(InitFromEnv, CudaWithoutLauncherIsSingleAndBadDevicesAreNamed) {
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("RANK");
  unsetenv("SHARDOPT_BACKEND");
  InitOptions cuda;
  cuda.device = "cuda";
  EXPECT_EQ(init_from_env(cuda)->backend(), "single");
  InitOptions bad;
  bad.device = "tpu";
  try {
    init_from_env(bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'tpu'"), std::string::npos) << e.what();
  }
}

TEST(Plugins, AMissingLibrarySaysWhy) {
  const std::string why = detail::load_plugin("shardopt_no_such_part");
  EXPECT_NE(why.find("libshardopt_no_such_part.so"), std::string::npos) << why;
  EXPECT_EQ(detail::load_plugin("shardopt_no_such_part"), why);  // tried once, remembered
}

TEST(Work, TimeoutMustBePositive) {
  auto c = make_single_communicator();
  EXPECT_THROW(c->set_timeout(Duration::zero()), Error);
}

}  // namespace
}  // namespace shardopt
