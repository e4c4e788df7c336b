// BERT pretraining data, as Google's create_pretraining_data.py makes it: corpus -> documents of
// tokenized sentences -> [CLS] A [SEP] B [SEP] instances with masked-LM and next-sentence labels,
// written once to a binary file that is memory-mapped for training. Torch-free.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tokenizer.hpp"

namespace bert {

// mt19937_64 with portable draws (std's distributions differ between standard libraries).
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  uint64_t next() { return engine_(); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  // Uniform integer in [lo, hi] (inclusive, like Python's randint), by rejection.
  int64_t randint(int64_t lo, int64_t hi);
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) {
      std::swap(v[i - 1], v[static_cast<size_t>(randint(0, static_cast<int64_t>(i) - 1))]);
    }
  }

 private:
  std::mt19937_64 engine_;
};

// A document is a list of sentences, each a list of token ids.
using Document = std::vector<std::vector<int32_t>>;

enum class CorpusFormat {
  Auto,       // Sentences when most lines end a sentence, else Prose (decided per file)
  Sentences,  // one sentence per line, blank lines between documents (BERT's format)
  Prose,      // each file is a document; sentences split on . ? ! + space and blank lines
  Man,        // each file is a man page (roff, .gz or not) -> Prose (Auto detects them too)
};
CorpusFormat parse_corpus_format(const std::string& text);

std::string read_file(const std::string& path);
// Splits one file's text into documents of sentence strings (empty ones dropped).
std::vector<std::vector<std::string>> split_documents(const std::string& text, CorpusFormat format);
// Tokenizes every sentence; sentences with no tokens and documents with none are dropped.
std::vector<Document> load_documents(const std::vector<std::string>& files,
                                     const Tokenizer& tokenizer, CorpusFormat format);

struct PretrainOptions {
  int32_t max_seq_length = 128;
  int32_t max_predictions_per_seq = 20;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  int32_t dupe_factor = 10;
  bool whole_word_mask = false;
  uint64_t seed = 12345;
};

// One training example. input_ids already has masked tokens replaced; masked_positions are sorted.
struct Instance {
  std::vector<int32_t> input_ids;       // [CLS] A [SEP] B [SEP], no padding
  int32_t segment_a_length = 0;         // tokens with segment 0: [CLS] A [SEP]
  std::vector<int32_t> masked_positions;
  std::vector<int32_t> masked_labels;   // original ids at masked_positions
  bool is_random_next = false;          // the NSP label (1 = B is random)
};

// Google's create_instances_from_document + create_masked_lm_predictions, over all documents,
// dupe_factor times, then shuffled; deterministic for options.seed. Replacement tokens of the
// 10% "random" case are drawn from the non-special vocabulary.
std::vector<Instance> create_instances(const std::vector<Document>& documents, const Vocab& vocab,
                                       const PretrainOptions& options);

// File layout (little endian), every array 64-byte aligned, N instances, L = max_seq_length,
// P = max_predictions_per_seq:
//   Header (128 bytes)
//   int32 input_ids[N][L]        padded with [PAD]
//   int16 masked_positions[N][P] padded with 0
//   int32 masked_labels[N][P]    padded with -100
//   int16 meta[N][4]             seq_length, segment_a_length, num_masked, is_random_next
struct DataHeader {
  char magic[8];  // "SOBERTPT"
  uint32_t version;
  uint32_t header_bytes;
  uint64_t num_instances;
  uint32_t max_seq_length;
  uint32_t max_predictions;
  uint32_t vocab_size;
  uint32_t pad_id;
  uint64_t cache_key;  // whatever the writer identified its inputs with (corpus + options)
  uint64_t input_ids_offset;
  uint64_t masked_positions_offset;
  uint64_t masked_labels_offset;
  uint64_t meta_offset;
  uint64_t file_bytes;
  uint64_t vocab_hash;  // Vocab::fingerprint() of the vocabulary it was made with; 0: unknown
  uint32_t lower_case;  // 1: lower-cased text, 2: cased, 0: unknown
  char reserved[128 - 100];
};
static_assert(sizeof(DataHeader) == 128, "DataHeader is 128 bytes");
inline constexpr uint32_t kDataVersion = 1;

