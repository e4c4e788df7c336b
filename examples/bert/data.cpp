// Corpus -> pretraining instances -> binary file -> mmap -> per-rank batches. Torch-free.
#include "data.hpp"

#include "corpus.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace bert {

namespace fs = std::filesystem;

int64_t Rng::randint(int64_t lo, int64_t hi) {
  if (hi < lo) throw std::invalid_argument("Rng::randint: empty range");
  const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
  if (span == 0) return static_cast<int64_t>(engine_());  // the full 64-bit range
  const uint64_t limit = UINT64_MAX - UINT64_MAX % span;
  uint64_t x;
  do {
    x = engine_();
  } while (x >= limit);
  return lo + static_cast<int64_t>(x % span);
}

uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

uint64_t vocab_fingerprint(const Vocab& vocab) {
  uint64_t h = fnv1a("vocab-v1", 8);
  for (const auto& t : vocab.tokens()) h = fnv1a(t.c_str(), t.size() + 1, h);
  return h;
}

CorpusFormat parse_corpus_format(const std::string& text) {
  if (text == "auto") return CorpusFormat::Auto;
  if (text == "sentences") return CorpusFormat::Sentences;
  if (text == "prose") return CorpusFormat::Prose;
  if (text == "man") return CorpusFormat::Man;
  throw std::invalid_argument("corpus format must be auto, sentences, prose or man, got '" + text +
                              "'");
}

// ---- corpus -----------------------------------------------------------------------------------

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\f\v";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) lines.push_back(trim(line));
  return lines;
}

bool ends_sentence(const std::string& line) {
  if (line.empty()) return false;
  const char c = line.back();
  return c == '.' || c == '?' || c == '!' || c == '"' || c == '\'' || c == ')';
}

// Splits a paragraph on '.', '?' or '!' followed by whitespace.
void split_sentences(const std::string& paragraph, std::vector<std::string>& out) {
  std::string cur;
  for (size_t i = 0; i < paragraph.size(); ++i) {
    cur.push_back(paragraph[i]);
    const char c = paragraph[i];
    const bool end = (c == '.' || c == '?' || c == '!') &&
                     (i + 1 == paragraph.size() || paragraph[i + 1] == ' ');
    if (end) {
      auto t = trim(cur);
      if (!t.empty()) out.push_back(std::move(t));
      cur.clear();
    }
  }
  auto t = trim(cur);
  if (!t.empty()) out.push_back(std::move(t));
}

}  // namespace

std::vector<std::vector<std::string>> split_documents(const std::string& text,
                                                      CorpusFormat format) {
  const auto lines = lines_of(text);
  if (format == CorpusFormat::Auto) {
    size_t nonempty = 0, ending = 0;
    for (const auto& l : lines) {
      if (l.empty()) continue;
      ++nonempty;
      ending += ends_sentence(l);
    }
    format = (nonempty > 0 && ending * 10 >= nonempty * 8) ? CorpusFormat::Sentences
                                                           : CorpusFormat::Prose;
  }
  std::vector<std::vector<std::string>> docs(1);
  if (format == CorpusFormat::Sentences) {
    for (const auto& l : lines) {
      if (l.empty()) {
        if (!docs.back().empty()) docs.emplace_back();
      } else {
        docs.back().push_back(l);
      }
    }
  } else {
    std::string paragraph;
    for (size_t i = 0; i <= lines.size(); ++i) {
      if (i == lines.size() || lines[i].empty()) {
        split_sentences(paragraph, docs.back());
        paragraph.clear();
      } else {
        if (!paragraph.empty()) paragraph.push_back(' ');
        paragraph += lines[i];
      }
    }
  }
  if (docs.back().empty()) docs.pop_back();
  return docs;
}

std::vector<Document> load_documents(const std::vector<std::string>& files,
                                     const Tokenizer& tokenizer, CorpusFormat format) {
  std::vector<Document> documents;
  for (const auto& f : files) {
    std::string text = read_text(f);
    CorpusFormat file_format = format;
    if (format == CorpusFormat::Man || (format == CorpusFormat::Auto && looks_like_man_page(text))) {
      text = man_to_text(text);
      file_format = CorpusFormat::Prose;
    }
    for (const auto& sentences : split_documents(text, file_format)) {
      Document doc;
      for (const auto& s : sentences) {
        auto ids = tokenizer.encode(s);
        if (!ids.empty()) doc.push_back(std::move(ids));
      }
      if (!doc.empty()) documents.push_back(std::move(doc));
    }
  }
  return documents;
}

// ---- instances (create_pretraining_data.py) ---------------------------------------------------

