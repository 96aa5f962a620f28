"""Plots a ``bench_load.py`` report: tokens/s against batch size of target-only decoding, fixed
block-16 DFlash and adaptive DFlash, one panel per context and acceptance level (tau@16), and below
them the block-16 DFlash step's cost in target-only steps per batch. Needs matplotlib: without it,
says so and writes nothing.

    python3 bench/plot_load.py bench/results/load.json --png docs/load.png
"""

from __future__ import annotations

import argparse
import json

MODES = (("target_only", "target-only", "0.45"), ("fixed", "DFlash, block 16", "tab:blue"),
         ("adaptive", "DFlash, adaptive", "tab:orange"))


def plot(report: dict, png: str) -> bool:
    """Writes the figure of ``report`` to ``png``; False (and a message) without matplotlib or results."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark machine
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install matplotlib; then bench/plot_load.py JSON --png {png})")
        return False
    results = [e for e in report["results"] if "error" not in e]
    if not results:
        print("plot skipped: the report has no results")
        return False
    # A context's rows, apart from its rows with a drafter context window (their own panel row).
    panel_row = lambda e: (e["context"], e.get("window") or 0)  # noqa: E731
    contexts = sorted({panel_row(e) for e in results})
    name = lambda c: f"context {c[0]}" + (f", window {c[1]}" if c[1] else "")  # noqa: E731
    taus = sorted({lv["tau16"] for e in results for lv in e["levels"]})
    fig, axes = plt.subplots(len(contexts) + 1, len(taus), figsize=(4.2 * len(taus), 3.4 * (len(contexts) + 1)),
                             squeeze=False)
    for row, context in enumerate(contexts):
        entries = sorted((e for e in results if panel_row(e) == context), key=lambda e: e["batch"])
        for col, tau in enumerate(taus):
            ax = axes[row][col]
            if not any(lv["tau16"] == tau for e in entries for lv in e["levels"]):
                ax.axis("off")
                continue
            for key, label, color in MODES:
                points = [(e["batch"], lv[key]["tok_s"]) for e in entries for lv in e["levels"] if lv["tau16"] == tau]
                ax.plot(*zip(*points), marker="o", label=label, color=color)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name(context)}, tau@16 = {tau:g}", fontsize=10)
            ax.set_xlabel("batch")
            ax.set_ylabel("tokens/s")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    ax = axes[-1][0]
    for context in contexts:
        points = sorted((e["batch"], e["dflash_step_ratio"]["16"]) for e in results
                        if panel_row(e) == context and "16" in e["dflash_step_ratio"])
        if points:
            ax.plot(*zip(*points), marker="o", label=name(context))
    ax.set_xscale("log", base=2)
    ax.set_title("block-16 DFlash step / target-only step", fontsize=10)
    ax.set_xlabel("batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    for ax in axes[-1][1:]:
        ax.axis("off")
    shapes = "tiny" if report.get("config", {}).get("tiny") else "Qwen3-8B"
    fig.suptitle(f"{shapes} shapes, synthetic drafter of known acceptance ({report.get('device', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"plot written to {png}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="a bench_load.py --json report")
    ap.add_argument("--png", required=True, help="the figure to write")
    args = ap.parse_args()
    with open(args.report) as f:
        plot(json.load(f), args.png)


if __name__ == "__main__":
    main()
