// Fuzz harness for the corpus reader and the instance maker (examples/bert/corpus.cpp, data.cpp):
// the input's first byte picks the file's name (plain or `.gz`) and the corpus format (auto,
// sentences, prose, man); the rest becomes that file, which load_documents reads (gunzip, roff
// man-page conversion, document and sentence splitting, WordPiece over a small vocabulary) and
// create_instances turns into masked pairs. Either it is refused with std::runtime_error naming the
// file, or every instance fits max_seq_length with ids inside the vocabulary, [CLS] first, and
// sorted masked positions inside the sequence. Any other exception, a crash or a sanitizer report
// is a finding. Replayed by CTest (fuzz_replay_corpus) with the ordinary build.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "data.hpp"
#include "tokenizer.hpp"

namespace {

const bert::Vocab& vocab() {
  static const bert::Vocab v = [] {
    std::string text = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
    for (char c = 'a'; c <= 'z'; ++c) text += std::string(1, c) + "\n##" + std::string(1, c) + "\n";
    for (const char* w : {"the", "of", "and", "to", "in", "is", "page", "file", "return", ".", ",",
                          "(", ")", "é", "中"}) {
      text += std::string(w) + "\n";
    }
    return bert::Vocab::parse(text, "fuzz/vocab.txt");
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool gz = (data[0] & 1) != 0;
  const bert::CorpusFormat formats[] = {bert::CorpusFormat::Auto, bert::CorpusFormat::Sentences,
                                        bert::CorpusFormat::Prose, bert::CorpusFormat::Man};
  const bert::CorpusFormat format = formats[(data[0] >> 1) & 3];
  const std::string path = "/dev/shm/shardopt-fuzz-corpus-" + std::to_string(getpid()) +
                           (gz ? ".gz" : ".txt");
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 1 && std::fwrite(data + 1, 1, size - 1, f) != size - 1) std::abort();
  std::fclose(f);
  const bert::Tokenizer tokenizer(vocab(), /*lower_case=*/true);
  std::vector<bert::Document> docs;
  try {
    docs = bert::load_documents({path}, tokenizer, format);
  } catch (const std::runtime_error&) {
    std::remove(path.c_str());
    return 0;
  }
  std::remove(path.c_str());
  bert::PretrainOptions options;
  options.max_seq_length = 24;
  options.max_predictions_per_seq = 4;
  options.dupe_factor = 1;
  for (const auto& doc : docs) {
    if (doc.empty()) std::abort();
    for (const auto& sentence : doc) {
      if (sentence.empty()) std::abort();
      for (const int32_t id : sentence) {
        if (id < 0 || id >= vocab().size()) std::abort();
      }
    }
  }
  if (docs.empty()) return 0;  // create_instances' precondition; prepare.cpp names the corpus
  for (const auto& in : bert::create_instances(docs, vocab(), options)) {
    const auto n = static_cast<int32_t>(in.input_ids.size());
    if (n > options.max_seq_length || n < 3 || in.input_ids[0] != vocab().cls_id()) std::abort();
    if (in.segment_a_length < 2 || in.segment_a_length >= n) std::abort();
    if (in.masked_positions.size() != in.masked_labels.size() ||
        static_cast<int32_t>(in.masked_positions.size()) > options.max_predictions_per_seq) {
      std::abort();
    }
    int32_t previous = -1;
    for (const int32_t pos : in.masked_positions) {
      if (pos <= previous || pos <= 0 || pos >= n) std::abort();
      previous = pos;
    }
    for (const int32_t id : in.input_ids) {
      if (id < 0 || id >= vocab().size()) std::abort();
    }
  }
  return 0;
}
