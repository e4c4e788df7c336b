#include "config.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace gpt {

GptConfig GptConfig::preset(const std::string& name) {
  GptConfig c;
  c.name = name;
  if (name == "tiny") {
    c.layers = 4, c.hidden = 64, c.heads = 4, c.n_ctx = 128;
  } else if (name == "mini") {
    c.layers = 6, c.hidden = 256, c.heads = 8, c.n_ctx = 256;
  } else if (name == "small") {  // GPT-2 small's shape (124 M parameters with its 50257 tokens)
    c.layers = 12, c.hidden = 768, c.heads = 12, c.n_ctx = 1024;
  } else {
    throw std::invalid_argument(fmt::format("--preset: unknown preset '{}'", name));
  }
  return c;
}

std::vector<std::string> GptConfig::preset_names() { return {"tiny", "mini", "small"}; }

std::string GptConfig::check(int tp, int stages) const {
  if (hidden % heads != 0) {
    return fmt::format("--hidden {} is not divisible by --heads {}", hidden, heads);
  }
  // Column-parallel QKV keeps whole heads on a rank; the MLP's 4h features split evenly.
  if (heads % tp != 0) {
    return fmt::format(
        "--tp {}: the model's {} attention heads are not divisible by the "
        "tensor-parallel size",
        tp, heads);
  }
  if (layers % stages != 0) {
    return fmt::format(
        "--pp x --virtual-stages = {} pipeline stages do not divide the model's {} "
        "layers (each stage holds layers / stages of them)",
        stages, layers);
  }
  return "";
}

std::string GptConfig::describe() const {
  return fmt::format("{} layers, hidden {}, {} heads, {} positions", layers, hidden, heads, n_ctx);
}

}  // namespace gpt
