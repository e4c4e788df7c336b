// Where the pretraining text comes from: named corpora that Debian packages ship (so every machine
// set up by scripts/setup.sh has the same text), and the readers of their formats. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bert {

// The named corpora:
//   manpages-intl  (the default) the Linux man-pages project's pages of Debian's manpages-dev
//             (sections 2 and 3: system calls and C library functions) and their French, German
//             and Spanish translations (manpages-fr-dev, -de-dev, -es-dev): ~2,400 documents,
//             one per page, read from the packages' file lists.
//   manpages  the English pages alone (~890 documents).
//   licenses  the licence texts of /usr/share/common-licenses (base-files): 14 documents of
//             legalese, fast to prepare.
// Note [Why the default corpus is multilingual]: next-sentence prediction is learned from the
// cues that tell a random segment from the true next one. Between two English man pages the cue
// is the topic, which BERT-tiny did not pick up in a run of a few minutes (eval NSP accuracy at
// the majority baseline after 225 steps of 64 sequences); when a random segment is in another
// language ~70% of the time, as in multilingual BERT's corpus, it starts after ~300 such steps
// (eval NSP accuracy 0.600 against a baseline of 0.519 at step 400).
inline constexpr const char* kDefaultCorpus = "manpages-intl";
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
