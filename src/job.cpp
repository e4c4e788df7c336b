// agree_on_errors, abort_job, run_or_abort: see shardopt/job.hpp.
#include "shardopt/job.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>

#include "comm/agreement.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

void agree_on_errors(Communicator& comm, const std::string& what, const std::function<void()>& body) {
  detail::agree(
      comm, comm.timeout(), what, "every rank stops here",
      [&] {
        try {
          body();
        } catch (const Error&) {
          throw;
        } catch (const std::exception& e) {
          throw Error(ErrorKind::InvalidArgument, comm.rank(), e.what());
        }
        return nlohmann::json();
      },
      nullptr, "job");
}

void abort_job(Communicator& comm, const std::string& message, int exit_code) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s\n", message.c_str());
  if (comm.size() > 1) {
    std::fprintf(stderr, "shardopt[rank %d/%d] job: ending every rank (%s)\n", comm.rank(),
                 comm.size(), comm.backend().c_str());
  }
  std::fflush(stderr);
  comm.abort(exit_code);
}

int run_or_abort(Communicator& comm, const std::function<int()>& body) {
  if (comm.size() == 1) return body();
  try {
    return body();
  } catch (const Error& e) {
    abort_job(comm, e.what(), 1);  // already names its rank
  } catch (const std::exception& e) {
    abort_job(comm, fmt::format("shardopt[rank {}/{}] job: error: {}", comm.rank(), comm.size(),
                                e.what()),
              1);
  } catch (...) {
    abort_job(comm, fmt::format("shardopt[rank {}/{}] job: unknown exception", comm.rank(),
                                comm.size()),
              1);
  }
}

}  // namespace shardopt
