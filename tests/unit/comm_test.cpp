// One-process checks of the communication front end: the single engine, error messages, and
// init_from_env's choice of engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "shardopt/options.hpp"

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

TEST(Work, TimeoutMustBePositive) {
  auto c = make_single_communicator();
  EXPECT_THROW(c->set_timeout(Duration::zero()), Error);
}

// One timeout setting: SHARDOPT_TIMEOUT (seconds) becomes the default of ZeroOptions,
// InitOptions and every communicator; a value that is not a positive number is refused.
TEST(DefaultTimeout, EnvironmentVariableSetsEveryDefault) {
  ::setenv("SHARDOPT_TIMEOUT", "2.5", 1);
  EXPECT_EQ(ZeroOptions{}.timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(InitOptions{}.timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(make_single_communicator()->timeout(), std::chrono::milliseconds(2500));
  ::setenv("SHARDOPT_TIMEOUT", "ten", 1);
  try {
    (void)default_timeout();
    ADD_FAILURE() << "SHARDOPT_TIMEOUT=ten was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("SHARDOPT_TIMEOUT must be a positive number of seconds, "
                                         "got 'ten'"), std::string::npos) << e.what();
  }
  ::unsetenv("SHARDOPT_TIMEOUT");
  EXPECT_EQ(ZeroOptions{}.timeout, kDefaultTimeout);
}

}  // namespace
}  // namespace shardopt
