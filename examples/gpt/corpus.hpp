// Byte-level training data: the corpus's files concatenated, each token a byte (vocabulary 256),
// and rows drawn by their global number, so that a step's rows are the same whatever the layout.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

// Note [Rows by number]: row n of the run is the window of seq + 1 bytes at an offset hashed from
// (seed, n). Step s's global batch is rows [s*G, (s+1)*G), G = batch x data-parallel ranks x
// micro-batches, and micro-batch j of data-parallel rank r holds rows ((s*M + j)*D + r)*B + i,
// i < B. The same rows make step s at every (t, p, d) with the same D*M, on any rank count of a
// tensor or pipeline group; a resumed run needs only the step to continue the data.
class ByteCorpus {
 public:
  // Reads every regular file under `path` (a file, or a folder walked in name order); throws
  // std::runtime_error naming the path when it holds fewer than `min_bytes` bytes.
  ByteCorpus(const std::string& path, int64_t min_bytes);
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  int64_t files() const { return files_; }
  // Row n's input tokens and next-token targets, seq of each, appended to `ids` and `targets`.
  void row(uint64_t seed, int64_t n, int64_t seq, std::vector<int64_t>& ids,
           std::vector<int64_t>& targets) const;

 private:
  std::vector<unsigned char> bytes_;
  int64_t files_ = 0;
};

// The first row number of micro-batch `micro` of data-parallel rank `dp_rank` at `step`
// (Note [Rows by number]).
int64_t first_row(int64_t step, int micro, int micro_batches, int dp_rank, int dp, int64_t batch);

}  // namespace gpt
