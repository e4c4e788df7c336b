// Fuzz harness for BERT's config reader (examples/bert/bert_config.cpp, Note [BERT config files]):
// any bytes either fail to parse as JSON (BertConfig::load's "not valid JSON"), or are refused by
// BertConfig::from_json with std::invalid_argument naming the key, or give a config that
// validates, stays within the bounds the reader promises and survives its own HF export. Any
// other exception, a crash or a sanitizer report is a finding. Replayed by CTest
// (fuzz_replay_bert_config) with the ordinary build.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "bert_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  std::vector<std::string> ignored;
  bert::BertConfig c;
  try {
    c = bert::BertConfig::from_json(j, "fuzz/config.json", &ignored);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  c.validate();  // throws (a finding) if from_json let an inconsistent config through
  constexpr int64_t kMax = 2147483647;
  for (int64_t v : {c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.intermediate_size,
                    c.max_position_embeddings, c.type_vocab_size}) {
    if (v < 1 || v > kMax) std::abort();
  }
  const bert::BertConfig back = bert::BertConfig::from_json(c.to_hf_json(), "fuzz/export");
  if (back.vocab_size != c.vocab_size || back.hidden_size != c.hidden_size ||
      back.num_layers != c.num_layers || back.num_heads != c.num_heads ||
      back.intermediate_size != c.intermediate_size || back.hidden_act != c.hidden_act ||
      back.nsp != c.nsp) {
    std::abort();
  }
  return 0;
}
