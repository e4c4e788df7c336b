// BERT BasicTokenizer + WordPiece, and the BPE-style WordPiece vocabulary learner. Torch-free.
#include "tokenizer.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <unordered_set>

#include <utf8proc.h>

namespace bert {

// ---- UTF-8 and Unicode properties (utf8proc) ------------------------------------------------

std::vector<char32_t> utf8_decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t i = 0;
  const auto n = static_cast<utf8proc_ssize_t>(s.size());
  while (i < n) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t len = utf8proc_iterate(p + i, n - i, &cp);
    if (len <= 0) {  // an invalid byte: one U+FFFD, then resynchronise at the next byte
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(static_cast<char32_t>(cp));
    i += len;
  }
  return out;
}

void utf8_append(std::string& out, char32_t cp) {
  utf8proc_uint8_t buf[4];
  const auto len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
}

namespace {

bool in(char32_t cp, char32_t lo, char32_t hi) { return cp >= lo && cp <= hi; }

utf8proc_category_t category(char32_t cp) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(cp));
}

// The character classes of BERT's tokenization.py, from the Unicode general category.
// _is_whitespace: space, \t, \n, \r and Zs; also Zl and Zp, on which whitespace_tokenize's
// str.split() splits after _clean_text kept them.
bool is_whitespace(char32_t cp) {
  if (cp == ' ' || cp == '\t' || cp == '\n' || cp == '\r') return true;
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

// _is_control: C* (Cc, Cf, Cs, Co, Cn) except \t, \n, \r.
bool is_control(char32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  switch (category(cp)) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO: case UTF8PROC_CATEGORY_CN:
      return true;
    default:
      return false;
  }
}

// _is_punctuation: every ASCII non-alphanumeric printable character ($, +, ^ ... are not P* in
// Unicode), and P*.
bool is_punctuation(char32_t cp) {
  if (in(cp, 33, 47) || in(cp, 58, 64) || in(cp, 91, 96) || in(cp, 123, 126)) return true;
  const auto c = category(cp);
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

// _is_chinese_char: BERT's list of CJK Unified Ideographs blocks (not Hiragana/Katakana/Hangul).
bool is_cjk(char32_t cp) {
  return in(cp, 0x4E00, 0x9FFF) || in(cp, 0x3400, 0x4DBF) || in(cp, 0x20000, 0x2A6DF) ||
         in(cp, 0x2A700, 0x2B73F) || in(cp, 0x2B740, 0x2B81F) || in(cp, 0x2B820, 0x2CEAF) ||
         in(cp, 0xF900, 0xFAFF) || in(cp, 0x2F800, 0x2FA1F);
}

// token.lower() then _run_strip_accents: NFD, then every Mn (nonspacing mark) dropped. Python's
// full lower-casing differs from the simple mapping only where the difference is an Mn (U+0130
// -> "i" + U+0307), which is stripped here anyway.
void lower_and_strip_accents(char32_t cp, std::string& out) {
  const auto lower = utf8proc_tolower(static_cast<utf8proc_int32_t>(cp));
  utf8proc_int32_t nfd[8];
  int boundclass = 0;
  const auto n = utf8proc_decompose_char(lower, nfd, 8, UTF8PROC_DECOMPOSE, &boundclass);
  if (n <= 0 || n > 8) {
    utf8_append(out, static_cast<char32_t>(lower));
    return;
  }
  for (utf8proc_ssize_t k = 0; k < n; ++k) {
    if (utf8proc_category(nfd[k]) != UTF8PROC_CATEGORY_MN) {
      utf8_append(out, static_cast<char32_t>(nfd[k]));
    }
  }
}

}  // namespace

