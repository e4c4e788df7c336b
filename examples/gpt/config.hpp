// The GPT-2-architecture decoder's shape (gpt_train --preset, --layers, --hidden, --heads) and the
// rules a layout imposes on it. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

// GPT-2's hyper-parameters (Radford et al. 2019): pre-LN blocks, learned positions, the LM head
// tied to the token embedding, GELU (tanh) MLP of 4 x hidden.
struct GptConfig {
  std::string name;
  int64_t layers = 4;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t n_ctx = 128;   // learned positions: the longest sequence
  int64_t vocab = 256;   // bytes (before padding to a multiple of 128 x tp)
  double dropout = 0.1;  // embeddings, attention probabilities, residual branches

  static GptConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  int64_t head_dim() const { return hidden / heads; }
  // "" when the model fits `tp` tensor ranks and `stages` pipeline stages (p x V), else one line
  // naming the option and the rule: heads and 4 x hidden divide by tp, layers by the stages.
  std::string check(int tp, int stages) const;
  // "4 layers, hidden 64, 4 heads, 128 positions"
  std::string describe() const;
};

}  // namespace gpt
