// Vocabulary and data preparation (see prepare.hpp).
#include "prepare.hpp"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "corpus.hpp"

namespace bert {
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

std::vector<std::string> all_files(const Args& a) {
  std::vector<std::string> files;
  for (const auto& c : a.corpus) {
    auto more = corpus_files(c);
    files.insert(files.end(), more.begin(), more.end());
  }
  return files;
}

// A file's text as the vocabulary learner should see it (man pages without their markup).
std::string plain_text(const std::string& file, CorpusFormat format) {
  std::string text = read_text(file);
  if (format == CorpusFormat::Man || (format == CorpusFormat::Auto && looks_like_man_page(text))) {
    return man_to_text(text);
  }
  return text;
}

Vocab learn_vocab(const Args& a, const std::vector<std::string>& files, bool lower_case) {
  const auto format = parse_corpus_format(a.corpus_format);
  std::vector<std::string> texts;
  texts.reserve(files.size());
  for (const auto& f : files) texts.push_back(plain_text(f, format));
  VocabBuildOptions vo;
  vo.vocab_size = a.vocab_size;
  vo.lower_case = lower_case;
  return build_vocab(texts, vo);
}

PretrainOptions pretrain_options(const Args& a) {
  PretrainOptions po;
  po.max_seq_length = a.max_seq_length;
  po.max_predictions_per_seq = a.max_predictions;
  po.masked_lm_prob = a.masked_lm_prob;
  po.short_seq_prob = a.short_seq_prob;
  po.dupe_factor = a.dupe_factor;
  po.whole_word_mask = a.whole_word_mask;
  po.seed = a.seed;
  return po;
}

std::string corpus_note(const Args& a, size_t files) {
  std::string names;
  for (const auto& c : a.corpus) {
    names += (names.empty() ? "" : ", ") + (is_named_corpus(c) ? describe_named_corpus(c) : c);
  }
  return fmt::format("corpus: {} ({} files{})", names, files,
                     a.corpus_given ? "" : "; the default: --corpus licenses or PATH... for others");
}

struct Made {
  size_t train_docs = 0, eval_docs = 0, train_instances = 0, eval_instances = 0;
};

// Tokenizes the corpus, holds out documents, writes the data file (and the eval file).
Made make_data(const Args& a, const std::vector<std::string>& files, const Tokenizer& tok,
               const std::string& data_path, const std::string& eval_path, uint64_t key,
               std::vector<std::string>* warnings) {
  const PretrainOptions po = pretrain_options(a);
  auto docs = load_documents(files, tok, parse_corpus_format(a.corpus_format));
  std::vector<Document> train, eval;
  split_documents_by_seed(std::move(docs), eval_path.empty() ? 0.0 : a.eval_fraction, a.seed, &train,
                          &eval);
  Made m;
  m.train_docs = train.size(), m.eval_docs = eval.size();
  if (train.empty()) {  // create_instances' precondition, said in the user's terms
    throw std::runtime_error(fmt::format(
        "--corpus: no sentence with a token in its {} file(s){}", files.size(),
        eval.empty() ? " (empty files, or man pages that only redirect with .so)"
                     : fmt::format("; all {} document(s) went to the held-out split "
                                   "(--eval-fraction)", eval.size())));
  }
  if (train.size() < 2) {
    warnings->push_back(fmt::format(
        "the training data has {} document(s): NSP's \"random next\" segments then come from the "
        "same document, so next-sentence prediction cannot be learned; give a corpus of many "
        "documents (blank lines separate them in the sentences format, files in prose)",
        train.size()));
  }
  for (const auto& path : {data_path, eval_path}) {
    if (!path.empty() && fs::path(path).has_parent_path()) {
      fs::create_directories(fs::path(path).parent_path());
    }
  }
  const auto instances = create_instances(train, tok.vocab(), po);
  write_pretraining_file(data_path, instances, po, tok.vocab(), tok.lower_case(), key);
  m.train_instances = instances.size();
  if (!eval_path.empty()) {
    if (eval.empty()) throw std::runtime_error("--eval-fraction: no document was held out");
    if (eval.size() < 2) {
      warnings->push_back("the eval data has 1 document: its \"random next\" segments come from "
                          "it too (raise --eval-fraction)");
    }
    PretrainOptions eo = po;
    eo.dupe_factor = 1;  // one masking of each held-out document
    eo.seed = po.seed + 1;
    auto held_out = create_instances(eval, tok.vocab(), eo);
    if (static_cast<int64_t>(held_out.size()) > a.eval_max_instances) {
      held_out.resize(static_cast<size_t>(a.eval_max_instances));  // already shuffled
    }
    write_pretraining_file(eval_path, held_out, eo, tok.vocab(), tok.lower_case(), key + 1);
    m.eval_instances = held_out.size();
  }
  return m;
}

}  // namespace

