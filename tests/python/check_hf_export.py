"""An independent check of bert_pretrain's Hugging Face export (run by CTest, bert_hf_export).

Builds BertForPreTraining from the export's config.json in plain PyTorch, written here from the
structure and parameter names of Hugging Face transformers' modeling_bert.py (BertEmbeddings,
BertSelfAttention, ..., BertPreTrainingHeads) and sharing no code with examples/bert/model.cpp;
loads model.safetensors with load_state_dict(strict=True), runs the batch that
`bert_pretrain --eval-only --dump-logits FILE` wrote, and compares the MLM logits (at the masked
positions) and the NSP logits with the example's. Also checks the tokenizer files.
With --state-dict FILE (a run's model.pt: bert_pretrain --save-model), the state dict is instead
torch.load(FILE) into the model built from EXPORT_DIR/config.json (the run's own output folder),
strictly, as a PyTorch user loads it; a copy lacking a key must be refused.

Usage: check_hf_export.py EXPORT_DIR LOGITS_FILE [--tol 1e-5] [--state-dict FILE]

safetensors files are read with Debian's python3-safetensors where it is installed (trixie), else
with read_safetensors below: the format is an unsigned 64-bit little-endian header length N, N
bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes, offsets relative to the end of the header.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

try:
    from safetensors.torch import load_file as safetensors_load_file
except ImportError:  # bookworm has no python3-safetensors
    safetensors_load_file = None

NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path):
    """The documented fallback reader (see the module's docstring)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        raw = body[begin:end]
        if e["dtype"] == "BF16":
            t = torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(raw, dtype=NUMPY_DTYPES[e["dtype"]]).copy())
        out[name] = t.reshape(e["shape"])
    return out


def load_safetensors(path):
    if safetensors_load_file is not None:
        return safetensors_load_file(path)
    return read_safetensors(path)


def activation(name):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act {name!r}")


# ---- the model, module by module as transformers' modeling_bert.py names them ------------------

class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], h, padding_idx=c.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=c.get("layer_norm_eps", 1e-12))
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])
        self.register_buffer("position_ids", torch.arange(c["max_position_embeddings"]).expand((1, -1)),
                             persistent=False)

    def forward(self, input_ids, token_type_ids):
        positions = self.position_ids[:, :input_ids.shape[1]]
        e = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))
        return self.dropout(self.LayerNorm(e))


class BertSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.head_size = h // self.heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.dropout = nn.Dropout(c["attention_probs_dropout_prob"])

    def split(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, hidden, extended_mask):
        q, k, v = self.split(self.query(hidden)), self.split(self.key(hidden)), self.split(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size) + extended_mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.shape[0], context.shape[1], -1)


class BertSelfOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c.get("layer_norm_eps", 1e-12))
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c)

    def forward(self, hidden, extended_mask):
        return self.output(self.self(hidden, extended_mask), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])
        self.act = activation(c["hidden_act"])

    def forward(self, hidden):
        return self.act(self.dense(hidden))


class BertOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["intermediate_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c.get("layer_norm_eps", 1e-12))
        self.dropout = nn.Dropout(c["hidden_dropout_prob"])

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertOutput(c)

    def forward(self, hidden, extended_mask):
        attended = self.attention(hidden, extended_mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(c) for _ in range(c["num_hidden_layers"])])

    def forward(self, hidden, extended_mask):
        for layer in self.layer:
            hidden = layer(hidden, extended_mask)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, c, add_pooling_layer=True):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c) if add_pooling_layer else None

    def forward(self, input_ids, token_type_ids, attention_mask):
        dtype = self.embeddings.word_embeddings.weight.dtype
        extended = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        sequence = self.encoder(self.embeddings(input_ids, token_type_ids), extended)
        return sequence, (self.pooler(sequence) if self.pooler is not None else None)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.transform_act_fn = activation(c["hidden_act"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c.get("layer_norm_eps", 1e-12))

    def forward(self, hidden):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.decoder = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))
        self.decoder.bias = self.bias  # transformers ties them: both keys are in the state dict

    def forward(self, hidden):
        return self.decoder(self.transform(hidden))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)
        self.seq_relationship = nn.Linear(c["hidden_size"], 2)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = BertLMPredictionHead(c)


