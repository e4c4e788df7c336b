#!/usr/bin/env python3
"""Masked-LM pretraining of a small BERT-style PyTorch model with shardopt on several ranks.

    # MPI engine (shardopt.init_from_env() sees mpirun's variables):
    mpirun -np 2 /usr/bin/python3 python_bindings/examples/train_bert.py --stage 2
    # or torch.multiprocessing + a torch.distributed Gloo group that shardopt reuses:
    /usr/bin/python3 python_bindings/examples/train_bert.py --launcher spawn --world-size 2
    # or pip's torchrun + torch.distributed's Gloo group over torchrun's store:
    torchrun --nproc-per-node=2 python_bindings/examples/train_bert.py --launcher torchrun

    # surviving a killed rank: torchrun restarts the job, which continues from its newest
    # snapshot in host memory, bitwise (docs/recovery.md); scripts/shardopt-run does it for mpirun
    torchrun --nproc-per-node=2 --max-restarts=3 python_bindings/examples/train_bert.py \
        --launcher torchrun --snapshot-every 1 --snapshot-dir /dev/shm/shardopt-myjob

PYTHONPATH must reach the package (<build>/python after scripts/build.sh, or pip install it).

The model: word/position embeddings + LayerNorm, post-LN encoder layers, an MLM head whose
decoder is tied to the word embeddings (one parameter, sharded once). The data: word-level tokens
of the Debian licence texts (/usr/share/common-licenses; a synthetic corpus where those are
missing), 15% of the positions masked. Each rank trains on its own slice of every global batch;
shardopt averages the gradients, so all ranks hold the same model after every step.
"""
import argparse
import collections
import gc
import json
import math
import os
import re
import signal
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardopt

PRESETS = {  # layers, hidden, heads, intermediate, sequence length, vocabulary
    "tiny": dict(layers=2, hidden=64, heads=2, intermediate=256, seq=32, vocab=1000),
    "mini": dict(layers=4, hidden=256, heads=4, intermediate=1024, seq=64, vocab=8000),
}
PAD, UNK, MASK = 0, 1, 2


# ---- model ----------------------------------------------------------------------------------

class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, intermediate, dropout):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        a, _ = self.attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)
        x = self.ln1(x + self.drop(a))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class BertMLM(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, intermediate, seq, dropout=0.0, **_):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden, padding_idx=PAD)
        self.position = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, intermediate, dropout)
                                    for _ in range(layers))
        self.head_dense, self.head_ln = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))  # weight: tied to self.word
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids):
        pad_mask = ids == PAD
        x = self.ln(self.word(ids) + self.position(torch.arange(ids.shape[1])))
        for layer in self.layers:
            x = layer(x, pad_mask)
        x = self.head_ln(F.gelu(self.head_dense(x)))
        return F.linear(x, self.word.weight, self.decoder_bias)


# ---- data -----------------------------------------------------------------------------------

def corpus_words(path):
    words = []
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, encoding="utf-8", errors="replace") as f:
                    words += re.findall(r"[a-z]+|[0-9]+|[^\sa-z0-9]", f.read().lower())
    if len(words) < 10_000:  # no licence texts here: a deterministic toy language instead
        g = torch.Generator().manual_seed(7)
        stems = [f"w{i}" for i in range(300)]
        for _ in range(20_000):
            s = torch.randint(0, 300, (1,), generator=g).item()
            words += [stems[s], stems[(s * 7 + 1) % 300], stems[(s * 13 + 5) % 300], "."]
    return words


def tokenize(words, vocab_size):
    counts = collections.Counter(words)
    vocab = {w: i + 3 for i, (w, _) in enumerate(counts.most_common(vocab_size - 3))}
    return torch.tensor([vocab.get(w, UNK) for w in words], dtype=torch.long)