namespace {

void truncate_seq_pair(std::vector<int32_t>& a, std::vector<int32_t>& b, size_t max_tokens,
                       Rng& rng) {
  while (a.size() + b.size() > max_tokens) {
    auto& longer = a.size() > b.size() ? a : b;
    // Truncate from the front or the back at random to avoid biases.
    if (rng.uniform() < 0.5) longer.erase(longer.begin());
    else longer.pop_back();
  }
}

void mask_instance(Instance& inst, const Vocab& vocab, const std::vector<int32_t>& replacements,
                   const PretrainOptions& opt, Rng& rng) {
  const auto& tokens = inst.input_ids;
  std::vector<std::vector<int32_t>> candidates;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t == vocab.cls_id() || t == vocab.sep_id()) continue;
    if (opt.whole_word_mask && !candidates.empty() && vocab.is_continuation(t)) {
      candidates.back().push_back(static_cast<int32_t>(i));
    } else {
      candidates.push_back({static_cast<int32_t>(i)});
    }
  }
  rng.shuffle(candidates);
  const auto rounded = static_cast<int64_t>(
      std::nearbyint(static_cast<double>(tokens.size()) * opt.masked_lm_prob));
  const int64_t to_predict =
      std::min<int64_t>(opt.max_predictions_per_seq, std::max<int64_t>(1, rounded));
  std::vector<int32_t> output = tokens;
  std::vector<std::pair<int32_t, int32_t>> masked;  // position, label
  std::vector<char> covered(tokens.size(), 0);
  for (const auto& set : candidates) {
    if (static_cast<int64_t>(masked.size()) >= to_predict) break;
    if (static_cast<int64_t>(masked.size() + set.size()) > to_predict) continue;
    bool any = false;
    for (int32_t i : set) any = any || covered[i];
    if (any) continue;
    for (int32_t i : set) {
      covered[i] = 1;
      int32_t replacement;
      if (rng.uniform() < 0.8) {
        replacement = vocab.mask_id();
      } else if (rng.uniform() < 0.5) {
        replacement = tokens[i];
      } else {
        replacement = replacements[static_cast<size_t>(
            rng.randint(0, static_cast<int64_t>(replacements.size()) - 1))];
      }
      output[i] = replacement;
      masked.emplace_back(i, tokens[i]);
    }
  }
  std::sort(masked.begin(), masked.end());
  inst.input_ids = std::move(output);
  for (const auto& [pos, label] : masked) {
    inst.masked_positions.push_back(pos);
    inst.masked_labels.push_back(label);
  }
}

void instances_from_document(const std::vector<Document>& docs, size_t doc_index,
                             const Vocab& vocab, const std::vector<int32_t>& replacements,
                             const PretrainOptions& opt, Rng& rng, std::vector<Instance>& out) {
  const Document& document = docs[doc_index];
  const int64_t max_num_tokens = opt.max_seq_length - 3;
  int64_t target_seq_length = max_num_tokens;
  if (rng.uniform() < opt.short_seq_prob) target_seq_length = rng.randint(2, max_num_tokens);

  std::vector<const std::vector<int32_t>*> chunk;
  int64_t chunk_length = 0;
  int64_t i = 0;
  const auto n = static_cast<int64_t>(document.size());
  while (i < n) {
    chunk.push_back(&document[static_cast<size_t>(i)]);
    chunk_length += static_cast<int64_t>(document[static_cast<size_t>(i)].size());
    if (i == n - 1 || chunk_length >= target_seq_length) {
      if (!chunk.empty()) {
        const auto chunk_n = static_cast<int64_t>(chunk.size());
        int64_t a_end = 1;
        if (chunk_n >= 2) a_end = rng.randint(1, chunk_n - 1);
        std::vector<int32_t> a, b;
        for (int64_t j = 0; j < a_end; ++j) a.insert(a.end(), chunk[j]->begin(), chunk[j]->end());
        bool random_next = false;
        if (chunk_n == 1 || rng.uniform() < 0.5) {
          random_next = true;
          const int64_t target_b_length = target_seq_length - static_cast<int64_t>(a.size());
          int64_t r = 0;
          for (int k = 0; k < 10; ++k) {
            r = rng.randint(0, static_cast<int64_t>(docs.size()) - 1);
            if (r != static_cast<int64_t>(doc_index)) break;
          }
          const Document& other = docs[static_cast<size_t>(r)];
          const int64_t start = rng.randint(0, static_cast<int64_t>(other.size()) - 1);
          for (auto j = static_cast<size_t>(start); j < other.size(); ++j) {
            b.insert(b.end(), other[j].begin(), other[j].end());
            if (static_cast<int64_t>(b.size()) >= target_b_length) break;
          }
          // The unused segments go back to the document for the next chunk.
          i -= chunk_n - a_end;
        } else {
          for (int64_t j = a_end; j < chunk_n; ++j) {
            b.insert(b.end(), chunk[j]->begin(), chunk[j]->end());
          }
        }
        truncate_seq_pair(a, b, static_cast<size_t>(max_num_tokens), rng);
        Instance inst;
        inst.input_ids.reserve(a.size() + b.size() + 3);
        inst.input_ids.push_back(vocab.cls_id());
        inst.input_ids.insert(inst.input_ids.end(), a.begin(), a.end());
        inst.input_ids.push_back(vocab.sep_id());
        inst.segment_a_length = static_cast<int32_t>(inst.input_ids.size());
        inst.input_ids.insert(inst.input_ids.end(), b.begin(), b.end());
        inst.input_ids.push_back(vocab.sep_id());
        inst.is_random_next = random_next;
        mask_instance(inst, vocab, replacements, opt, rng);
        out.push_back(std::move(inst));
      }
      chunk.clear();
      chunk_length = 0;
    }
    ++i;
  }
}

}  // namespace

