#include "corpus.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace gpt {
namespace fs = std::filesystem;

namespace {

// splitmix64: a well-mixed 64-bit hash, the same on every platform (std's distributions are not).
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

ByteCorpus::ByteCorpus(const std::string& path, int64_t min_bytes) {
  std::vector<fs::path> paths;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::recursive_directory_iterator(path)) {
      if (e.is_regular_file()) paths.push_back(e.path());
    }
    std::sort(paths.begin(), paths.end());
  } else {
    paths.emplace_back(path);
  }
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("--corpus: cannot read '{}'", p.string()));
    bytes_.insert(bytes_.end(), std::istreambuf_iterator<char>(in),
                  std::istreambuf_iterator<char>());
    ++files_;
  }
  if (size() < min_bytes) {
    throw std::runtime_error(
        fmt::format("--corpus: '{}' holds {} bytes in {} files; a row needs "
                    "{} (--max-seq-length + 1)",
                    path, size(), files_, min_bytes));
  }
}

void ByteCorpus::row(uint64_t seed, int64_t n, int64_t seq, std::vector<int64_t>& ids,
                     std::vector<int64_t>& targets) const {
  const uint64_t starts = static_cast<uint64_t>(size() - seq);  // offsets with seq + 1 bytes
  const auto at = static_cast<int64_t>(mix(mix(seed) ^ static_cast<uint64_t>(n)) % starts);
  for (int64_t i = 0; i < seq; ++i) {
    ids.push_back(bytes_[at + i]);
    targets.push_back(bytes_[at + i + 1]);
  }
}

int64_t first_row(int64_t step, int micro, int micro_batches, int dp_rank, int dp, int64_t batch) {
  return ((step * micro_batches + micro) * dp + dp_rank) * batch;
}

}  // namespace gpt
