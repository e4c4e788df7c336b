// BERT BasicTokenizer + WordPiece, and the BPE-style WordPiece vocabulary learner. Torch-free.
#include "tokenizer.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <unordered_set>

namespace bert {

// ---- UTF-8 ------------------------------------------------------------------------------------

std::vector<char32_t> utf8_decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = 0;
    char32_t cp = 0;
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      len = 2, cp = c & 0x1F;
    } else if ((c >> 4) == 0xE) {
      len = 3, cp = c & 0x0F;
    } else if ((c >> 3) == 0x1E) {
      len = 4, cp = c & 0x07;
    } else {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    bool ok = i + len <= n;
    for (int k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// ---- character classes (the subsets of Unicode categories BERT's tokenizer asks about) ----------

namespace {

bool in(char32_t cp, char32_t lo, char32_t hi) { return cp >= lo && cp <= hi; }

// Zs plus the ASCII whitespace BERT treats as such.
bool is_whitespace(char32_t cp) {
  return cp == ' ' || cp == '\t' || cp == '\n' || cp == '\r' || cp == 0xA0 || cp == 0x1680 ||
         in(cp, 0x2000, 0x200A) || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Cc and Cf, except the whitespace controls.
bool is_control(char32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  return cp < 0x20 || in(cp, 0x7F, 0x9F) || cp == 0xAD || in(cp, 0x600, 0x605) || cp == 0x61C ||
         cp == 0x6DD || cp == 0x70F || in(cp, 0x200B, 0x200F) || in(cp, 0x202A, 0x202E) ||
         in(cp, 0x2060, 0x2064) || in(cp, 0x2066, 0x206F) || cp == 0xFEFF ||
         in(cp, 0xFFF9, 0xFFFB);
}

// All ASCII non-alphanumeric printable characters (as BERT), plus the P* code points of the
// Latin-1, General Punctuation, CJK Symbols and full-width blocks.
bool is_punctuation(char32_t cp) {
  if (in(cp, 33, 47) || in(cp, 58, 64) || in(cp, 91, 96) || in(cp, 123, 126)) return true;
  if (cp < 0x80) return false;
  return cp == 0xA1 || cp == 0xA7 || cp == 0xAB || cp == 0xB6 || cp == 0xB7 || cp == 0xBB ||
         cp == 0xBF || cp == 0x37E || cp == 0x387 || in(cp, 0x55A, 0x55F) || cp == 0x589 ||
         in(cp, 0x2010, 0x2027) || in(cp, 0x2030, 0x2043) || in(cp, 0x2045, 0x2051) ||
         in(cp, 0x2053, 0x205E) || in(cp, 0x2E00, 0x2E4F) || in(cp, 0x3001, 0x3003) ||
         in(cp, 0x3008, 0x3011) || in(cp, 0x3014, 0x301F) || cp == 0x3030 || cp == 0x303D ||
         cp == 0x30A0 || cp == 0x30FB || in(cp, 0xFE10, 0xFE19) || in(cp, 0xFE30, 0xFE52) ||
         in(cp, 0xFE54, 0xFE61) || in(cp, 0xFF01, 0xFF03) || in(cp, 0xFF05, 0xFF0A) ||
         in(cp, 0xFF0C, 0xFF0F) || cp == 0xFF1A || cp == 0xFF1B || cp == 0xFF1F || cp == 0xFF20 ||
         in(cp, 0xFF3B, 0xFF3D) || cp == 0xFF3F || cp == 0xFF5B || cp == 0xFF5D ||
         in(cp, 0xFF5F, 0xFF65);
}

// The CJK Unified Ideographs blocks of BERT's _is_chinese_char (not Hiragana/Katakana/Hangul).
bool is_cjk(char32_t cp) {
  return in(cp, 0x4E00, 0x9FFF) || in(cp, 0x3400, 0x4DBF) || in(cp, 0x20000, 0x2A6DF) ||
         in(cp, 0x2A700, 0x2B73F) || in(cp, 0x2B740, 0x2B81F) || in(cp, 0x2B820, 0x2CEAF) ||
         in(cp, 0xF900, 0xFAFF) || in(cp, 0x2F800, 0x2FA1F);
}

// Simple lower-casing: ASCII, Latin-1, Latin Extended-A, basic Greek and Cyrillic.
char32_t to_lower(char32_t cp) {
  if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
  if (in(cp, 0xC0, 0xDE) && cp != 0xD7) return cp + 32;
  if (in(cp, 0x100, 0x17F)) {
    if (cp == 0x130) return 'i';  // İ -> i + U+0307 in Unicode; the dot is stripped anyway
    if (cp == 0x178) return 0xFF;
    if (in(cp, 0x139, 0x148) || in(cp, 0x179, 0x17E)) return (cp % 2 == 1) ? cp + 1 : cp;
    if (in(cp, 0x131, 0x138) || cp == 0x149 || cp == 0x17F) return cp;
    return (cp % 2 == 0) ? cp + 1 : cp;
  }
  if (in(cp, 0x391, 0x3A9) && cp != 0x3A2) return cp + 32;
  if (in(cp, 0x410, 0x42F)) return cp + 32;
  if (in(cp, 0x400, 0x40F)) return cp + 80;
  return cp;
}

// NFD of U+00C0..U+017F reduced to the base letter ('-': no canonical decomposition). Stripping
// accents = this base letter, and dropping combining marks U+0300-U+036F.
constexpr const char* kNfdBase =
    "AAAAAA-CEEEEIIII"   // C0
    "-NOOOOO--UUUUY--"   // D0
    "aaaaaa-ceeeeiiii"   // E0
    "-nooooo--uuuuy-y"   // F0
    "AaAaAaCcCcCcCcDd"   // 100
    "--EeEeEeEeEeGgGg"   // 110
    "GgGgHh--IiIiIiIi"   // 120
    "I---JjKk-LlLlLl-"   // 130
    "---NnNnNn---OoOo"   // 140
    "Oo--RrRrRrSsSsSs"   // 150
    "SsTtTt--UuUuUuUu"   // 160
    "UuUuWwYyYZzZzZz-";  // 170

bool is_combining_mark(char32_t cp) { return in(cp, 0x300, 0x36F); }

char32_t strip_accent(char32_t cp) {
  if (in(cp, 0xC0, 0x17F)) {
    const char base = kNfdBase[cp - 0xC0];
    if (base != '-') return static_cast<char32_t>(base);
  }
  return cp;
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
  for (char32_t cp : utf8_decode(text)) {
    if (cp == 0 || cp == 0xFFFD || is_control(cp)) continue;
    if (is_whitespace(cp)) {
      flush();
      continue;
    }
    if (is_cjk(cp)) {
      single(cp);
      continue;
    }
    if (lower_case) {
      cp = strip_accent(to_lower(cp));
      if (is_combining_mark(cp)) continue;
    }
    if (is_punctuation(cp)) {
      single(cp);
      continue;
    }
    utf8_append(cur, cp);
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

int32_t Vocab::find(std::string_view token) const {
  auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
}

Vocab Vocab::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("vocab: cannot read '" + path + "'");
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) {
      line.pop_back();
    }
    tokens.push_back(line);
  }
  while (!tokens.empty() && tokens.back().empty()) tokens.pop_back();
  try {
    return Vocab(std::move(tokens));
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + " in '" + path + "'");
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
