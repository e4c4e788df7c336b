"""Writes TorchScript language models nobody on the project wrote: torch's own
nn.TransformerEncoder between an embedding and a decoder tied to it. The stage-3 automatic-units
tests (tests/dist/auto_units_dist_test.cpp) torch::jit::load them and train them with no units.
Usage: make_scripted_lm.py OUT.pt [MLM_NSP.pt]
  OUT.pt:     12 layers of d_model 16 / ff 32, vocabulary 23, tied decoder.
  MLM_NSP.pt: 12 layers of d_model 64 / ff 256, vocabulary 200, tied MLM decoder and an NSP head
              on the first position (a model of many small layers: every group is under
              UnitPolicy's persist_below); forward returns (mlm_logits, nsp_logits)."""
import sys
from typing import Tuple

import torch

VOCAB, DIM, HEADS, FF, LAYERS = 23, 16, 2, 32, 12
BIG_VOCAB, BIG_DIM, BIG_HEADS, BIG_FF = 200, 64, 4, 256


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


class MlmNsp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(BIG_VOCAB, BIG_DIM)
        layer = torch.nn.TransformerEncoderLayer(BIG_DIM, BIG_HEADS, BIG_FF, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.decoder = torch.nn.Linear(BIG_DIM, BIG_VOCAB)
        self.decoder.weight = self.embedding.weight  # tied
        self.nsp = torch.nn.Linear(BIG_DIM, 2)

    def forward(self, tokens) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(self.embedding(tokens))
        return self.decoder(h), self.nsp(h[:, 0])


def save(model, path):
    model = torch.jit.script(model)
    names = [n for n, _ in model.named_parameters()]
    assert "embedding.weight" in names, names
    model.save(path)


def main():
    torch.manual_seed(0)
    save(TiedLM(), sys.argv[1])
    if len(sys.argv) > 2:
        torch.manual_seed(0)
        save(MlmNsp(), sys.argv[2])


if __name__ == "__main__":
    main()
