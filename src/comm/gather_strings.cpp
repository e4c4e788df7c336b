// all_gather_strings: the lengths, then the bytes padded to the longest.
#include "comm/gather_strings.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

namespace shardopt::detail {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            Duration timeout) {
  const int world = comm.size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({world}, at::kLong);
  comm.all_gather(len, lens, true)->wait(timeout);
  const int64_t width = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({width}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world * width}, at::kByte);
  comm.all_gather(buf, all, true)->wait(timeout);
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  const auto* n = lens.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) out.emplace_back(p + r * width, static_cast<size_t>(n[r]));
  return out;
}

}  // namespace shardopt::detail