def global_batch(tokens, step, batch, seq, seed, mask_prob=0.15):
    """The same (inputs, labels) on every rank for a step; each rank then takes its slice."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq, (batch,), generator=g)
    ids = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
    masked = torch.rand(ids.shape, generator=g) < mask_prob
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK), ids), labels


# ---- surviving failures ---------------------------------------------------------------------

FAULTS = ("kill", "throw", "kill-in-snapshot")


def test_fault():
    """BERT_TEST_FAULT="RANK:STEP:ACTION", as the C++ example reads it (Note [Test faults] in
    examples/bert/test_fault.hpp): `kill` SIGKILLs rank RANK before training step STEP (1-based),
    `throw` raises there, `kill-in-snapshot` SIGKILLs it right after the snapshot of step STEP
    started (its buddy exchange and commit in flight). A restarted job runs without it:
    torchrun's TORCHELASTIC_RESTART_COUNT or scripts/shardopt-run's SHARDOPT_RESTART > 0."""
    spec = os.environ.get("BERT_TEST_FAULT", "")
    if not spec or any(int(os.environ.get(v) or 0) > 0
                       for v in ("TORCHELASTIC_RESTART_COUNT", "SHARDOPT_RESTART")):
        return None
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULTS:
        raise SystemExit(f"BERT_TEST_FAULT='{spec}': expected RANK:STEP:ACTION with ACTION one "
                         f"of {', '.join(FAULTS)}")
    return int(parts[0]), int(parts[1]), parts[2]


def snapshot_dir(args, rank):
    """--snapshot-dir with `{host}` replaced by this rank's host number (rank / --ranks-per-host),
    to emulate hosts on one machine."""
    if "{host}" not in args.snapshot_dir:
        return args.snapshot_dir
    if args.ranks_per_host <= 0:
        raise SystemExit(f"--snapshot-dir {args.snapshot_dir}: {{host}} needs --ranks-per-host")
    return args.snapshot_dir.replace("{host}", str(rank // args.ranks_per_host))


def run_identity(args, world):
    """What a snapshot must have been taken with to be continued bitwise."""
    return {k: getattr(args, k) for k in ("preset", "stage", "steps", "batch", "lr", "dropout",
                                          "seed", "corpus")} | {"world": world}


def restore_snapshot(args, snaps, sched, rank, world):
    """The newest committed snapshot, if any: (first step, losses so far); else (0, [])."""
    state, report = snaps.restore()
    if state is None:
        if rank == 0 and not report.reason.startswith("no snapshot"):
            print(f"[train_bert] snapshot: not restored: {report.reason}", flush=True)
        return 0, []
    client, tensors = state
    if client["run"] != run_identity(args, world):
        raise SystemExit(f"[train_bert] the snapshot in {snapshot_dir(args, rank)} is of another "
                         f"run ({client['run']}); delete it to start afresh")
    sched.load_state_dict(client["scheduler"])
    torch.set_rng_state(tensors["rng"])  # dropout's stream
    first = client["step"]
    if rank == 0:
        source = ("every rank's own copy" if report.from_buddy == 0
                  else f"{report.from_buddy} ranks' copies sent by their buddies")
        print(f"[train_bert] restored snapshot {report.number} (step {first}) from host memory "
              f"in {report.seconds:.3f} s ({source})", flush=True)
        if args.losses and os.path.exists(args.losses):  # the steps to repeat are logged again
            with open(args.losses) as f:
                kept = [line for line in f if json.loads(line)["step"] < first]
            with open(args.losses, "w") as f:
                f.writelines(kept)
    return first, list(client["losses"])


def take_snapshot(args, snaps, sched, done, losses, rank, world, fault):
    snaps.snapshot({"step": done, "scheduler": sched.state_dict(), "losses": losses,
                    "run": run_identity(args, world)}, {"rng": torch.get_rng_state()})
    if fault == (rank, done, "kill-in-snapshot"):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and done == args.snapshot_every:
        buddy = snaps.buddy()
        where = f"rank 0's buddy: rank {buddy}" if buddy >= 0 else "one host: no buddy copy"
        print(f"[train_bert] snapshot: step {done} in host memory "
              f"({snaps.last_timing().blocking_s:.3f} s blocking; "
              f"{snaps.host_bytes() / 2**20:.2f} MiB of slots per rank; {where}), "
              f"every {args.snapshot_every} steps", flush=True)


# ---- training -------------------------------------------------------------------------------

def train(args, comm):
    rank, world = comm.rank, comm.size
    torch.set_num_threads(args.threads)
    cfg = dict(PRESETS[args.preset])
    tokens = tokenize(corpus_words(args.corpus), cfg["vocab"])
    torch.manual_seed(args.seed)  # shardopt also broadcasts rank 0's initial parameters
    model = BertMLM(dropout=args.dropout, **cfg)

    no_decay = lambda name: name.endswith("bias") or ".ln" in name or name.startswith("ln")
    groups = [
        {"params": [(n, p) for n, p in model.named_parameters() if not no_decay(n)]},
        {"params": [(n, p) for n, p in model.named_parameters() if no_decay(n)],
         "weight_decay": 0.0},
    ]
    opt = shardopt.DistributedOptimizer(groups, "adamw", comm=comm, lr=args.lr,
                                        weight_decay=0.01, stage=args.stage, max_grad_norm=1.0)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (args.steps - s) / (args.steps - warmup))))

    per_rank = args.batch
    losses, times = [], []
    fault = test_fault()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or
                  os.environ.get("SHARDOPT_RESTART") or 0)
    if rank == 0 and restart > 0:
        print(f"[train_bert] restart {restart} of this job", flush=True)
    snaps, first = None, 0
    if args.snapshot_every > 0:
        snaps = shardopt.MemorySnapshots(opt, dir=snapshot_dir(args, rank),
                                         ranks_per_host=args.ranks_per_host, comm=comm)
        first, losses = restore_snapshot(args, snaps, sched, rank, world)
    failed_at = float(os.environ.get("SHARDOPT_FAILED_AT") or 0)  # scripts/shardopt-run
    if rank == 0:
        n = opt.numel
        print(f"BertMLM-{args.preset}: {n:,} parameters (tied decoder counted once), {world} "
              f"ranks ({comm.backend}), ZeRO stage {args.stage}, batch {per_rank}x{world}, "
              f"{len(tokens):,} corpus tokens", flush=True)
    for step in range(first, args.steps):
        if fault in ((rank, step + 1, "kill"), (rank, step + 1, "throw")):
            if fault[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"test fault (BERT_TEST_FAULT): rank {rank} fails before step "
                               f"{step + 1}")
        t0 = time.perf_counter()
        ids, labels = global_batch(tokens, step, per_rank * world, cfg["seq"], args.seed)
        ids, labels = ids[rank * per_rank:(rank + 1) * per_rank], labels[rank * per_rank:(rank + 1) * per_rank]
        lr = opt.param_groups[0]["lr"]  # what this step uses; the scheduler moves it after
        opt.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, cfg["vocab"]), labels.view(-1), ignore_index=-100)
        opt.backward(loss)
        opt.step()
        sched.step()
        mean_loss = loss.detach().reshape(1).clone()
        comm.all_reduce(mean_loss, shardopt.ReduceOp.AVG)  # the global batch's loss
        losses.append(mean_loss.item())
        times.append(time.perf_counter() - t0)
        if snaps is not None and (step + 1) % args.snapshot_every == 0:
            # Before this step's line: snapshot() joins the previous one, so a step printed is
            # never more than K steps ahead of a committed snapshot (at most K repeated).
            take_snapshot(args, snaps, sched, step + 1, losses, rank, world, fault)
        if rank == 0 and args.losses:
            with open(args.losses, "a") as f:
                f.write(f'{{"step": {step}, "loss": {losses[-1]!r}}}\n')
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            s = opt.last_step()
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {lr:.2e}  "
                  f"grad_norm {s.grad_norm:.3f}  {time.perf_counter() - t0:.3f} s/step", flush=True)
        if rank == 0 and failed_at and step == first:
            print(f"[train_bert] recovered: {time.time() - failed_at:.2f} s from the failure to "
                  "the end of the first step after it", flush=True)
    if snaps is not None:
        snaps.wait()
        snaps.remove()  # the job finished: tmpfs gives the memory back
        del snaps

    mem = opt.memory()
    report = torch.tensor([mem.param_bytes, mem.grad_bytes, mem.optimizer_state_bytes,
                           mem.buffer_bytes], dtype=torch.long)
    reports = torch.zeros(world * 4, dtype=torch.long)
    comm.all_gather(report, reports)
    # Every rank must hold the same model: compare a checksum's min and max over ranks.
    checksum = sum(p.detach().double().sum() for p in model.parameters()).reshape(1)
    lo, hi = checksum.clone(), checksum.clone()
    comm.all_reduce(lo, shardopt.ReduceOp.MIN)
    comm.all_reduce(hi, shardopt.ReduceOp.MAX)
    k = min(3, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    ok = lo.item() == hi.item() and (not args.check_loss_decreases or last < first)
    if rank == 0:
        est = shardopt.estimate_model(model, world=world, stage=args.stage)
        for r in range(world):
            p, g, o, b = (v / 2**20 for v in reports[4 * r:4 * r + 4].tolist())
            print(f"rank {r}: params {p:.2f} MiB, grads {g:.2f} MiB, optimizer state {o:.2f} MiB, "
                  f"buffers {b:.2f} MiB (model: {est.device.model_state / 2**20:.2f} MiB)")
        step_s = statistics.median(times[min(3, len(times) - 1):])  # past the warm-up steps
        print(f"loss {first:.4f} -> {last:.4f} (mean of the first/last {k} steps, ln V = "
              f"{math.log(cfg['vocab']):.4f}); ranks hold the same model: {lo.item() == hi.item()}; "
              f"median {step_s:.3f} s/step, {per_rank * world * cfg['seq'] / step_s:,.0f} tokens/s",
              flush=True)
    return ok


def release_then_destroy(dist):
    """shardopt's communicator holds the group's backend: freed first (gc breaks any cycle that
    keeps the optimizer alive), or the backend outlives destroy_process_group() and is destroyed
    at interpreter exit, where torch 2.15's Gloo aborted ("terminate called without an active
    exception") in about one run of three under torchrun."""
    gc.collect()
    dist.destroy_process_group()


