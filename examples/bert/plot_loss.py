#!/usr/bin/python3
"""Draws the loss curves of a bert_pretrain run: plot_loss.py metrics.jsonl loss.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(metrics_path, png_path):
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    if not rows:
        sys.exit(f"plot_loss.py: {metrics_path} holds no steps")
    steps = [r["step"] for r in rows]
    fig, (ax, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("loss", "total"), ("mlm_loss", "MLM"), ("nsp_loss", "NSP")):
        ax.plot(steps, [r[key] for r in rows], label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("BERT pretraining loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in rows], color="gray", linestyle=":", label="lr")
    lr_ax.set_ylabel("learning rate", color="gray")
    lines, labels = ax.get_legend_handles_labels()
    lines2, labels2 = lr_ax.get_legend_handles_labels()
    ax.legend(lines + lines2, labels + labels2, loc="upper right")
    ax_acc.plot(steps, [r["mlm_acc"] for r in rows], label="MLM accuracy")
    ax_acc.plot(steps, [r["nsp_acc"] for r in rows], label="NSP accuracy")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_loss.py metrics.jsonl loss.png")
    main(sys.argv[1], sys.argv[2])