std::vector<Instance> create_instances(const std::vector<Document>& documents, const Vocab& vocab,
                                       const PretrainOptions& options) {
  if (options.max_seq_length < 5 || options.max_seq_length > 32767) {
    throw std::invalid_argument("max_seq_length must be in [5, 32767], got " +
                                std::to_string(options.max_seq_length));
  }
  if (options.max_predictions_per_seq < 1) {
    throw std::invalid_argument("max_predictions_per_seq must be >= 1");
  }
  if (documents.empty()) throw std::invalid_argument("create_instances: no documents");
  std::vector<int32_t> replacements;
  for (int32_t id = 0; id < vocab.size(); ++id) {
    if (!vocab.is_special(id)) replacements.push_back(id);
  }
  if (replacements.empty()) throw std::invalid_argument("create_instances: vocab has no words");
  Rng rng(options.seed);
  std::vector<Document> docs = documents;
  rng.shuffle(docs);
  std::vector<Instance> instances;
  for (int32_t d = 0; d < options.dupe_factor; ++d) {
    for (size_t i = 0; i < docs.size(); ++i) {
      instances_from_document(docs, i, vocab, replacements, options, rng, instances);
    }
  }
  rng.shuffle(instances);
  return instances;
}

// ---- binary file ------------------------------------------------------------------------------

namespace {
constexpr char kMagic[8] = {'S', 'O', 'B', 'E', 'R', 'T', 'P', 'T'};
uint64_t align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }
}  // namespace

void write_pretraining_file(const std::string& path, const std::vector<Instance>& instances,
                            const PretrainOptions& options, const Vocab& vocab, bool lower_case,
                            uint64_t cache_key) {
  const int32_t vocab_size = vocab.size(), pad_id = vocab.pad_id();
  const uint64_t n = instances.size();
  const uint64_t L = static_cast<uint64_t>(options.max_seq_length);
  const uint64_t P = static_cast<uint64_t>(options.max_predictions_per_seq);
  DataHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kDataVersion;
  h.header_bytes = sizeof(DataHeader);
  h.num_instances = n;
  h.max_seq_length = static_cast<uint32_t>(L);
  h.max_predictions = static_cast<uint32_t>(P);
  h.vocab_size = static_cast<uint32_t>(vocab_size);
  h.pad_id = static_cast<uint32_t>(pad_id);
  h.cache_key = cache_key;
  h.vocab_hash = vocab_fingerprint(vocab);
  h.lower_case = lower_case ? 1 : 2;
  h.input_ids_offset = align64(sizeof(DataHeader));
  h.masked_positions_offset = align64(h.input_ids_offset + n * L * 4);
  h.masked_labels_offset = align64(h.masked_positions_offset + n * P * 2);
  h.meta_offset = align64(h.masked_labels_offset + n * P * 4);
  h.file_bytes = h.meta_offset + n * 4 * 2;

  std::vector<int32_t> ids(n * L, pad_id);
  std::vector<int16_t> positions(n * P, 0);
  std::vector<int32_t> labels(n * P, -100);
  std::vector<int16_t> meta(n * 4, 0);
  for (uint64_t i = 0; i < n; ++i) {
    const Instance& inst = instances[i];
    if (inst.input_ids.size() > L || inst.masked_positions.size() > P) {
      throw std::runtime_error("write_pretraining_file: instance exceeds the file's lengths");
    }
    std::copy(inst.input_ids.begin(), inst.input_ids.end(), ids.begin() + i * L);
    for (size_t k = 0; k < inst.masked_positions.size(); ++k) {
      positions[i * P + k] = static_cast<int16_t>(inst.masked_positions[k]);
      labels[i * P + k] = inst.masked_labels[k];
    }
    meta[i * 4 + 0] = static_cast<int16_t>(inst.input_ids.size());
    meta[i * 4 + 1] = static_cast<int16_t>(inst.segment_a_length);
    meta[i * 4 + 2] = static_cast<int16_t>(inst.masked_positions.size());
    meta[i * 4 + 3] = inst.is_random_next ? 1 : 0;
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write '" + tmp + "'");
    auto put = [&](uint64_t offset, const void* data, uint64_t bytes) {
      const auto at = static_cast<uint64_t>(out.tellp());
      if (offset > at) {
        const std::string zeros(offset - at, '\0');
        out.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
      }
      out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    };
    put(0, &h, sizeof(h));
    put(h.input_ids_offset, ids.data(), ids.size() * 4);
    put(h.masked_positions_offset, positions.data(), positions.size() * 2);
    put(h.masked_labels_offset, labels.data(), labels.size() * 4);
    put(h.meta_offset, meta.data(), meta.size() * 2);
    if (!out) throw std::runtime_error("write failed for '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename '" + tmp + "' to '" + path + "'");
  }
}