bool resolve_lower_case(const Args& a, const Vocab* vocab, std::vector<std::string>* warnings) {
  const bool vocab_cased = vocab && vocab->is_cased();
  if (a.cased || a.lower_case) {
    if (vocab && a.lower_case && vocab_cased) {
      warnings->push_back("--lower-case with a cased vocabulary (it has upper-case tokens): its "
                          "upper-case tokens will never be produced");
    }
    if (vocab && a.cased && !vocab_cased) {
      warnings->push_back("--cased with an uncased vocabulary (no upper-case tokens): capitalised "
                          "words will split into pieces or [UNK]");
    }
    return a.lower_case;
  }
  return !vocab_cased;
}

void split_documents_by_seed(std::vector<Document> docs, double fraction, uint64_t seed,
                             std::vector<Document>* train, std::vector<Document>* eval) {
  train->clear(), eval->clear();
  size_t held = static_cast<size_t>(std::llround(fraction * static_cast<double>(docs.size())));
  if (fraction > 0 && held == 0 && docs.size() >= 2) held = 1;
  held = std::min(held, docs.size() > 0 ? docs.size() - 1 : 0);
  std::vector<size_t> order(docs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  Rng rng(seed ^ 0x6576616C5F73706CULL);  // "eval_spl": independent of the instance draws
  rng.shuffle(order);
  std::vector<char> is_eval(docs.size(), 0);
  for (size_t i = 0; i < held; ++i) is_eval[order[i]] = 1;
  for (size_t i = 0; i < docs.size(); ++i) {
    (is_eval[i] ? eval : train)->push_back(std::move(docs[i]));
  }
}

Prepared prepare(const Args& a) {
  Prepared p;
  if (!a.data.empty()) {  // made beforehand: no corpus pass at all
    p.data_path = a.data;
    p.vocab_path = a.vocab.empty() ? vocab_next_to(a.data) : a.vocab;
    p.eval_path = a.eval_data;
    const Vocab vocab = Vocab::load(p.vocab_path);
    const PretrainingData data(a.data);
    if (!a.cased && !a.lower_case && data.header().lower_case != 0) {
      p.lower_case = data.header().lower_case == 1;
    } else {
      p.lower_case = resolve_lower_case(a, &vocab, &p.warnings);
    }
    p.notes.push_back(fmt::format("data: {} ({} instances, given), vocab: {}{}", a.data, data.size(),
                                  p.vocab_path, a.vocab.empty() ? " (found next to it)" : ""));
    return p;
  }
  const fs::path cache = fs::path(a.out) / "cache";
  fs::create_directories(cache);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> files = all_files(a);
  p.notes.push_back(corpus_note(a, files.size()));
  const uint64_t fkey = files_fingerprint(files);

  Vocab vocab;
  if (!a.vocab.empty()) {
    p.vocab_path = a.vocab;
    vocab = Vocab::load(a.vocab);
    p.lower_case = resolve_lower_case(a, &vocab, &p.warnings);
    p.notes.push_back(fmt::format("vocab: {} (given, {} tokens, {})", a.vocab, vocab.size(),
                                  p.lower_case ? "lower-cased" : "cased"));
  } else {
    p.lower_case = resolve_lower_case(a, nullptr, &p.warnings);
    const std::string params = fmt::format("vocab-v2 {} {} {}", a.vocab_size, p.lower_case,
                                           a.corpus_format);
    p.vocab_path = (cache / ("vocab-" + hex(fnv1a(params.data(), params.size(), fkey)) + ".txt")).string();
    if (fs::exists(p.vocab_path)) {
      vocab = Vocab::load(p.vocab_path);
      p.notes.push_back("vocab: " + p.vocab_path + " (cached)");
    } else {
      const auto tv = std::chrono::steady_clock::now();
      vocab = learn_vocab(a, files, p.lower_case);
      vocab.save(p.vocab_path);
      p.notes.push_back(fmt::format(
          "vocab: {} (learned, {} tokens, {}, {:.1f} s{})", p.vocab_path, vocab.size(),
          p.lower_case ? "lower-cased" : "cased", seconds_since(tv),
          vocab.size() < a.vocab_size ? fmt::format("; {} requested, but no pair of pieces occurs "
                                                    "twice more in this corpus", a.vocab_size)
                                      : ""));
    }
  }
  const bool hold_out = a.eval_data.empty() && a.eval_fraction > 0;
  const PretrainOptions po = pretrain_options(a);
  const std::string params = fmt::format(
      "v{} L{} P{} m{} s{} d{} w{} seed{} fmt{} lc{} ev{} {}", kDataVersion, po.max_seq_length,
      po.max_predictions_per_seq, po.masked_lm_prob, po.short_seq_prob, po.dupe_factor,
      po.whole_word_mask, po.seed, a.corpus_format, p.lower_case, hold_out ? a.eval_fraction : 0.0,
      a.eval_max_instances);
  uint64_t dkey = fnv1a(params.data(), params.size(), fkey);
  const uint64_t vhash = vocab_fingerprint(vocab);
  dkey = fnv1a(&vhash, sizeof(vhash), dkey);
  p.data_path = (cache / ("pretrain-" + hex(dkey) + ".bin")).string();
  p.eval_path = hold_out ? (cache / ("pretrain-" + hex(dkey) + ".eval.bin")).string() : a.eval_data;
  if (fs::exists(p.data_path) && (!hold_out || fs::exists(p.eval_path))) {
    p.notes.push_back(fmt::format("data: {} ({} instances, cached){}", p.data_path,
                                  PretrainingData(p.data_path).size(),
                                  hold_out ? fmt::format("; eval: {} ({} instances, cached)",
                                                         p.eval_path, PretrainingData(p.eval_path).size())
                                           : ""));
    return p;
  }
  const auto td = std::chrono::steady_clock::now();
  const Tokenizer tok(vocab, p.lower_case);
  const Made m = make_data(a, files, tok, p.data_path, hold_out ? p.eval_path : "", dkey, &p.warnings);
  p.notes.push_back(fmt::format("data: {} (made: {} documents -> {} instances, {:.1f} s)", p.data_path,
                                m.train_docs, m.train_instances, seconds_since(td)));
  if (hold_out) {
    p.notes.push_back(fmt::format("eval: {} ({} held-out documents ({:.0f}%) -> {} instances)",
                                  p.eval_path, m.eval_docs, 100 * a.eval_fraction, m.eval_instances));
  }
  p.notes.push_back(fmt::format("prepared in {:.1f} s", seconds_since(t0)));
  return p;
}

int build_vocab_command(const Args& a, const std::string& output) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> warnings;
  const bool lower_case = resolve_lower_case(a, nullptr, &warnings);
  const auto files = all_files(a);
  const Vocab v = learn_vocab(a, files, lower_case);
  v.save(output);
  fmt::print("[bert] {}: {} tokens (requested {}, {}) from {} files in {:.1f} s\n", output, v.size(),
             a.vocab_size, lower_case ? "lower-cased" : "cased", files.size(), seconds_since(t0));
  return 0;
}

