// Golden curves: "step loss grad_norm" lines written by --write-golden and compared by --golden
// (the loss within an absolute tolerance, the gradient norm within a relative one). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

struct StepRecord {
  int64_t step = 0;       // 1-based
  double loss = 0;        // mean over the step's global batch
  double grad_norm = -1;  // the optimizer's clipping norm; -1 when not computed
};

// Writes one "step loss grad_norm" line per record (17 significant digits).
void write_golden(const std::string& path, const std::vector<StepRecord>& records);
// Compares `records` with the file's lines of the same steps and prints one line saying how far
// they are. True when some step was compared and every loss is within `loss_tol` and, when
// norm_tol >= 0, every norm within norm_tol relative (of the file's). Throws std::runtime_error
// when the file cannot be read.
bool matches_golden(const std::string& path, const std::vector<StepRecord>& records,
                    double loss_tol, double norm_tol);

}  // namespace gpt
