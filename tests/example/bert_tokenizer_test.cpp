// The tokenizer against BERT's reference (Google's tokenization.py BasicTokenizer + WordPiece) on
// non-ASCII text: the expected tokens are what the reference gives (Python 3.11 unicodedata).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tokenizer.hpp"

namespace bert {
namespace {

using Strings = std::vector<std::string>;

TEST(BertReference, VietnameseAccentsOutsideLatin1AreStripped) {
  // U+1EA7 (ầ), U+1ECD (ọ), U+00E2 (â): Latin Extended Additional needs the full NFD.
  EXPECT_EQ(basic_tokenize("Tr\u1EA7n Ng\u1ECDc Qu\u00E2n"), (Strings{"tran", "ngoc", "quan"}));
  // BERT's uncased vocab has no "ngoc": the reference gives "tran n ##g ##oc qu ##an". A vocab
  // with the same pieces reproduces it (this test's caveat: not the 30,522-token vocab itself).
  const Tokenizer tok(Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "tran", "n", "##g",
                             "##oc", "qu", "##an"}));
  EXPECT_EQ(tok.tokenize("Tr\u1EA7n Ng\u1ECDc Qu\u00E2n"),
            (Strings{"tran", "n", "##g", "##oc", "qu", "##an"}));
  // Đ (U+0110) has no decomposition: lower-cased, kept. Curly quotes and the em dash are P*.
  EXPECT_EQ(basic_tokenize("\u0110\u1EB7ng Th\u00E1i S\u01A1n \u2014 \u201CH\u00E0 N\u1ED9i\u201D"),
            (Strings{"\u0111ang", "thai", "son", "\u2014", "\u201C", "ha", "noi", "\u201D"}));
}

TEST(BertReference, OtherScriptsAndCompatibilityCharacters) {
  EXPECT_EQ(basic_tokenize("\u0130stanbul \u015E\u0130\u015EL\u0130"), (Strings{"istanbul", "sisli"}));
  EXPECT_EQ(basic_tokenize("\u039A\u03B1\u03BB\u03B7\u03BC\u03AD\u03C1\u03B1 \u03BA\u03CC\u03C3\u03BC\u03B5"),
            (Strings{"\u03BA\u03B1\u03BB\u03B7\u03BC\u03B5\u03C1\u03B1", "\u03BA\u03BF\u03C3\u03BC\u03B5"}));
  EXPECT_EQ(basic_tokenize("\u041F\u0440\u0438\u0432\u0435\u0442, \u0401\u0436!"),
            (Strings{"\u043F\u0440\u0438\u0432\u0435\u0442", ",", "\u0435\u0436", "!"}));
  // Full-width letters are lower-cased but not folded to ASCII (NFD, not NFKD); U+FF0D is Pd.
  EXPECT_EQ(basic_tokenize("\uFF46\uFF55\uFF4C\uFF4C\uFF0D\uFF37 \uFF21"),
            (Strings{"\uFF46\uFF55\uFF4C\uFF4C", "\uFF0D", "\uFF57", "\uFF41"}));
  // The ligature and the fraction have only compatibility decompositions: kept.
  EXPECT_EQ(basic_tokenize("na\u00EFve \u00C5ngstr\u00F6m \uFB01ne \u00BD"),
            (Strings{"naive", "angstrom", "\uFB01ne", "\u00BD"}));
  EXPECT_EQ(basic_tokenize("M\u00FCller\u2019s \u00ABStra\u00DFe\u00BB"),
            (Strings{"muller", "\u2019", "s", "\u00AB", "stra\u00DFe", "\u00BB"}));
  // A CJK compatibility ideograph (U+F900) is its own token and has a canonical decomposition.
  EXPECT_EQ(basic_tokenize("\uF900\u66F4"), (Strings{"\u8C48", "\u66F4"}));
  // U+2028 (Zl) separates words, as str.split() does in the reference; U+00AD (Cf) is dropped.
  EXPECT_EQ(basic_tokenize("a\u2028b c\u00ADd"), (Strings{"a", "b", "cd"}));
}

TEST(BertReference, CasedKeepsCaseAndAccents) {
  EXPECT_EQ(basic_tokenize("Tr\u1EA7n Ng\u1ECDc Qu\u00E2n", /*lower_case=*/false),
            (Strings{"Tr\u1EA7n", "Ng\u1ECDc", "Qu\u00E2n"}));
  EXPECT_EQ(basic_tokenize("\u0110\u1EB7ng \u201CH\u00E0\u201D", false),
            (Strings{"\u0110\u1EB7ng", "\u201C", "H\u00E0", "\u201D"}));
  const Tokenizer cased(Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "The", "the", "cat"}),
                        /*lower_case=*/false);
  EXPECT_EQ(cased.tokenize("The cat the"), (Strings{"The", "cat", "the"}));
}

TEST(BertReference, VocabCaseConvention) {
  EXPECT_TRUE(Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "The"}).is_cased());
  EXPECT_TRUE(Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##\u00C9"}).is_cased());
  // The specials are upper-case in both conventions.
  EXPECT_FALSE(Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "##s", "1"}).is_cased());
}

}  // namespace
}  // namespace bert
