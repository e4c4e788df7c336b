// The path read_state_dict took before the bounds (816cffd): the file's bytes, then
// torch::jit::pickle_load over a std::vector copy of them.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::ifstream in(argv[1], std::ios::binary | std::ios::ate);
  const auto size = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  const at::Tensor bytes = at::empty({size}, at::kByte);
  in.read(static_cast<char*>(bytes.data_ptr()), size);
  const auto* p = static_cast<const char*>(bytes.data_ptr());
  const auto dict = torch::jit::pickle_load(std::vector<char>(p, p + size)).toGenericDict();
  int64_t elements = 0;
  for (const auto& item : dict) elements += item.value().toTensor().numel();
  std::cout << dict.size() << " tensors, " << elements << " elements\n";
}