// What is wrong with a data file's header and instance lengths ("" if nothing): sections that
// overlap, are misaligned or reach past `file_bytes` (no count wraps around), lengths outside a
// row. `base` is the whole file (data_check.cpp).
std::string check_data_layout(const DataHeader& h, const char* base, uint64_t file_bytes);

// Writes `instances` via tmp + rename. Throws std::runtime_error on I/O errors.
void write_pretraining_file(const std::string& path, const std::vector<Instance>& instances,
                            const PretrainOptions& options, const Vocab& vocab, bool lower_case,
                            uint64_t cache_key);

// A batch in plain arrays ([rows][seq_length] row-major), ready for torch::from_blob.
struct Batch {
  int64_t rows = 0;
  int64_t seq_length = 0;      // trimmed to the longest row when the loader trims
  int64_t max_predictions = 0;
  std::vector<int64_t> input_ids, token_type_ids, attention_mask;  // [rows][seq_length]
  std::vector<int64_t> masked_positions;                           // [rows][max_predictions]
  std::vector<int64_t> masked_labels;                              // -100 where padded
  std::vector<int64_t> nsp_labels;                                 // [rows]
  int64_t num_tokens = 0;      // non-padding tokens
  int64_t num_masked = 0;
};

// Read-only view of a pretraining file (mmap), plus this rank's batches.
//
// Global batch g of epoch e is rows [g*B*W, (g+1)*B*W) of that epoch's permutation (B = rows
// per rank, W = world); rank r takes [g*B*W + r*B, g*B*W + (r+1)*B). The permutation is a
// Fisher-Yates shuffle seeded by (seed, e), so every rank computes the same one.
class PretrainingData {
 public:
  // Throws std::runtime_error naming the file on a bad magic/version/size.
  explicit PretrainingData(const std::string& path);
  ~PretrainingData();
  PretrainingData(const PretrainingData&) = delete;
  PretrainingData& operator=(const PretrainingData&) = delete;

  const DataHeader& header() const { return *header_; }
  int64_t size() const { return static_cast<int64_t>(header_->num_instances); }
  Instance instance(int64_t index) const;
  // The instances `rows` as a batch; `trim`: to the longest of them, else max_seq_length.
  Batch batch(const std::vector<int64_t>& rows, bool trim = true) const;
  // Instances whose B segment is a random one (NSP label 1).
  int64_t random_next_count() const;

 private:
  friend class BatchLoader;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const DataHeader* header_ = nullptr;
  const int32_t* input_ids_ = nullptr;
  const int16_t* masked_positions_ = nullptr;
  const int32_t* masked_labels_ = nullptr;
  const int16_t* meta_ = nullptr;
};

class BatchLoader {
 public:
  BatchLoader(const PretrainingData& data, int64_t rows_per_rank, int rank, int world,
              uint64_t seed, bool trim = true);
  // Global batches per epoch (the remainder of an epoch is dropped).
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // This rank's part of global batch `index` (0, 1, 2, ... across epochs). Stateless apart from
  // caching the current epoch's permutation, so resuming at any index reproduces the stream.
  Batch batch(int64_t index);
  // Dataset rows of this rank's part of global batch `index` (for tests).
  std::vector<int64_t> rows(int64_t index);

 private:
  const std::vector<int64_t>& permutation(int64_t epoch);
  const PretrainingData& data_;
  int64_t rows_per_rank_;
  int rank_, world_;
  uint64_t seed_;
  bool trim_;
  int64_t batches_per_epoch_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

// A batch of uniformly random tokens in [0, vocab_size) for benchmarks, as the peer baseline
// (bench/peers/baseline/torch_zero_bert.py) makes them: every row full length, one segment, each
// position masked with probability mask_prob (input := mask_id, label := the original token), no
// next-sentence task (labels 0). Deterministic in (seed, index, rank).
Batch synthetic_batch(int64_t rows, int64_t seq_length, int64_t vocab_size, double mask_prob,
                      int64_t mask_id, uint64_t seed, int64_t index, int rank);

// FNV-1a 64, for cache keys.
uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash = 1469598103934665603ull);
// Identifies a vocabulary (its tokens in order): stored in data files, checked against --vocab.
uint64_t vocab_fingerprint(const Vocab& vocab);

}  // namespace bert
