"""Plots for the paper's figures: matplotlib on the Agg backend, one shared style.

Every figure a `dualpath reproduce` id writes goes through here, so they all look alike: one
colour and label per mode (the paper's names), labelled axes with units, a legend, and the
paper's value drawn as a dashed line or a hollow marker where the paper gives one. Nothing here
reads a run; callers pass numbers.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DPI = 130
SIZE = (6.4, 4.2)  # inches: a half-page report figure

# The paper's systems and our ablation steps, in the paper's order and names.
MODE_LABELS = {
    "basic": "Basic",
    "layerwise": "+Layerwise",
    "dualpath-rr": "+DualPath (round-robin)",
    "dualpath": "DualPath",
    "dualpath-split": "DualPath (split reads)",
    "oracle": "Oracle (no I/O)",
}
MODE_COLORS = {
    "basic": "#4c72b0",
    "layerwise": "#8172b3",
    "dualpath-rr": "#dd8452",
    "dualpath": "#c44e52",
    "dualpath-split": "#937860",
    "oracle": "#55a868",
}
PAPER_COLOR = "#222222"
SLO_COLOR = "#999999"


def label(mode: str) -> str:
    return MODE_LABELS.get(mode, mode)


def color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#777777")


def new_figure(title: str, xlabel: str, ylabel: str, size: tuple[float, float] = SIZE):
    """A figure with one axis, its title and labelled axes (units belong in the labels)."""
    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8})
    fig, ax = plt.subplots(figsize=size, dpi=DPI)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def grouped_bars(ax, groups: Sequence[str], series: dict[str, Sequence[float | None]],
                 value_fmt: str = "{:.1f}", annotate: bool = True) -> dict[str, list]:
    """Bars of each series (a mode) side by side in each group; None leaves a gap marked n/a.
    Returns the bar containers per series."""
    n = max(len(series), 1)
    width = 0.8 / n
    out = {}
    for i, (mode, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        hs = [v if v is not None else 0.0 for v in vals]
        bars = ax.bar(xs, hs, width * 0.95, label=label(mode), color=color(mode))
        out[mode] = list(bars)
        if annotate:
            for x, v in zip(xs, vals):
                ax.annotate("n/a" if v is None else value_fmt.format(v), (x, v or 0.0), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.margins(y=0.15)
    return out


def mode_line(ax, xs: Sequence[float], ys: Sequence[float | None], mode: str, marker: str = "o",
              band: tuple[Sequence[float], Sequence[float]] | None = None, **kw) -> None:
    """One mode's curve; points that are None are left out. `band`: (low, high) shaded around it."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if not pts:
        return
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color(mode), label=label(mode), **kw)
    if band is not None:
        lo = [(x, a, b) for x, a, b in zip(xs, band[0], band[1]) if a is not None and b is not None]
        if lo:
            ax.fill_between([p[0] for p in lo], [p[1] for p in lo], [p[2] for p in lo], color=color(mode), alpha=0.15)


def paper_hline(ax, y: float, text: str, color_: str = PAPER_COLOR) -> None:
    """The paper's value as a dashed horizontal line, labelled in the legend."""
    ax.axhline(y, ls="--", lw=1, color=color_, label=text)


def slo_hline(ax, y: float, text: str) -> None:
    ax.axhline(y, ls=":", lw=1.2, color=SLO_COLOR, label=text)


def paper_points(ax, xs: Sequence[float], ys: Sequence[float], text: str, marker: str = "D") -> None:
    """The paper's values as hollow markers."""
    ax.scatter(list(xs), list(ys), marker=marker, facecolors="none", edgecolors=PAPER_COLOR, s=40, zorder=5,
               label=text)


def interval_bars(ax, xs: Sequence[float], ys: Sequence[float | None],
                  cis: Sequence[Sequence[float] | None], label: str | None = "95 % interval") -> bool:
    """Error bars from each value's interval (asymmetric; none where a value has no interval);
    whether it drew any."""
    pts = [(x, y, ci) for x, y, ci in zip(xs, ys, cis) if y is not None and ci]
    if pts:
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[max(0.0, p[1] - p[2][0]) for p in pts],
                                                                    [max(0.0, p[2][1] - p[1]) for p in pts]],
                    fmt="none", ecolor="black", capsize=4, lw=1, label=label, zorder=6)
    return bool(pts)


def note(ax, text: str) -> None:
    """A small note in the lower left corner of the axis (the scale-down, a caveat)."""
    ax.text(0.01, 0.01, text, transform=ax.transAxes, fontsize=7, color="#555555", va="bottom", ha="left",
            wrap=True)


def legend(ax, loc: str = "best", ncol: int = 1) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc=loc, framealpha=0.9, ncol=ncol)


def legend_below(ax, ncol: int = 2) -> None:
    """The legend under the axis, outside the data (for crowded panels)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, framealpha=0.9)


def caption(fig, text: str) -> None:
    """A caption under everything else in the figure (the scale-down, a caveat); placed by save()."""
    fig._dp_caption = text


def finish(fig, ax, path: Path, caption_text: str | None = None, ncol: int = 2) -> str:
    """The common end of a panel: grid, the legend below, the caption, saved; returns the file name."""
    ax.grid(True, axis="both", alpha=0.3)
    legend_below(ax, ncol=ncol)
    if caption_text:
        caption(fig, caption_text)
    return save(fig, path).name


def save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = getattr(fig, "_dp_caption", None)
    if text:  # under the lowest thing drawn (axis labels, a legend below the axis), wrapped to the width
        fig.canvas.draw()
        bb = fig.get_tightbbox(fig.canvas.get_renderer())
        w, h = fig.get_figwidth(), fig.get_figheight()
        fig.text(max(bb.x0, 0) / w, bb.y0 / h - 0.015, textwrap.fill(text, int(w * 17)), fontsize=7,
                 color="#444444", ha="left", va="top")
    fig.savefig(path, format="png", bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def is_png(path: Path, min_bytes: int = 2000) -> bool:
    """A PNG file (by its signature) of a non-trivial size."""
    p = Path(path)
    try:
        head = p.read_bytes()[:8]
    except OSError:
        return False
    return head == PNG_SIGNATURE and p.stat().st_size >= min_bytes


def cpu_profile_bars(by_role_and_activity: dict[str, dict[str, float]], emulated_s: float,
                     floor_s: float | None, path: Path, caption_text: str) -> str:
    """`dualpath profile run`: CPU seconds per emulated second, one bar per process role split by
    activity, and the run's physical floor as a dashed line."""
    roles = sorted(by_role_and_activity, key=lambda r: -sum(by_role_and_activity[r].values()))
    acts = sorted({a for row in by_role_and_activity.values() for a in row},
                  key=lambda a: -sum(row.get(a, 0.0) for row in by_role_and_activity.values()))
    fig, ax = new_figure("Where the run's CPU goes", "CPU seconds per emulated second", "",
                         size=(7.2, 0.45 * len(roles) + 2.2))
    ax.grid(True, axis="x", alpha=0.3)
    cmap = plt.get_cmap("tab20")
    left = [0.0] * len(roles)
    for i, act in enumerate(acts):
        widths = [by_role_and_activity[r].get(act, 0.0) / emulated_s for r in roles]
        ax.barh(roles, widths, left=left, color=cmap(i % 20), label=act)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    if floor_s:
        ax.axvline(floor_s / emulated_s, color=PAPER_COLOR, linestyle="--", linewidth=1,
                   label=f"the whole run's physical floor ({floor_s / emulated_s:.3g})")
    legend_below(ax, ncol=3)
    caption(fig, caption_text)
    return save(fig, path).name
