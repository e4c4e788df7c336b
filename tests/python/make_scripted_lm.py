"""Writes a TorchScript language model nobody on the project wrote: torch's own
nn.TransformerEncoder between an embedding and a decoder tied to it. The stage-3 automatic-units
tests (tests/dist/auto_units_dist_test.cpp) torch::jit::load it and train it with no units.
Usage: make_scripted_lm.py OUT.pt"""
import sys

import torch

VOCAB, DIM, HEADS, FF, LAYERS = 23, 16, 2, 32, 12


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, DIM)
        layer = torch.nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.decoder = torch.nn.Linear(DIM, VOCAB)
        self.decoder.weight = self.embedding.weight  # tied

    def forward(self, tokens):
        return self.decoder(self.encoder(self.embedding(tokens)))


def main():
    torch.manual_seed(0)
    model = torch.jit.script(TiedLM())
    names = [n for n, _ in model.named_parameters()]
    assert "embedding.weight" in names, names
    model.save(sys.argv[1])


if __name__ == "__main__":
    main()
