#include "prepare_on_rank0.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace bert {

// Rank 0 prepares; the others learn the outcome (paths or rank 0's error) by broadcast.
Prepared prepare_on_rank0(const Args& a, shardopt::Communicator& comm) {
  Prepared p;
  std::string message;
  if (comm.rank() == 0) {
    try {
      p = prepare(a);
      message = fmt::format("ok\n{}\n{}\n{}\n{}", p.vocab_path, p.data_path, p.eval_path,
                            p.lower_case ? 1 : 0);
    } catch (const std::exception& e) {
      message = std::string("error\n") + e.what();
    }
  }
  auto len = at::tensor({static_cast<int64_t>(message.size())}, at::kLong);
  comm.broadcast(len, 0);
  auto bytes = at::zeros({len.item<int64_t>()}, at::kByte);
  if (comm.rank() == 0) std::memcpy(bytes.data_ptr(), message.data(), message.size());
  comm.broadcast(bytes, 0);
  message.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  std::istringstream in(message);
  std::string status, lower;
  std::getline(in, status);
  if (status != "ok") {
    std::string what((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    throw std::runtime_error(comm.rank() == 0 ? what : "rank 0 could not prepare the data: " + what);
  }
  std::getline(in, p.vocab_path);
  std::getline(in, p.data_path);
  std::getline(in, p.eval_path);
  std::getline(in, lower);
  p.lower_case = lower == "1";
  return p;
}

}  // namespace bert
