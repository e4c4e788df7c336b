// BERT's tokenizer (BasicTokenizer + WordPiece) and a WordPiece vocabulary learner. Torch-free.
// Invariant: ids are line numbers of vocab.txt; the five special tokens always exist.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace bert {

inline constexpr const char* kPad = "[PAD]";
inline constexpr const char* kUnk = "[UNK]";
inline constexpr const char* kCls = "[CLS]";
inline constexpr const char* kSep = "[SEP]";
inline constexpr const char* kMask = "[MASK]";

// A WordPiece vocabulary: token text <-> id (the line number in vocab.txt).
class Vocab {
 public:
  Vocab() = default;
  explicit Vocab(std::vector<std::string> tokens);
  // One token per line (trailing '\r' and whitespace trimmed); throws std::runtime_error naming
  // the file when it cannot be read or lacks one of [PAD] [UNK] [CLS] [SEP] [MASK].
  static Vocab load(const std::string& path);
  // The same from the file's text; `source` names it in errors (tests/fuzz/vocab_fuzz.cpp).
  static Vocab parse(std::string_view text, const std::string& source);
  // Writes one token per line via tmp + rename.
  void save(const std::string& path) const;

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  const std::string& token(int32_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  // -1 when absent.
  int32_t find(std::string_view token) const;
  bool contains(std::string_view token) const { return find(token) >= 0; }
  const std::vector<std::string>& tokens() const { return tokens_; }

  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t mask_id() const { return mask_id_; }
  // True for tokens written "[...]" (the specials and any [unusedN]).
  bool is_special(int32_t id) const { return special_.at(static_cast<size_t>(id)) != 0; }
  // True for "##" continuation pieces (whole-word masking).
  bool is_continuation(int32_t id) const { return continuation_.at(static_cast<size_t>(id)) != 0; }
  // The vocabulary's case convention: true when a non-special token has an upper-case letter
  // (BERT's cased vocab.txt has "The"; an uncased one has none).
  bool is_cased() const;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<char> special_, continuation_;
  int32_t pad_id_ = -1, unk_id_ = -1, cls_id_ = -1, sep_id_ = -1, mask_id_ = -1;
};

// BERT's BasicTokenizer (tokenization.py), with Unicode properties from utf8proc: drops control
// characters (C*), splits on whitespace, puts every CJK ideograph in its own token, and, when
// `lower_case` (BERT's do_lower_case), lower-cases and strips accents (NFD, then every Mn mark
// dropped); then splits punctuation (P*, and all ASCII symbols) into single-character tokens.
std::vector<std::string> basic_tokenize(std::string_view text, bool lower_case = true);

// Greedy longest-match-first WordPiece over a basic-tokenized text; words longer than
// `max_chars_per_word` characters, or with no segmentation, become [UNK].
class Tokenizer {
 public:
  explicit Tokenizer(Vocab vocab, bool lower_case = true, int max_chars_per_word = 100);
  const Vocab& vocab() const { return vocab_; }
  bool lower_case() const { return lower_case_; }

  std::vector<std::string> tokenize(std::string_view text) const;
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends the pieces of one basic token.
  void wordpiece(const std::string& word, std::vector<int32_t>& out) const;

 private:
  Vocab vocab_;
  bool lower_case_;
  int max_chars_per_word_;
};

struct VocabBuildOptions {
  int32_t vocab_size = 8000;
  bool lower_case = true;
  // Characters seen fewer times than this are left to [UNK] (unless the vocabulary has room).
  int64_t min_char_count = 1;
};

// Learns a WordPiece vocabulary from raw text by BPE-style merges over basic tokens: the five
// specials first, then every character (initial and "##" forms, most frequent first), then merged
// pieces in merge order (whole words and "##" pieces). Deterministic: ties go to the pair with the
// smaller ids. Stops early when no pair occurs twice.
Vocab build_vocab(const std::vector<std::string>& texts, const VocabBuildOptions& options);

// UTF-8 helpers (exposed for tests). Invalid bytes decode as U+FFFD.
std::vector<char32_t> utf8_decode(std::string_view text);
void utf8_append(std::string& out, char32_t cp);

}  // namespace bert