std::vector<std::string> basic_tokenize(std::string_view text, bool lower_case) {
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    if (!cur.empty()) out.push_back(std::move(cur));
    cur.clear();
  };
  auto single = [&](char32_t cp) {
    flush();
    std::string t;
    utf8_append(t, cp);
    out.push_back(std::move(t));
  };
  // BERT's order: clean, isolate CJK, split on whitespace, lower-case and strip accents, then
  // split on punctuation (an accent-stripped character is tested as punctuation).
  std::string folded;
  for (char32_t cp : utf8_decode(text)) {
    if (cp == 0 || cp == 0xFFFD || is_control(cp)) continue;
    if (is_whitespace(cp)) {
      flush();
      continue;
    }
    if (is_cjk(cp)) {
      flush();
      std::string t;
      if (lower_case) lower_and_strip_accents(cp, t);  // compatibility ideographs have an NFD
      else utf8_append(t, cp);
      out.push_back(std::move(t));
      continue;
    }
    if (!lower_case) {
      if (is_punctuation(cp)) single(cp);
      else utf8_append(cur, cp);
      continue;
    }
    folded.clear();
    lower_and_strip_accents(cp, folded);
    for (char32_t f : utf8_decode(folded)) {
      if (is_punctuation(f)) single(f);
      else utf8_append(cur, f);
    }
  }
  flush();
  return out;
}

// ---- Vocab ------------------------------------------------------------------------------------

Vocab::Vocab(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {
  ids_.reserve(tokens_.size() * 2);
  special_.resize(tokens_.size());
  continuation_.resize(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const std::string& t = tokens_[i];
    ids_.emplace(t, static_cast<int32_t>(i));  // the first occurrence wins, as in BERT
    special_[i] = t.size() >= 2 && t.front() == '[' && t.back() == ']';
    continuation_[i] = t.size() > 2 && t.compare(0, 2, "##") == 0;
  }
  pad_id_ = find(kPad);
  unk_id_ = find(kUnk);
  cls_id_ = find(kCls);
  sep_id_ = find(kSep);
  mask_id_ = find(kMask);
  for (const char* s : {kPad, kUnk, kCls, kSep, kMask}) {
    if (find(s) < 0) throw std::runtime_error(std::string("vocab: missing special token ") + s);
  }
}

bool Vocab::is_cased() const {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (special_[i]) continue;
    for (char32_t cp : utf8_decode(tokens_[i])) {
      if (utf8proc_isupper(static_cast<utf8proc_int32_t>(cp))) return true;
    }
  }
  return false;
}

int32_t Vocab::find(std::string_view token) const {
  auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
}

Vocab Vocab::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("vocab: cannot read '" + path + "'");
  return parse(std::string(std::istreambuf_iterator<char>(in), {}), path);
}

Vocab Vocab::parse(std::string_view text, const std::string& source) {
  std::vector<std::string> tokens;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    std::string line(text.substr(0, end));
    text.remove_prefix(std::min(end + 1, text.size()));
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) {
      line.pop_back();
    }
    tokens.push_back(std::move(line));
  }
  while (!tokens.empty() && tokens.back().empty()) tokens.pop_back();
  try {
    return Vocab(std::move(tokens));
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + " in '" + source + "'");
  }
}

void Vocab::save(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("vocab: cannot write '" + tmp + "'");
    for (const auto& t : tokens_) out << t << '\n';
    if (!out) throw std::runtime_error("vocab: write failed for '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("vocab: cannot rename '" + tmp + "' to '" + path + "'");
  }
}

// ---- WordPiece --------------------------------------------------------------------------------

Tokenizer::Tokenizer(Vocab vocab, bool lower_case, int max_chars_per_word)
    : vocab_(std::move(vocab)), lower_case_(lower_case), max_chars_per_word_(max_chars_per_word) {}

