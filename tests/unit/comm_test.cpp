// One-process checks of the communication front end: the single engine, error messages, and
// init_from_env's choice of engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "plugins.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/config.hpp"
#include "shardopt/error.hpp"
#include "shardopt/options.hpp"
#include "shardopt/process_group.hpp"
#include "support/expect_error.hpp"

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

#if SHARDOPT_HAS_GLOO
// A free TCP port on 127.0.0.1 (bound, read and closed: the store binds it right after).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Rendezvous failures over tcp:// name the missing ranks (rank 0) or the address that could not
// be reached (the others), with no C++ stack trace from c10.
TEST(GlooRendezvous, FailuresNameTheMissingRanksAndTheAddress) {
  const int port = free_port();
  GlooOptions o;
  o.rank = 0;
  o.size = 3;
  o.store = fmt::format("tcp://127.0.0.1:{}", port);
  o.timeout = std::chrono::seconds(2);  // c10d's client connects in whole seconds
  auto expect_error = [](const GlooOptions& options, ErrorKind kind,
                         const std::vector<std::string>& needles) {
    const std::string what =
        test::expect_error([&] { make_gloo_communicator(options); }, kind, needles);
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  };
  expect_error(o, ErrorKind::Timeout,
               {"ranks 1, 2 of 3 never joined", fmt::format("127.0.0.1:{}", port)});
  o.rank = 1;  // nobody serves the store now
  expect_error(o, ErrorKind::Communication,
               {"rank 1 could not reach the rendezvous store", fmt::format("127.0.0.1:{}", port)});
}
#else
TEST(GlooRendezvous, FailuresNameTheMissingRanksAndTheAddress) {
  GTEST_SKIP() << "this build has no Gloo engine (SHARDOPT_WITH_GLOO=OFF; configure says why)";
}
#endif  // SHARDOPT_HAS_GLOO

}  // namespace
}  // namespace shardopt
