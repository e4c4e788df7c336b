// Named corpora from Debian packages, corpus file listing, and a man page (roff) to text reader.
#include "corpus.hpp"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "data.hpp"
#include "tokenizer.hpp"

namespace bert {
namespace fs = std::filesystem;

namespace {

constexpr const char* kLicenses = "/usr/share/common-licenses";

// The pages of the packages in sections 2 and 3, read from their dpkg file lists (symlinked
// aliases left out: they repeat a page).
std::vector<std::string> package_pages(const std::string& corpus,
                                       const std::vector<std::string>& packages) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& package : packages) {
    const std::string list_path = "/var/lib/dpkg/info/" + package + ".list";
    std::ifstream list(list_path);
    if (!list) {
      throw std::runtime_error("--corpus " + corpus + " needs Debian's " + package + " package: "
                               "scripts/setup.sh installs it (" + list_path + " is missing); or "
                               "pass --corpus licenses|PATH");
    }
    size_t found = 0;
    std::string line;
    while (std::getline(list, line)) {
      const bool page = line.rfind("/usr/share/man/", 0) == 0 &&
                        (line.find("/man2/") != std::string::npos ||
                         line.find("/man3/") != std::string::npos) &&
                        line.size() > 3 && line.compare(line.size() - 3, 3, ".gz") == 0;
      if (!page || fs::is_symlink(line, ec) || !fs::is_regular_file(line, ec)) continue;
      files.push_back(line);
      ++found;
    }
    if (found < 50) {
      throw std::runtime_error(
          "--corpus " + corpus + ": only " + std::to_string(found) + " pages of " + package +
          " are on disk (a dpkg path-exclude for /usr/share/man, as in slim container images?); "
          "reinstall it without that, or pass --corpus licenses|PATH");
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

bool is_named_corpus(const std::string& name) {
  return name == "manpages" || name == "manpages-intl" || name == "licenses";
}

std::string describe_named_corpus(const std::string& name) {
  if (name == "manpages") {
    return "manpages: the Linux man-pages of Debian's manpages-dev (sections 2 and 3), one "
           "document per page";
  }
  if (name == "manpages-intl") {
    return "manpages-intl: the Linux man-pages of Debian's manpages-dev (sections 2 and 3) and "
           "their French, German and Spanish translations (manpages-fr-dev, -de-dev, -es-dev), "
           "one document per page";
  }
  if (name == "licenses") return std::string("licenses: the licence texts of ") + kLicenses;
  return name;
}

std::vector<std::string> corpus_files(const std::string& spec) {
  if (spec == "manpages") return package_pages(spec, {"manpages-dev"});
  if (spec == "manpages-intl") {
    return package_pages(spec, {"manpages-dev", "manpages-fr-dev", "manpages-de-dev", "manpages-es-dev"});
  }
  const std::string path = spec == "licenses" ? kLicenses : spec;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return {path};
  if (!fs::is_directory(path, ec)) {
    throw std::runtime_error("--corpus: '" + path + "' is neither a file nor a directory (nor "
                             "one of the named corpora manpages, licenses)");
  }
  std::vector<std::string> files;
  for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const auto name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(ec)) files.push_back(it->path().string());
  }
  std::sort(files.begin(), files.end());
  // Debian's GPL -> GPL-3 and friends: keep each real file once.
  std::set<std::string> seen;
  std::vector<std::string> unique;
  for (const auto& f : files) {
    if (seen.insert(fs::canonical(f, ec).string()).second) unique.push_back(f);
  }
  if (unique.empty()) throw std::runtime_error("--corpus: no files under '" + path + "'");
  return unique;
}

std::string read_text(const std::string& path) {
  if (path.size() < 3 || path.compare(path.size() - 3, 3, ".gz") != 0) return read_file(path);
  gzFile in = gzopen(path.c_str(), "rb");
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::string text;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(in, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  const bool failed = n < 0;
  gzclose(in);
  if (failed) throw std::runtime_error("'" + path + "' is not valid gzip data");
  return text;
}

uint64_t files_fingerprint(const std::vector<std::string>& files) {
  uint64_t h = fnv1a("files-v1", 8);
  for (const auto& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) throw std::runtime_error("cannot read '" + f + "'");
    const int64_t meta[3] = {static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec),
                             static_cast<int64_t>(st.st_mtim.tv_nsec)};
    h = fnv1a(f.data(), f.size() + 1, h);  // with the terminating NUL: names stay apart
    h = fnv1a(meta, sizeof(meta), h);
  }
  return h;
}

// ---- man pages --------------------------------------------------------------------------------