int create_data_command(const Args& a, const std::string& output, const std::string& eval_output) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> warnings;
  const Vocab vocab = Vocab::load(a.vocab);
  const Tokenizer tok(vocab, resolve_lower_case(a, &vocab, &warnings));
  const Made m = make_data(a, all_files(a), tok, output, eval_output, 0, &warnings);
  // The vocabulary travels with the data: the trainer finds it there when --vocab is left out.
  if (fs::absolute(a.vocab) != fs::absolute(output + ".vocab.txt")) vocab.save(output + ".vocab.txt");
  for (const auto& w : warnings) fmt::print("[bert] warning: {}\n", w);
  fmt::print("[bert] {}: {} documents -> {} instances ({}); vocab copied to {}.vocab.txt\n", output,
             m.train_docs, m.train_instances, tok.lower_case() ? "lower-cased" : "cased", output);
  if (!eval_output.empty()) {
    fmt::print("[bert] {}: {} held-out documents -> {} instances\n", eval_output, m.eval_docs,
               m.eval_instances);
  }
  fmt::print("[bert] done in {:.1f} s\n", seconds_since(t0));
  return 0;
}

int tokenize_command(const Args& a, const std::string& input) {
  std::vector<std::string> warnings;
  const Vocab vocab = Vocab::load(a.vocab);
  const Tokenizer tok(vocab, resolve_lower_case(a, &vocab, &warnings));
  for (const auto& w : warnings) fmt::print(stderr, "[bert] warning: {}\n", w);
  std::ifstream in(input, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("tokenize: cannot read '{}'", input));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    fmt::print("{}\n", fmt::join(tok.encode(line), " "));
  }
  return 0;
}

}  // namespace bert