void Tokenizer::wordpiece(const std::string& word, std::vector<int32_t>& out) const {
  // Byte offset of every character start (UTF-8 lead bytes), plus the end.
  std::vector<size_t> offs;
  offs.reserve(word.size() + 1);
  for (size_t i = 0; i < word.size(); ++i) {
    if ((static_cast<unsigned char>(word[i]) & 0xC0) != 0x80) offs.push_back(i);
  }
  const size_t nchars = offs.size();
  offs.push_back(word.size());
  if (nchars > static_cast<size_t>(max_chars_per_word_)) {
    out.push_back(vocab_.unk_id());
    return;
  }
  const size_t mark = out.size();
  std::string piece;
  size_t start = 0;
  while (start < nchars) {
    size_t end = nchars;
    int32_t found = -1;
    while (start < end) {
      piece.assign(start > 0 ? "##" : "");
      piece.append(word, offs[start], offs[end] - offs[start]);
      found = vocab_.find(piece);
      if (found >= 0) break;
      --end;
    }
    if (found < 0) {
      out.resize(mark);
      out.push_back(vocab_.unk_id());
      return;
    }
    out.push_back(found);
    start = end;
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  for (const auto& word : basic_tokenize(text, lower_case_)) wordpiece(word, ids);
  return ids;
}

std::vector<std::string> Tokenizer::tokenize(std::string_view text) const {
  std::vector<std::string> out;
  for (int32_t id : encode(text)) out.push_back(vocab_.token(id));
  return out;
}

// ---- vocabulary learning ----------------------------------------------------------------------

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct Word {
  std::vector<int32_t> symbols;
  int64_t count = 0;
  int64_t last_merge = -1;  // the merge that last rewrote it (dedupes the pair index)
};

}  // namespace