namespace {

// Special characters of groff_char(7) that man-pages uses; the rest are dropped.
const std::map<std::string, std::string>& glyphs() {
  static const std::map<std::string, std::string> g = {
      {"em", "\u2014"}, {"en", "\u2013"}, {"aq", "'"},       {"dq", "\""},      {"lq", "\u201C"},
      {"rq", "\u201D"}, {"oq", "\u2018"}, {"cq", "\u2019"},  {"bu", "\u2022"},  {"co", "\u00A9"},
      {"rg", "\u00AE"}, {"tm", "\u2122"}, {"mu", "\u00D7"},  {"di", "\u00F7"},  {"ti", "~"},
      {"ha", "^"},      {"rs", "\\"},     {"ga", "`"},       {"ul", "_"},       {"hy", "-"},
      {"pl", "+"},      {"eq", "="},      {"<=", "\u2264"},  {">=", "\u2265"},  {"!=", "\u2260"},
      {"->", "\u2192"}, {"<-", "\u2190"}, {"de", "\u00B0"},  {"+-", "\u00B1"},  {"ba", "|"},
      {"or", "|"},      {"at", "@"},      {"sl", "/"},       {"lB", "["},       {"rB", "]"},
      {"lC", "{"},      {"rC", "}"},      {"la", "\u27E8"},  {"ra", "\u27E9"},  {"Fo", "\u00AB"},
      {"Fc", "\u00BB"}, {"sh", "#"},      {"Do", "$"},       {"aa", "\u00B4"},  {"ss", "\u00DF"},
      {"lB", "["},      {"ap", "~"},      {"pc", "\u00B7"},  {"fm", "\u2032"},  {"sd", "\u2033"}};
  return g;
}

std::string glyph(const std::string& name) {
  auto it = glyphs().find(name);
  if (it != glyphs().end()) return it->second;
  // The digits come from the page: anything but the digits expected is an unknown glyph, never an
  // exception from std::stoi (the corpus fuzzer's \[charfP]).
  const auto all_of = [&](size_t from, int (*is)(int)) {
    return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(from), name.end(),
                       [is](unsigned char c) { return is(c) != 0; });
  };
  if (name.size() == 5 && name[0] == 'u' && all_of(1, isxdigit)) {  // \[u00E9]
    std::string s;
    utf8_append(s, static_cast<char32_t>(std::stoul(name.substr(1), nullptr, 16)));
    return s;
  }
  if (name.rfind("char", 0) == 0 && name.size() > 4 && name.size() <= 7 && all_of(4, isdigit)) {
    const int code = std::stoi(name.substr(4));  // \[char46]: a byte
    if (code < 256) return std::string(1, static_cast<char>(code));
  }
  return "";
}

// The name after an escape at s[i]: x, (xx or [name]; i is left on its last character.
std::string escape_name(const std::string& s, size_t& i) {
  if (i >= s.size()) return "";
  if (s[i] == '(') {
    const std::string n = s.substr(i + 1, 2);
    i = std::min(s.size(), i + 2);
    return n;
  }
  if (s[i] == '[') {
    const size_t end = s.find(']', i);
    const std::string n = s.substr(i + 1, end == std::string::npos ? std::string::npos : end - i - 1);
    i = end == std::string::npos ? s.size() : end;
    return n;
  }
  return std::string(1, s[i]);
}

// Resolves the escapes of a line of roff text (fonts, sizes, glyphs, strings, motions).
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out += s[i];
      continue;
    }
    if (++i >= s.size()) break;
    const char e = s[i];
    switch (e) {
      case '"': case '#':  // comment to the end of the line
        return out;
      case 'f': case 'F': case 'n': case 'k': case 'g': case 'm': case 'M': case 'V': case 'Y':
        ++i;
        escape_name(s, i);  // fonts, registers, colours: nothing to print
        break;
      case '*': {
        ++i;
        const std::string n = escape_name(s, i);
        out += n == "lq" ? "\u201C" : n == "rq" ? "\u201D" : n == "R" ? "\u00AE" : "";
        break;
      }
      case '(': case '[':
        out += glyph(escape_name(s, i));
        break;
      case 's':  // \s-1, \s+2, \s0, \s12, \s(12, \s[12]
        if (i + 1 < s.size() && (s[i + 1] == '+' || s[i + 1] == '-')) ++i;
        if (i + 1 < s.size() && (s[i + 1] == '(' || s[i + 1] == '[')) {
          ++i;
          escape_name(s, i);
        } else if (i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
          // \sN: one digit, or two when the first is 1-3 (groff's rule).
          const char first = s[++i];
          if (first >= '1' && first <= '3' && i + 1 < s.size() &&
              std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
            ++i;
          }
        }
        break;
      case 'h': case 'v': case 'w': case 'o': case 'X': case 'Z': case 'b': case 'l': case 'L':
      case 'D': case 'N': case 'R': case 'x': case 'H': case 'S': case 'A': case 'B': {
        // A delimited argument: \h'1m'.
        if (i + 1 < s.size()) {
          const char delim = s[++i];
          const size_t end = s.find(delim, i + 1);
          i = end == std::string::npos ? s.size() : end;
        }
        break;
      }
      case 'e': case '\\': out += '\\'; break;
      case '-': out += '-'; break;
      case ' ': case '~': case '0': out += ' '; break;
      case '&': case '%': case '|': case '^': case ':': case 'c': case ')': case '/': case ',':
      case 'p': case 'a': case 'd': case 'u': case 'r': case 't': case 'z':
        break;
      default:
        out += e;
    }
  }
  return out;
}