PretrainingData::PretrainingData(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("pretraining data: cannot open '" + path + "'");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(DataHeader))) {
    ::close(fd);
    throw std::runtime_error("pretraining data: '" + path + "' is too small to be a data file");
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::runtime_error("pretraining data: mmap failed for '" + path + "'");
  }
  const auto* base = static_cast<const char*>(map_);
  header_ = reinterpret_cast<const DataHeader*>(base);
  auto fail = [&](const std::string& what) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw std::runtime_error("pretraining data: '" + path + "' " + what);
  };
  if (std::memcmp(header_->magic, kMagic, sizeof(kMagic)) != 0) fail("has a bad magic");
  if (header_->version != kDataVersion) {
    fail("has version " + std::to_string(header_->version) + ", expected " +
         std::to_string(kDataVersion));
  }
  const std::string problem = check_data_layout(*header_, base, map_bytes_);
  if (!problem.empty()) fail(problem);
  input_ids_ = reinterpret_cast<const int32_t*>(base + header_->input_ids_offset);
  masked_positions_ = reinterpret_cast<const int16_t*>(base + header_->masked_positions_offset);
  masked_labels_ = reinterpret_cast<const int32_t*>(base + header_->masked_labels_offset);
  meta_ = reinterpret_cast<const int16_t*>(base + header_->meta_offset);
  ::madvise(map_, map_bytes_, MADV_RANDOM);
}

PretrainingData::~PretrainingData() {
  if (map_) ::munmap(map_, map_bytes_);
}

Instance PretrainingData::instance(int64_t index) const {
  const uint64_t L = header_->max_seq_length, P = header_->max_predictions;
  const auto i = static_cast<uint64_t>(index);
  const int16_t* m = meta_ + i * 4;
  Instance inst;
  inst.input_ids.assign(input_ids_ + i * L, input_ids_ + i * L + m[0]);
  inst.segment_a_length = m[1];
  inst.masked_positions.assign(masked_positions_ + i * P, masked_positions_ + i * P + m[2]);
  inst.masked_labels.assign(masked_labels_ + i * P, masked_labels_ + i * P + m[2]);
  inst.is_random_next = m[3] != 0;
  return inst;
}

// ---- batches ----------------------------------------------------------------------------------

BatchLoader::BatchLoader(const PretrainingData& data, int64_t rows_per_rank, int rank, int world,
                         uint64_t seed, bool trim)
    : data_(data), rows_per_rank_(rows_per_rank), rank_(rank), world_(world), seed_(seed),
      trim_(trim) {
  if (rows_per_rank < 1 || world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("BatchLoader: need rows_per_rank >= 1 and 0 <= rank < world");
  }
  batches_per_epoch_ = data.size() / (rows_per_rank * world);
  if (batches_per_epoch_ < 1) {
    throw std::invalid_argument("BatchLoader: the data (" + std::to_string(data.size()) +
                                " instances) is smaller than one global batch (" +
                                std::to_string(rows_per_rank * world) + ")");
  }
}

