// The trainer's progress output: a bar rewritten in place on a terminal, plain lines otherwise,
// and the human-readable units both use. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace bert {

std::string human_bytes(double bytes);
std::string human_time(double seconds);  // "?" when not finite

// --progress auto|tty|lines -> whether to rewrite one line with '\r'. auto: stdout is a terminal
// and no MPI launcher started us (mpirun gives ranks a pseudo-terminal even when its own output
// goes to a file, so a rank cannot tell; scripts/run-example.sh decides from its own stdout).
bool progress_on_terminal(const std::string& mode);

// Global throughput over an interval of training time (data, forward, backward, step).
struct Rates {
  double steps_per_s = 0, samples_per_s = 0, tokens_per_s = 0;
};
Rates rates(int64_t steps, int64_t samples, int64_t tokens, double seconds);
std::string format_rates(const Rates& r);  // "2.41 steps/s, 38.6 samples/s, 4,660 tokens/s"

// "[#########...........]  45%" of `width` cells.
std::string progress_bar(int64_t done, int64_t total, int width = 20);

}  // namespace bert