def init_torchrun_group(dist):
    """torch.distributed's Gloo group from torchrun's variables (env://), over the store prefixed
    by the restart attempt: torchrun's static rendezvous (--master-addr/--master-port) keeps one
    store across --max-restarts, so a restarted group (or new_group) could otherwise read the dead
    attempt's Gloo addresses and fail to connect ("Connection refused"; torch 2.15)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_serves)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"train_bert/attempt{attempt}", store),
                            rank=rank, world_size=world)


def spawn_worker(rank, args, store):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world_size)
    ok = train(args, shardopt.from_process_group())
    release_then_destroy(dist)
    if not ok:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--corpus", default="/usr/share/common-licenses")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--launcher", choices=["env", "spawn", "torchrun"], default="env",
                    help="env: mpirun/torchrun/one process via shardopt.init_from_env(); "
                         "spawn: --world-size processes over a torch.distributed Gloo group; "
                         "torchrun: torch.distributed's Gloo group from torchrun's variables "
                         "(env://), reused through shardopt.from_process_group()")
    ap.add_argument("--losses", help="rank 0 appends each step's global loss here (JSON lines)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--check-loss-decreases", action="store_true",
                    help="exit 1 unless the loss fell (and, always, unless ranks agree)")
    ap.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                    help="keep the state in host memory every K steps (shardopt.MemorySnapshots) "
                         "and, on start, continue from the newest snapshot there: a job "
                         "restarted by torchrun --max-restarts or scripts/shardopt-run continues "
                         "bitwise (0: no snapshots)")
    ap.add_argument("--snapshot-dir", default="/dev/shm/shardopt-train_bert",
                    help="this host's directory of the snapshots, on tmpfs; one job per "
                         "directory; {host} becomes rank / --ranks-per-host (emulated hosts)")
    ap.add_argument("--ranks-per-host", type=int, default=0,
                    help="ranks per host, so that each rank's buddy copy lands on the next host "
                         "(0: counted from the host names)")
    args = ap.parse_args()
    if args.snapshot_every < 0:
        ap.error(f"--snapshot-every expects K >= 0, got {args.snapshot_every}")
    if args.launcher == "spawn":
        import tempfile

        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(spawn_worker, args=(args, os.path.join(tmp, "store")),
                     nprocs=args.world_size)
        return 0
    if args.launcher == "torchrun":
        import torch.distributed as dist
        init_torchrun_group(dist)
        ok = train(args, shardopt.from_process_group())
        release_then_destroy(dist)
        return 0 if ok else 1
    return 0 if train(args, shardopt.init_from_env()) else 1


if __name__ == "__main__":
    sys.exit(main())