const std::vector<int64_t>& BatchLoader::permutation(int64_t epoch) {
  if (epoch != cached_epoch_) {
    perm_.resize(static_cast<size_t>(data_.size()));
    for (size_t i = 0; i < perm_.size(); ++i) perm_[i] = static_cast<int64_t>(i);
    Rng rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
    rng.shuffle(perm_);
    cached_epoch_ = epoch;
  }
  return perm_;
}

std::vector<int64_t> BatchLoader::rows(int64_t index) {
  const int64_t epoch = index / batches_per_epoch_;
  const int64_t g = index % batches_per_epoch_;
  const auto& perm = permutation(epoch);
  const int64_t first = g * rows_per_rank_ * world_ + rank_ * rows_per_rank_;
  return std::vector<int64_t>(perm.begin() + first, perm.begin() + first + rows_per_rank_);
}

Batch BatchLoader::batch(int64_t index) { return data_.batch(rows(index), trim_); }

Batch PretrainingData::batch(const std::vector<int64_t>& picked, bool trim) const {
  const DataHeader& h = *header_;
  const int64_t L = h.max_seq_length, P = h.max_predictions;
  Batch b;
  b.rows = static_cast<int64_t>(picked.size());
  b.max_predictions = P;
  int64_t len = trim ? 0 : L;
  for (int64_t r : picked) len = std::max<int64_t>(len, meta_[r * 4]);
  b.seq_length = len;
  b.input_ids.assign(static_cast<size_t>(b.rows * len), h.pad_id);
  b.token_type_ids.assign(static_cast<size_t>(b.rows * len), 0);
  b.attention_mask.assign(static_cast<size_t>(b.rows * len), 0);
  b.masked_positions.assign(static_cast<size_t>(b.rows * P), 0);
  b.masked_labels.assign(static_cast<size_t>(b.rows * P), -100);
  b.nsp_labels.assign(static_cast<size_t>(b.rows), 0);
  for (int64_t i = 0; i < b.rows; ++i) {
    const int64_t r = picked[static_cast<size_t>(i)];
    const int16_t* m = meta_ + r * 4;
    const int32_t* ids = input_ids_ + r * L;
    for (int64_t t = 0; t < m[0]; ++t) {
      b.input_ids[i * len + t] = ids[t];
      b.token_type_ids[i * len + t] = t < m[1] ? 0 : 1;
      b.attention_mask[i * len + t] = 1;
    }
    for (int64_t k = 0; k < m[2]; ++k) {
      b.masked_positions[i * P + k] = masked_positions_[r * P + k];
      b.masked_labels[i * P + k] = masked_labels_[r * P + k];
    }
    b.nsp_labels[i] = m[3];
    b.num_tokens += m[0];
    b.num_masked += m[2];
  }
  return b;
}

int64_t PretrainingData::random_next_count() const {
  int64_t n = 0;
  for (int64_t i = 0; i < size(); ++i) n += meta_[i * 4 + 3] != 0;
  return n;
}

Batch synthetic_batch(int64_t rows, int64_t seq_length, int64_t vocab_size, double mask_prob,
                      int64_t mask_id, uint64_t seed, int64_t index, int rank) {
  if (rows <= 0 || seq_length <= 0 || vocab_size <= 0) {
    throw std::invalid_argument("synthetic_batch: rows, seq_length and vocab_size must be > 0");
  }
  const uint64_t parts[3] = {seed, static_cast<uint64_t>(index), static_cast<uint64_t>(rank)};
  Rng rng(fnv1a(parts, sizeof(parts)));
  Batch b;
  b.rows = rows;
  b.seq_length = seq_length;
  b.max_predictions = seq_length;  // any position may be masked
  const auto n = static_cast<size_t>(rows * seq_length);
  b.input_ids.resize(n);
  b.token_type_ids.assign(n, 0);
  b.attention_mask.assign(n, 1);
  b.masked_positions.assign(n, 0);
  b.masked_labels.assign(n, -100);
  b.nsp_labels.assign(static_cast<size_t>(rows), 0);
  for (int64_t i = 0; i < rows; ++i) {
    int64_t k = 0;
    for (int64_t t = 0; t < seq_length; ++t) {
      const int64_t id = rng.randint(0, vocab_size - 1);
      const bool masked = rng.uniform() < mask_prob;
      b.input_ids[i * seq_length + t] = masked ? mask_id : id;
      if (masked) {
        b.masked_positions[i * seq_length + k] = t;
        b.masked_labels[i * seq_length + k] = id;
        ++k;
      }
    }
    b.num_masked += k;
  }
  b.num_tokens = rows * seq_length;
  return b;
}

}  // namespace bert
