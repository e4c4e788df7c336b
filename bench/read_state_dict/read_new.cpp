// shardopt::read_state_dict over a torch.save file (the bounded reader, torch_save_reader.cpp);
// `read_new --write N FILE` writes the file first: {w: N ones, b: 3 ones} by torch::pickle_save.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>
#include <string>

#include "shardopt/checkpoint.hpp"

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--write") {
    c10::Dict<std::string, at::Tensor> dict;
    dict.insert("w", at::ones({std::stoll(argv[2])}));
    dict.insert("b", at::ones({3}));
    const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
    std::ofstream(argv[3], std::ios::binary).write(bytes.data(), bytes.size());
    return 0;
  }
  if (argc != 2) return 2;
  const auto dict = shardopt::read_state_dict(argv[1]);
  int64_t elements = 0;
  for (const auto& item : dict) elements += item.value().numel();
  std::cout << dict.size() << " tensors, " << elements << " elements\n";
}
