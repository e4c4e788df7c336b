// Fuzz harness for the pretraining data file reader (bert::PretrainingData, examples/bert/data.cpp
// and data_check.cpp): the input becomes a file in memory (memfd) that the real reader opens and
// maps. Either it is refused with std::runtime_error naming the file, or every instance and a
// batch of all of them are read inside the file, with lengths inside their rows. Any other
// exception, a crash or a sanitizer report (a read past the mapping) is a finding. Replayed by
// CTest (fuzz_replay_data) with the ordinary build.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz-data", 0);
  if (fd < 0) std::abort();
  if (size > 0 && write(fd, data, size) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const bert::PretrainingData d(path);
    const auto& h = d.header();
    std::vector<int64_t> rows(static_cast<size_t>(d.size()));
    std::iota(rows.begin(), rows.end(), 0);
    for (const int64_t r : rows) {
      const bert::Instance inst = d.instance(r);
      if (inst.input_ids.size() > h.max_seq_length || inst.segment_a_length < 0 ||
          static_cast<size_t>(inst.segment_a_length) > inst.input_ids.size() ||
          inst.masked_positions.size() != inst.masked_labels.size() ||
          inst.masked_positions.size() > h.max_predictions) {
        std::abort();
      }
    }
    for (const bool trim : {true, false}) {
      const bert::Batch b = d.batch(rows, trim);
      if (b.rows != d.size() || b.seq_length > static_cast<int64_t>(h.max_seq_length)) std::abort();
    }
    (void)d.random_next_count();
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find(path) == std::string::npos) std::abort();  // names the file
  }
  close(fd);
  return 0;
}
