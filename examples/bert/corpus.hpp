// Where the pretraining text comes from: named corpora that Debian packages ship (so every machine
// set up by scripts/setup.sh has the same text), and the readers of their formats. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bert {

// The named corpora:
//   manpages  the Linux man-pages project's pages of Debian's manpages-dev (sections 2 and 3:
//             system calls and C library functions), one document per page, read from the
//             package's file list; ~2,000 documents on different topics, so that a random "next
//             sentence" from another document is usually about something else (what NSP learns).
//   licenses  the licence texts of /usr/share/common-licenses (base-files): 14 documents of
//             legalese, fast to prepare, too few and too alike for NSP to be learned.
inline constexpr const char* kDefaultCorpus = "manpages";
bool is_named_corpus(const std::string& name);
// One line on what a named corpus is, for the log.
std::string describe_named_corpus(const std::string& name);

// The files of `spec`: a named corpus, a file, or the regular files under a directory
// (recursively, sorted, symlinks to files already listed and hidden files skipped). Throws
// std::runtime_error saying what is missing and how to get it.
std::vector<std::string> corpus_files(const std::string& spec);

// A file's text; `.gz` files are decompressed. Throws std::runtime_error naming the file.
std::string read_text(const std::string& path);

// True for roff man page source (its first request lines are .TH / .SH / comments).
bool looks_like_man_page(const std::string& text);
// A man page's text as prose: paragraphs separated by blank lines, section headings and
// no-fill (code) lines as paragraphs of their own, font and character escapes resolved, tables
// and comments dropped. "" for a page that only redirects (.so) to another.
std::string man_to_text(const std::string& roff);

// A cheap fingerprint of the files (path, size, modification time): the cache key of the
// vocabulary and data made from them, without reading the text.
uint64_t files_fingerprint(const std::vector<std::string>& files);

}  // namespace bert
