// Replays fuzz corpora with the ordinary build (no clang, no libFuzzer): every file under the
// directories given is passed to the harness's LLVMFuzzerTestOneInput once. Fails when a
// directory holds no file (a replay of nothing proves nothing); a crash fails by itself.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  for (int a = 1; a < argc; ++a) {
    int files = 0;
    for (const auto& entry : fs::recursive_directory_iterator(argv[a])) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++files;
    }
    std::printf("replayed %d inputs from %s\n", files, argv[a]);
    if (files == 0) {
      std::fprintf(stderr, "no inputs in %s\n", argv[a]);
      return 1;
    }
  }
  return argc > 1 ? 0 : 2;
}
