// Fuzz harness for the vocab.txt reader (bert::Vocab::parse, the text Vocab::load reads;
// examples/bert/tokenizer.cpp): any bytes either are refused with std::runtime_error naming the
// missing special token, or give a vocabulary whose ids are its line numbers and whose tokenizer
// turns any text (here the input itself) into ids inside it. Any other exception, a crash or a
// sanitizer report is a finding. Replayed by CTest (fuzz_replay_vocab) with the ordinary build.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  bert::Vocab vocab;
  try {
    vocab = bert::Vocab::parse(text, "fuzz/vocab.txt");
  } catch (const std::runtime_error&) {
    return 0;
  }
  for (const int32_t id : {vocab.pad_id(), vocab.unk_id(), vocab.cls_id(), vocab.sep_id(),
                           vocab.mask_id()}) {
    if (id < 0 || id >= vocab.size() || !vocab.is_special(id)) std::abort();
  }
  for (int32_t id = 0; id < vocab.size(); ++id) {
    const int32_t first = vocab.find(vocab.token(id));  // the first line of a repeated token
    if (first < 0 || first > id || vocab.token(first) != vocab.token(id)) std::abort();
  }
  (void)vocab.is_cased();
  for (const bool lower : {true, false}) {
    const bert::Tokenizer tokenizer(vocab, lower);
    for (const int32_t id : tokenizer.encode(text.substr(0, 512))) {
      if (id < 0 || id >= vocab.size()) std::abort();
    }
  }
  return 0;
}
