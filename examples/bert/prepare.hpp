// Rank 0's preparation of the vocabulary, the pretraining data and its held-out split (cached
// under OUT/cache by the corpus files' fingerprint and the options), and the build-vocab /
// create-data subcommands. Torch-free.
#pragma once

#include <string>
#include <vector>

#include "data.hpp"
#include "options.hpp"

namespace bert {

struct Prepared {
  std::string vocab_path, data_path, eval_path;  // eval_path "" when there is no eval set
  bool lower_case = true;
  std::vector<std::string> notes;     // what was built or reused, for the log
  std::vector<std::string> warnings;  // what the user should know (e.g. one-document corpus)
};

// Resolves the tokenizer's case: --cased / --lower-case, else the vocabulary's convention; a
// flag that contradicts the vocabulary gets a warning.
bool resolve_lower_case(const Args& a, const Vocab* vocab, std::vector<std::string>* warnings);

// Splits documents into training and held-out ones: round(fraction * n) documents (at least one
// when fraction > 0 and there are two), chosen by `seed`; both keep the corpus order.
void split_documents_by_seed(std::vector<Document> docs, double fraction, uint64_t seed,
                             std::vector<Document>* train, std::vector<Document>* eval);

// Throws std::runtime_error with a message for the user.
Prepared prepare(const Args& a);

int build_vocab_command(const Args& a, const std::string& output);
int create_data_command(const Args& a, const std::string& output, const std::string& eval_output);
// `bert_pretrain tokenize -i FILE --vocab V`: each line's ids, space-separated, one line each (what
// the data files hold for that text; the Hugging Face client test compares BertTokenizer's).
int tokenize_command(const Args& a, const std::string& input);

}  // namespace bert
