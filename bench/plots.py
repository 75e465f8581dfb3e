"""PNG plots of a bench report (matplotlib, Agg backend, no display needed):

- ``acceptance_by_position.png``: pooled acceptance per draft position, one line per method;
- ``speedup_by_category.png``: median speed-up vs plain decoding per category, bars per method;
- ``tau_vs_draft_length.png``: measured tau at each method's draft length (markers) and the
  expected tau over draft lengths from its measured per-position acceptance, extended beyond the
  measured depth with Leviathan's constant-alpha form (lines).
"""

from __future__ import annotations

from pathlib import Path

from specfoundry.runtime.adaptive import expected_tokens, leviathan_tokens


def predicted_tau(acc: list[float], alpha: float, k: int) -> float:
    """Expected tokens per forward at draft length ``k``: the measured per-position acceptance up
    to its depth, then constant ``alpha`` (Leviathan et al.) for deeper positions."""
    if k <= len(acc):
        return expected_tokens(acc, k)
    reach = 1.0
    for a in acc:
        reach *= a
    return expected_tokens(acc, len(acc)) + reach * alpha * (leviathan_tokens(alpha, k - len(acc) - 1))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(plt, n: int, width: float = 6.0, height: float = 4.0):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def _legend_or_note(ax) -> None:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafting method", ha="center", transform=ax.transAxes)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_plot(summary: dict, path: Path) -> Path:
    plt = _plt()
    fig, axes = _grid(plt, len(summary))
    for ax, (tkey, block) in zip(axes, summary.items()):
        for name, row in block["overall"].items():
            acc = row["acceptance_by_position"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
        ax.set(title=f"acceptance by draft position ({tkey})", xlabel="draft position", ylabel="P(accept | previous accepted)",
               ylim=(0, 1.05))
        _legend_or_note(ax)
    return _save(plt, fig, path)


def speedup_plot(summary: dict, path: Path) -> Path:
    plt = _plt()
    fig, axes = _grid(plt, len(summary), width=7.0)
    for ax, (tkey, block) in zip(axes, summary.items()):
        cats = list(block["by_category"])
        names = [n for n in block["overall"] if n != "plain"]
        w = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            ys = [(block["by_category"][c].get(name) or {}).get("median_speed_up") or 0.0 for c in cats]
            ax.bar([i + j * w for i in range(len(cats))], ys, width=w, label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))])
        ax.set_xticklabels(cats, rotation=30, ha="right", fontsize=7)
        ax.set(title=f"speed-up vs plain decoding ({tkey})", ylabel="median speed-up (x)")
        if names:
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def tau_plot(summary: dict, methods: list[dict], path: Path) -> Path:
    plt = _plt()
    depth = {m["name"]: m.get("draft_depth") for m in methods}
    fig, axes = _grid(plt, len(summary))
    for ax, (tkey, block) in zip(axes, summary.items()):
        kmax = max([d or 1 for d in depth.values()] + [1]) + 3
        for i, (name, row) in enumerate(block["overall"].items()):
            k = depth.get(name)
            if not k or row["tau"] is None:
                continue
            color = f"C{i % 10}"
            ax.plot([k], [row["tau"]], marker="o", ls="", color=color, label=f"{name} measured")
            acc, alpha = row["acceptance_by_position"], row["alpha"]
            if acc and alpha is not None:
                ks = list(range(0, kmax + 1))
                ys = [predicted_tau(acc, alpha, j) for j in ks]
                ax.plot(ks, ys, ls="--", color=color, alpha=0.7)
        ax.set(title=f"tau vs draft length ({tkey}); dashed: predicted", xlabel="draft length k",
               ylabel="tokens per target forward")
        _legend_or_note(ax)
    return _save(plt, fig, path)


def write_plots(summary: dict, methods: list[dict], out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [acceptance_plot(summary, out_dir / "acceptance_by_position.png"),
            speedup_plot(summary, out_dir / "speedup_by_category.png"),
            tau_plot(summary, methods, out_dir / "tau_vs_draft_length.png")]