Vocab build_vocab(const std::vector<std::string>& texts, const VocabBuildOptions& options) {
  const std::vector<std::string> specials = {kPad, kUnk, kCls, kSep, kMask};
  if (options.vocab_size < static_cast<int32_t>(specials.size()) + 1) {
    throw std::runtime_error("build_vocab: vocab_size must be > 5, got " +
                             std::to_string(options.vocab_size));
  }
  // 1. Count basic tokens (words), then characters weighted by word counts.
  std::unordered_map<std::string, int64_t> word_counts;
  for (const auto& text : texts) {
    for (auto& w : basic_tokenize(text, options.lower_case)) ++word_counts[std::move(w)];
  }
  std::vector<std::pair<std::string, int64_t>> sorted_words(word_counts.begin(), word_counts.end());
  std::sort(sorted_words.begin(), sorted_words.end());  // determinism: fixed word order

  std::map<char32_t, int64_t> char_counts;
  std::vector<std::vector<char32_t>> word_chars;
  word_chars.reserve(sorted_words.size());
  for (const auto& [w, c] : sorted_words) {
    word_chars.push_back(utf8_decode(w));
    for (char32_t cp : word_chars.back()) char_counts[cp] += c;
  }
  // 2. Characters: most frequent first; both the initial and the "##" form of each.
  std::vector<std::pair<int64_t, char32_t>> chars;
  for (const auto& [cp, c] : char_counts) {
    if (c >= options.min_char_count) chars.emplace_back(-c, cp);
  }
  std::sort(chars.begin(), chars.end());
  const size_t room = static_cast<size_t>(options.vocab_size) - specials.size();
  if (chars.size() * 2 > room) chars.resize(room / 2);

  std::vector<std::string> symbols;  // symbol id -> text
  std::unordered_map<std::string, int32_t> symbol_ids;
  auto intern = [&](const std::string& s) {
    auto [it, inserted] = symbol_ids.emplace(s, static_cast<int32_t>(symbols.size()));
    if (inserted) symbols.push_back(s);
    return it->second;
  };
  std::vector<std::string> vocab = specials;
  std::unordered_map<char32_t, std::pair<int32_t, int32_t>> char_symbol;  // initial, ##
  for (const auto& [negc, cp] : chars) {
    std::string s;
    utf8_append(s, cp);
    char_symbol[cp].first = intern(s);
    vocab.push_back(s);
  }
  for (const auto& [negc, cp] : chars) {
    std::string s = "##";
    utf8_append(s, cp);
    char_symbol[cp].second = intern(s);
    vocab.push_back(s);
  }

  // 3. Words as symbol sequences (words with a dropped character, or too long, are left out).
  std::vector<Word> words;
  for (size_t i = 0; i < sorted_words.size(); ++i) {
    const auto& cps = word_chars[i];
    if (cps.size() > 100) continue;
    Word w;
    w.count = sorted_words[i].second;
    bool ok = true;
    for (size_t k = 0; k < cps.size() && ok; ++k) {
      auto it = char_symbol.find(cps[k]);
      if (it == char_symbol.end()) ok = false;
      else w.symbols.push_back(k == 0 ? it->second.first : it->second.second);
    }
    if (ok && w.symbols.size() >= 2) words.push_back(std::move(w));
  }

  // 4. BPE merges: the most frequent adjacent pair becomes a new symbol, until the size is reached.
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  for (size_t wi = 0; wi < words.size(); ++wi) {
    const auto& s = words[wi].symbols;
    for (size_t k = 0; k + 1 < s.size(); ++k) {
      const uint64_t key = pair_key(s[k], s[k + 1]);
      pair_counts[key] += words[wi].count;
      pair_words[key].push_back(static_cast<int32_t>(wi));
    }
  }
  // Max-heap on count; equal counts: the smaller key (older symbols) first.
  using Entry = std::pair<int64_t, uint64_t>;
  auto cmp = [](const Entry& x, const Entry& y) {
    return x.first != y.first ? x.first < y.first : x.second > y.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> heap(cmp);
  for (const auto& [key, c] : pair_counts) heap.emplace(c, key);

  std::unordered_set<std::string> in_vocab(vocab.begin(), vocab.end());
  int64_t merge = 0;
  std::unordered_map<uint64_t, int64_t> delta;
  while (static_cast<int32_t>(vocab.size()) < options.vocab_size && !heap.empty()) {
    const auto [count, key] = heap.top();
    heap.pop();
    auto pc = pair_counts.find(key);
    if (pc == pair_counts.end() || pc->second != count) continue;  // stale entry
    if (count < 2) break;
    const auto a = static_cast<int32_t>(key >> 32);
    const auto b = static_cast<int32_t>(key & 0xFFFFFFFFu);
    const std::string merged = symbols[a] + symbols[b].substr(2);  // b is always a "##" piece
    const int32_t c = intern(merged);
    if (in_vocab.insert(merged).second) vocab.push_back(merged);

    delta.clear();
    std::vector<int32_t> affected;
    affected.swap(pair_words[key]);
    for (int32_t wi : affected) {
      Word& w = words[wi];
      if (w.last_merge == merge) continue;
      w.last_merge = merge;
      auto& s = w.symbols;
      bool has = false;
      for (size_t k = 0; k + 1 < s.size() && !has; ++k) has = s[k] == a && s[k + 1] == b;
      if (!has) continue;
      for (size_t k = 0; k + 1 < s.size(); ++k) delta[pair_key(s[k], s[k + 1])] -= w.count;
      std::vector<int32_t> next;
      next.reserve(s.size());
      for (size_t k = 0; k < s.size(); ++k) {
        if (k + 1 < s.size() && s[k] == a && s[k + 1] == b) {
          next.push_back(c);
          ++k;
        } else {
          next.push_back(s[k]);
        }
      }
      s.swap(next);
      for (size_t k = 0; k + 1 < s.size(); ++k) {
        const uint64_t nk = pair_key(s[k], s[k + 1]);
        delta[nk] += w.count;
        if (s[k] == c || s[k + 1] == c) pair_words[nk].push_back(wi);
      }
    }
    // Apply in key order so that heap pushes (and thus ties) do not depend on hash order.
    std::vector<std::pair<uint64_t, int64_t>> changes(delta.begin(), delta.end());
    std::sort(changes.begin(), changes.end());
    for (const auto& [k, d] : changes) {
      if (d == 0) continue;
      int64_t& v = pair_counts[k];
      v += d;
      if (v <= 0) pair_counts.erase(k);
      else heap.emplace(v, k);
    }
    pair_counts.erase(key);
    ++merge;
  }
  return Vocab(std::move(vocab));
}

}  // namespace bert
