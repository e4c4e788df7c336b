#!/usr/bin/env python3
"""The PyTorch peer of bench/gpu_bert_step.cpp on one GPU: BERT-base MLM (post-LN encoder, GELU
FFN, decoder tied to the word embeddings, logits at every position, no NSP head), DDP at N=1 over
NCCL, bf16 autocast with fp32 parameters, torch.optim.AdamW(fused=True). Reports the median step
time after --warmup, samples/s and torch.cuda.max_memory_allocated, as one JSON object."""
import argparse
import json
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, h, heads, p):
        super().__init__()
        self.heads, self.dh = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, S, H = x.shape
        split = lambda t: t.view(B, S, self.heads, self.dh).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = self.drop(((q @ k.transpose(-1, -2)) / math.sqrt(self.dh)).softmax(dim=-1))
        return self.o((att @ v).transpose(1, 2).reshape(B, S, H))


class EncoderLayer(nn.Module):
    def __init__(self, h, heads, inter, p):
        super().__init__()
        self.attn = SelfAttention(h, heads, p)
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-12), nn.LayerNorm(h, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(h, inter), nn.Linear(inter, h)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class BertMLM(nn.Module):
    def __init__(self, vocab=30522, h=768, layers=12, heads=12, inter=3072, max_pos=512, p=0.1):
        super().__init__()
        self.word, self.pos, self.tok_type = nn.Embedding(vocab, h), nn.Embedding(max_pos, h), nn.Embedding(2, h)
        self.ln, self.drop = nn.LayerNorm(h, eps=1e-12), nn.Dropout(p)
        self.layers = nn.ModuleList([EncoderLayer(h, heads, inter, p) for _ in range(layers)])
        self.head_dense, self.head_ln = nn.Linear(h, h), nn.LayerNorm(h, eps=1e-12)
        self.head_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.drop(self.ln(self.word(ids) + self.pos(pos) + self.tok_type(torch.zeros_like(ids))))
        for layer in self.layers:
            x = layer(x)
        x = self.head_ln(F.gelu(self.head_dense(x)))
        return F.linear(x, self.word.weight, self.head_bias)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    model = BertMLM().cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "ln" in n]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "ln" in n)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, weight_decay=0.01, fused=True)
    ids = torch.randint(0, 30522, (a.batch, a.seq), device="cuda")
    labels = torch.where(torch.rand(a.batch, a.seq, device="cuda") < 0.15, ids, torch.full_like(ids, -100))
    times = []
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ddp(ids)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    print(json.dumps({"what": "torch DDP N=1 + fused AdamW, bf16 autocast", "torch": torch.__version__,
                      "batch": a.batch, "seq": a.seq, "steps": a.steps, "median_step_ms": med,
                      "samples_per_s": a.batch * 1e3 / med,
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                      "last_loss": loss.item()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
