// Replays fuzz corpora with the ordinary build (no clang, no libFuzzer): every file under the
// directories given is passed to the harness's LLVMFuzzerTestOneInput once; a file named *.hex
// holds its input as hexadecimal text (binary seeds stay out of git; whitespace ignored). Fails
// when a directory holds no file (a replay of nothing proves nothing); a crash fails by itself.
#include <cstddef>
#include <cstdint>
#include <cctype>
#include <cstdio>
#include <string>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

static std::vector<char> from_hex(const std::vector<char>& text) {
  std::string digits;
  for (char c : text) {
    if (std::isxdigit(static_cast<unsigned char>(c))) digits += c;
  }
  std::vector<char> bytes;
  for (size_t i = 0; i + 1 < digits.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(digits.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  for (int a = 1; a < argc; ++a) {
    int files = 0;
    for (const auto& entry : fs::recursive_directory_iterator(argv[a])) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
      if (entry.path().extension() == ".hex") bytes = from_hex(bytes);
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
