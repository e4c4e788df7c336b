"""Hugging Face transformers as a real client of bert_pretrain (CTest bert_hf_client_*, pip platform;
driven by tests/example/bert_hf_client_test.sh). Needs transformers (the pip platform's venv has
it) and runs with HF_HUB_OFFLINE=1: everything is read from local directories.

  hf_client_check.py export HF_DIR LOGITS TEXT IDS [--tol 1e-5]
      HF_DIR is bert_pretrain's --export-hf directory. BertForPreTraining.from_pretrained(HF_DIR,
      output_loading_info=True) must report no missing, unexpected or mismatched key and no error;
      the MLM decoder must be tied to the word embeddings. The MLM logits (at the masked positions)
      and NSP logits on the batch of LOGITS (bert_pretrain --eval-only --dump-logits) must be the
      trainer's within --tol. BertTokenizer.from_pretrained(HF_DIR) must encode each line of TEXT
      (without [CLS]/[SEP]) to the ids of the same line of IDS (bert_pretrain tokenize).
  hf_client_check.py make HF_DIR --vocab VOCAB [--seed 0]
      A randomly initialised BertForPreTraining of the example's `tiny` shape (2 layers, hidden
      128, 2 heads, intermediate 512) over VOCAB, written with save_pretrained(HF_DIR).
  hf_client_check.py import HF_DIR LOGITS EVAL_JSON [--tol 1e-5]
      The model of HF_DIR (read by transformers) on the batch of LOGITS, which the trainer wrote
      after --init-checkpoint HF_DIR --bert-config HF_DIR/config.json: its logits equal the
      trainer's, and its MLM and NSP losses on that batch (the whole eval set: one batch) equal
      EVAL_JSON's mlm_loss and nsp_loss, within --tol.
  hf_client_check.py layouts UNSPLIT_DIR SPLIT_DIR... [--tol 1e-5]
      The streamed exports of one training at several layouts (bert_pretrain --export-hf, issue
      55): each SPLIT_DIR is sharded (model.safetensors.index.json and the k-of-n files it names,
      at least two); every directory loads with no missing, unexpected or mismatched key, the same
      keys as UNSPLIT_DIR's, and on one random batch gives UNSPLIT_DIR's MLM and NSP logits within
      --tol.

Each mode ends with "hf_client_check: 1 passed, 0 failed" or exits non-zero with the reason.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from transformers import BertConfig, BertForPreTraining, BertTokenizer  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=512, type_vocab_size=2)


def fail(why):
    print(f"hf_client_check: FAIL: {why}")
    print("hf_client_check: 0 passed, 1 failed")
    sys.exit(1)


def load_model(hf_dir):
    model, info = BertForPreTraining.from_pretrained(hf_dir, output_loading_info=True)
    model.eval()
    return model, info


def hf_outputs(model, batch):
    """HF's logits at the trainer's masked positions (row-major, as the trainer gathers them) and
    its NSP logits on the dumped batch."""
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"].long(), token_type_ids=batch["token_type_ids"].long(),
                    attention_mask=batch["attention_mask"].long())
    scores = out.prediction_logits
    b, t, v = scores.shape
    if batch["mlm_logits"].shape[0] == b * t:  # the trainer's logits at every position
        return scores.reshape(b * t, v), out.seq_relationship_logits
    labels = batch["masked_labels"]
    rows, cols = torch.nonzero(labels.ne(-100), as_tuple=True)
    return scores[rows, batch["masked_positions"][rows, cols].long()], out.seq_relationship_logits


def compare_logits(model, batch, tol):
    mlm, nsp = hf_outputs(model, batch)
    if mlm.shape != batch["mlm_logits"].shape:
        fail(f"MLM logits of shape {list(mlm.shape)}, the trainer's {list(batch['mlm_logits'].shape)}")
    mlm_diff = (mlm - batch["mlm_logits"]).abs().max().item()
    print(f"MLM logits {list(mlm.shape)}: max |transformers - trainer| {mlm_diff:.3g} (tolerance {tol})")
    if "nsp_logits" not in batch:
        fail("the trainer wrote no NSP logits (a BertForPreTraining export has an NSP head)")
    nsp_diff = (nsp - batch["nsp_logits"]).abs().max().item()
    print(f"NSP logits {list(nsp.shape)}: max |transformers - trainer| {nsp_diff:.3g}")
    if not (mlm_diff <= tol and nsp_diff <= tol):
        fail(f"logits differ: MLM {mlm_diff:.3g}, NSP {nsp_diff:.3g} > {tol}")
    return mlm, nsp


def check_loading_info(model, info):
    print("loading info: " + ", ".join(f"{k} {len(v)}" for k, v in info.items()))
    bad = {k: v for k, v in info.items() if v}
    if bad:
        fail(f"from_pretrained reported {bad}")
    emb = model.bert.embeddings.word_embeddings.weight
    dec = model.cls.predictions.decoder
    if dec.weight.data_ptr() != emb.data_ptr():
        fail("cls.predictions.decoder.weight is not tied to bert.embeddings.word_embeddings.weight")
    if dec.bias is None or dec.bias.data_ptr() != model.cls.predictions.bias.data_ptr():
        fail("cls.predictions.decoder.bias is not tied to cls.predictions.bias")


def check_tokenizer(hf_dir, text_path, ids_path):
    tok = BertTokenizer.from_pretrained(hf_dir)
    lines = open(text_path, encoding="utf-8").read().split("\n")
    ours = open(ids_path, encoding="utf-8").read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if ours and ours[-1] == "":
        ours.pop()
    if len(lines) != len(ours):
        fail(f"{ids_path}: {len(ours)} lines of ids for {len(lines)} lines of text")
    differ = 0
    for i, (line, want) in enumerate(zip(lines, ours)):
        got = tok.encode(line, add_special_tokens=False)
        want = [int(x) for x in want.split()]
        if got != want:
            differ += 1
            if differ <= 3:
                print(f"line {i + 1} {line[:60]!r}: transformers {got[:12]}..., trainer {want[:12]}...")
    tokens = sum(len(x.split()) for x in ours)
    print(f"{type(tok).__name__} (do_lower_case {getattr(tok, 'do_lower_case', '?')}): "
          f"{len(lines) - differ} of {len(lines)} lines ({tokens} ids) encoded as the trainer does")
    if differ:
        fail(f"BertTokenizer encodes {differ} of {len(lines)} lines differently from the trainer")


def mode_export(args):
    model, info = load_model(args.hf_dir)
    check_loading_info(model, info)
    print(f"transformers {transformers.__version__}: loaded {args.hf_dir} as "
          f"{type(model).__name__} ({model.config._attn_implementation} attention)")
    compare_logits(model, load_file(args.logits), args.tol)
    check_tokenizer(args.hf_dir, args.text, args.ids)


def mode_make(args):
    vocab = [v for v in open(args.vocab, encoding="utf-8").read().split("\n") if v]
    config = BertConfig(vocab_size=len(vocab), hidden_act="gelu", hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1, layer_norm_eps=1e-12,
                        pad_token_id=vocab.index("[PAD]"), architectures=["BertForPreTraining"],
                        **TINY)
    torch.manual_seed(args.seed)
    model = BertForPreTraining(config)
    # Random biases and LayerNorm affines too (HF initialises them to 0 and 1), so that a tensor
    # loaded into the wrong place, or not at all, changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(args.hf_dir)
    keys = sorted(load_file(os.path.join(args.hf_dir, "model.safetensors")))
    print(f"transformers {transformers.__version__}: save_pretrained wrote {len(keys)} tensors to "
          f"{args.hf_dir} (tied copies written: "
          f"{[k for k in keys if k.startswith('cls.predictions.decoder')]})")
    print("hf_client_check: 1 passed, 0 failed")


def mode_import(args):
    model, info = load_model(args.hf_dir)
    check_loading_info(model, info)
    batch = load_file(args.logits)
    mlm, nsp = compare_logits(model, batch, args.tol)
    labels = batch["mlm_labels"].long()
    if labels.shape[0] != mlm.shape[0]:
        fail(f"mlm_labels {list(labels.shape)} for {mlm.shape[0]} MLM rows")
    hf_mlm = F.cross_entropy(mlm.double(), labels, ignore_index=-100).item()
    hf_nsp = F.cross_entropy(nsp.double(), batch["nsp_labels"].long()).item()
    ev = json.load(open(args.eval_json))
    if ev["masked"] != int(labels.ne(-100).sum()):
        fail(f"the eval set has {ev['masked']} masked tokens, the dumped batch "
             f"{int(labels.ne(-100).sum())}: not the same batch (--eval-max-instances)")
    print(f"MLM loss: transformers {hf_mlm:.8f}, trainer {ev['mlm_loss']:.8f}; NSP loss: "
          f"transformers {hf_nsp:.8f}, trainer {ev['nsp_loss']:.8f}")
    if abs(hf_mlm - ev["mlm_loss"]) > args.tol or abs(hf_nsp - ev["nsp_loss"]) > args.tol:
        fail(f"eval losses differ by more than {args.tol}")


def mode_layouts(args):
    ref, info = load_model(args.unsplit_dir)
    check_loading_info(ref, info)
    ref_keys = sorted(load_file(os.path.join(args.unsplit_dir, "model.safetensors")))
    torch.manual_seed(0)
    b, t = 4, 32
    batch = dict(input_ids=torch.randint(0, ref.config.vocab_size, (b, t)),
                 token_type_ids=torch.cat([torch.zeros(b, t // 2), torch.ones(b, t - t // 2)], 1).long(),
                 attention_mask=torch.ones(b, t, dtype=torch.long))
    batch["attention_mask"][1, t - 5:] = 0
    with torch.no_grad():
        want = ref(**batch)
    for d in args.split_dirs:
        index_path = os.path.join(d, "model.safetensors.index.json")
        if not os.path.exists(index_path):
            fail(f"{d}: no model.safetensors.index.json (a sharded export)")
        index = json.load(open(index_path))
        files = sorted(set(index["weight_map"].values()))
        n = len(files)
        expected = [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        if n < 2 or files != expected:
            fail(f"{d}: the index names {files}, expected {n} >= 2 files {expected}")
        keys = sorted(index["weight_map"])
        stored = sorted(k for f in files for k in load_file(os.path.join(d, f)))
        if keys != ref_keys or stored != ref_keys:
            fail(f"{d}: keys differ from {args.unsplit_dir}'s: index-only {sorted(set(keys) - set(ref_keys))}, "
                 f"unsplit-only {sorted(set(ref_keys) - set(keys))}, files vs index "
                 f"{sorted(set(stored) ^ set(keys))}")
        total = sum(os.path.getsize(os.path.join(d, f)) for f in files)
        if not (index["metadata"]["total_size"] <= total):
            fail(f"{d}: total_size {index['metadata']['total_size']} beyond the files' {total} bytes")
        model, info = load_model(d)
        check_loading_info(model, info)
        with torch.no_grad():
            got = model(**batch)
        mlm = (got.prediction_logits - want.prediction_logits).abs().max().item()
        nsp = (got.seq_relationship_logits - want.seq_relationship_logits).abs().max().item()
        print(f"{d}: {n} files, {len(keys)} keys as {args.unsplit_dir}; max |logits - unsplit "
              f"export's|: MLM {mlm:.3g}, NSP {nsp:.3g} (tolerance {args.tol})")
        if not (mlm <= args.tol and nsp <= args.tol):
            fail(f"{d}: logits differ from the unsplit export's: MLM {mlm:.3g}, NSP {nsp:.3g} > {args.tol}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("export")
    e.add_argument("hf_dir")
    e.add_argument("logits")
    e.add_argument("text")
    e.add_argument("ids")
    e.add_argument("--tol", type=float, default=1e-5)
    m = sub.add_parser("make")
    m.add_argument("hf_dir")
    m.add_argument("--vocab", required=True)
    m.add_argument("--seed", type=int, default=0)
    i = sub.add_parser("import")
    i.add_argument("hf_dir")
    i.add_argument("logits")
    i.add_argument("eval_json")
    i.add_argument("--tol", type=float, default=1e-5)
    lay = sub.add_parser("layouts")
    lay.add_argument("unsplit_dir")
    lay.add_argument("split_dirs", nargs="+")
    lay.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    {"export": mode_export, "make": mode_make, "import": mode_import,
     "layouts": mode_layouts}[args.mode](args)
    if args.mode != "make":
        print("hf_client_check: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