// A request's arguments: separated by spaces, "quoted" (with "" for a quote) or not.
std::vector<std::string> request_args(const std::string& s, size_t from) {
  std::vector<std::string> args;
  size_t i = from;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    if (i >= s.size()) break;
    std::string a;
    if (s[i] == '"') {
      for (++i; i < s.size(); ++i) {
        if (s[i] == '"') {
          if (i + 1 < s.size() && s[i + 1] == '"') a += s[++i];
          else break;
        } else {
          a += s[i];
        }
      }
      ++i;
    } else {
      for (; i < s.size() && s[i] != ' ' && s[i] != '\t'; ++i) {
        a += s[i];
        if (s[i] == '\\' && i + 1 < s.size()) a += s[++i];  // "\ " does not split
      }
    }
    if (a.rfind("\\\"", 0) == 0) break;  // a comment
    args.push_back(a);
  }
  return args;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

bool looks_like_man_page(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  for (int n = 0; n < 40 && std::getline(in, line); ++n) {
    if (starts_with(line, ".TH ") || starts_with(line, ".Dd ") || starts_with(line, ".so ")) return true;
    if (!line.empty() && !starts_with(line, ".\\\"") && !starts_with(line, "'\\\"")) return false;
  }
  return false;
}

std::string man_to_text(const std::string& roff) {
  std::ostringstream out;
  std::string para;
  bool nofill = false, own_line = false, wrote = false;
  std::string skip_until;  // the request that ends a skipped block (tables, macros, equations)
  auto flush = [&] {
    size_t b = para.find_first_not_of(' '), e = para.find_last_not_of(' ');
    if (b != std::string::npos) {
      if (wrote) out << "\n\n";
      out << para.substr(b, e - b + 1);
      wrote = true;
    }
    para.clear();
  };
  auto text = [&](const std::string& t) {
    if (nofill || own_line) {
      flush();
      para = t;
      flush();
      own_line = false;
    } else {
      if (!para.empty()) para += ' ';
      para += t;
    }
  };
  std::istringstream in(roff);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!skip_until.empty()) {
      if (starts_with(line, skip_until.c_str())) skip_until.clear();
      continue;
    }
    if (line.empty()) {
      flush();
      continue;
    }
    if (line[0] != '.' && line[0] != '\'') {
      const std::string t = unescape(line);
      if (t.find_first_not_of(" \t") != std::string::npos) text(t);
      continue;
    }
    size_t k = 1;
    while (k < line.size() && (line[k] == ' ' || line[k] == '\t')) ++k;
    size_t end = k;
    while (end < line.size() && line[end] != ' ' && line[end] != '\t') ++end;
    const std::string name = line.substr(k, end - k);
    const auto args = request_args(line, end);
    auto joined = [&](const char* sep) {
      std::string s;
      for (size_t i = 0; i < args.size(); ++i) s += (i ? sep : "") + unescape(args[i]);
      return s;
    };
    if (name == "so") {  // a page that is only a redirect has no text of its own
      if (!wrote && para.empty()) return "";
      continue;
    }
    if (name == "SH" || name == "SS") {
      flush();
      if (args.empty()) own_line = true;  // the heading is the next line
      else text(joined(" ")), flush();
    } else if (name == "B" || name == "I" || name == "R" || name == "SM" || name == "SB") {
      if (!args.empty()) text(joined(" "));
    } else if (name.size() == 2 && std::string("BIR").find(name[0]) != std::string::npos &&
               std::string("BIR").find(name[1]) != std::string::npos) {
      if (!args.empty()) text(joined(""));  // .BR open (2) -> open(2)
    } else if (name == "nf" || name == "EX") {
      flush();
      nofill = true;
    } else if (name == "fi" || name == "EE") {
      flush();
      nofill = false;
    } else if (name == "TP" || name == "TQ") {
      flush();
      own_line = true;  // the tag
    } else if (name == "IP") {
      flush();
      const std::string tag = args.empty() ? "" : unescape(args[0]);
      if (tag.size() > 3) text(tag), flush();  // a word, not a bullet or a number
    } else if (name == "PP" || name == "P" || name == "LP" || name == "HP" || name == "sp" ||
               name == "br" || name == "RS" || name == "RE" || name == "in" || name == "SY" ||
               name == "YS") {
      flush();
    } else if (name == "UE" || name == "ME") {
      if (!args.empty()) para += joined("");  // punctuation after a link
    } else if (name == "TS") {
      flush();
      skip_until = ".TE";
    } else if (name == "EQ") {
      skip_until = ".EN";
    } else if (name == "de" || name == "ig" || name == "am") {
      skip_until = "..";
    }
    // Anything else (.TH, .ad, .nh, .ft, .ie, .if, .ds, .UR, .MT, comments ...) prints nothing.
  }
  flush();
  return out.str();
}

}  // namespace bert
