#!/usr/bin/python3
"""Draws the loss curves of a bert_pretrain run: plot_loss.py metrics.jsonl loss.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values, window=20):
    """Trailing moving average (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_eval(ax, evals):
    """Held-out MLM loss, and NSP accuracy against the majority-class baseline."""
    steps = [s for s, _ in evals]
    ax.plot(steps, [e["mlm_loss"] for _, e in evals], "o-", color="C1", label="eval MLM loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.grid(alpha=0.3)
    ax.set_title(f"held-out eval ({evals[-1][1]['instances']} instances)")
    acc = ax.twinx()
    acc.plot(steps, [e["nsp_acc"] for _, e in evals], "s-", color="C2", label="eval NSP accuracy")
    acc.plot(steps, [e["nsp_baseline"] for _, e in evals], ":", color="gray",
             label="NSP majority baseline")
    acc.plot(steps, [e["mlm_acc"] for _, e in evals], "^-", color="C3", label="eval MLM accuracy")
    acc.set_ylim(0, 1)
    acc.set_ylabel("accuracy")
    lines, labels = ax.get_legend_handles_labels()
    lines2, labels2 = acc.get_legend_handles_labels()
    ax.legend(lines + lines2, labels + labels2, loc="center right")


def main(metrics_path, png_path):
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    if not rows:
        sys.exit(f"plot_loss.py: {metrics_path} holds no steps")
    steps = [r["step"] for r in rows]
    evals = [(r["step"], r["eval"]) for r in rows if "eval" in r]
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(18 if evals else 12, 4.5))
    ax, ax_acc = axes[0], axes[1]
    for key, label, color in (("loss", "total", "C0"), ("mlm_loss", "MLM", "C1"),
                              ("nsp_loss", "NSP", "C2")):
        values = [r[key] for r in rows]
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(steps, smooth(values), color=color, label=f"{label} (20-step mean)", linewidth=1.6)
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
    for key, label, color in (("mlm_acc", "MLM accuracy", "C1"), ("nsp_acc", "NSP accuracy", "C2")):
        values = [r[key] for r in rows]
        ax_acc.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        ax_acc.plot(steps, smooth(values), color=color, label=f"{label} (20-step mean)")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(alpha=0.3)
    ax_acc.set_title("accuracy on the masked / NSP labels")
    ax_acc.legend(loc="upper left")
    if evals:
        plot_eval(axes[2], evals)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_loss.py metrics.jsonl loss.png")
    main(sys.argv[1], sys.argv[2])