class BertForPreTraining(nn.Module):
    """BertForPreTraining, or BertForMaskedLM (no pooler, no NSP head) when the config says so."""

    def __init__(self, c):
        super().__init__()
        self.nsp = c["architectures"] == ["BertForPreTraining"]
        self.bert = BertModel(c, add_pooling_layer=self.nsp)
        self.cls = BertPreTrainingHeads(c) if self.nsp else BertOnlyMLMHead(c)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight  # tied

    def forward(self, input_ids, token_type_ids, attention_mask):
        sequence, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        scores = self.cls.predictions(sequence)
        return scores, (self.cls.seq_relationship(pooled) if self.nsp else None)


# ---- the checks -----------------------------------------------------------------------------------

def check_tokenizer_files(export):
    vocab = open(os.path.join(export, "vocab.txt"), encoding="utf-8").read().split("\n")
    specials = json.load(open(os.path.join(export, "special_tokens_map.json")))
    for key in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        assert specials[key] in vocab, f"special_tokens_map.json: {key} {specials[key]!r} not in vocab.txt"
    tok = json.load(open(os.path.join(export, "tokenizer_config.json")))
    assert isinstance(tok["do_lower_case"], bool), tok
    return len([v for v in vocab if v])


def check_refuses_a_missing_key(model, state):
    """The strict load below can fail: without one key, load_state_dict names it."""
    key = "bert.encoder.layer.0.output.dense.weight"
    less = {k: v for k, v in state.items() if k != key}
    try:
        model.load_state_dict(less, strict=True)
    except RuntimeError as e:
        assert key in str(e), str(e)
    else:
        raise AssertionError(f"load_state_dict(strict=True) accepted a state dict without {key}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("logits")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--state-dict", help="a torch.save'd state dict (model.pt) instead of model.safetensors")
    args = ap.parse_args()
    torch.manual_seed(0)
    reader = "python3-safetensors" if safetensors_load_file else "the fallback reader"
    print(f"torch {torch.__version__}, safetensors read with {reader}")

    config = json.load(open(os.path.join(args.export, "config.json")))
    assert config["model_type"] == "bert", config.get("model_type")
    assert config["architectures"] in (["BertForPreTraining"], ["BertForMaskedLM"]), config["architectures"]
    model = BertForPreTraining(config)
    if args.state_dict:
        state = torch.load(args.state_dict, weights_only=True)
        source = args.state_dict
        check_refuses_a_missing_key(model, state)
    else:
        vocab_lines = check_tokenizer_files(args.export)
        assert vocab_lines <= config["vocab_size"], (vocab_lines, config["vocab_size"])
        state = load_safetensors(os.path.join(args.export, "model.safetensors"))
        source = "model.safetensors"
    for key in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"):
        assert key in state, f"{source} lacks the tied key {key}"
    model.load_state_dict(state, strict=True)  # raises on any missing or unexpected key
    model.eval()
    print(f"loaded {len(state)} tensors of {source} strictly into the independent BertForPreTraining")

    batch = load_safetensors(args.logits)
    with torch.no_grad():
        scores, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    b, t, v = scores.shape
    want_mlm = batch["mlm_logits"]
    if want_mlm.shape[0] == b * t:  # the example computed logits at every position
        got_mlm = scores.reshape(b * t, v)
    else:  # at the real masked positions, row-major, as the example gathers them
        labels = batch["masked_labels"]
        rows, cols = torch.nonzero(labels.ne(-100), as_tuple=True)
        got_mlm = scores[rows, batch["masked_positions"][rows, cols]]
    assert got_mlm.shape == want_mlm.shape, (got_mlm.shape, want_mlm.shape)
    mlm_diff = (got_mlm - want_mlm).abs().max().item()
    print(f"MLM logits {list(want_mlm.shape)}: max |difference| {mlm_diff:.3g} (tolerance {args.tol})")
    ok = mlm_diff <= args.tol
    if "nsp_logits" in batch:
        assert nsp is not None, "the example has an NSP head, the config does not"
        nsp_diff = (nsp - batch["nsp_logits"]).abs().max().item()
        print(f"NSP logits {list(nsp.shape)}: max |difference| {nsp_diff:.3g}")
        ok = ok and nsp_diff <= args.tol
    mlm_acc = got_mlm.argmax(-1).eq(want_mlm.argmax(-1)).float().mean().item()
    print(f"MLM argmax agreement {mlm_acc:.4f}")
    print("check_hf_export: " + ("1 passed, 0 failed" if ok else "0 passed, 1 failed"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
