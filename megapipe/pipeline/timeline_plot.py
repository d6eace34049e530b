"""Draw a `Timeline` as a PNG: ranks as rows, one colour per micro-batch, the bubble left empty.

Forward boxes are a light tint of their micro-batch's colour, backward boxes the full colour, and
a zero-bubble schedule's weight-gradient passes (W) a dark shade of it, so a micro-batch's parts
pair up at a glance. Transfers are thin grey bars along the bottom
of a row. matplotlib is imported here only (object API with the Agg canvas: no pyplot, no
global backend switch), so the rest of megapipe never needs it.
"""

from __future__ import annotations

import os

from megapipe.atomic_files import atomic_write
from megapipe.errors import ConfigError
from megapipe.pipeline.timeline import Timeline

FONT_PT = 8.0
SMALL_FONT_PT = 6.5  # for labels that do not fit at FONT_PT
ROW_HEIGHT = 0.8  # of one row's unit height; the rest separates the rows
COMM_HEIGHT = 0.12
LIGHTEN = 0.55  # forward colour = this much white mixed into the micro-batch colour
DARKEN = 0.45  # W colour = this much black mixed into the micro-batch colour


def _mix(rgb: tuple[float, ...], white: float) -> tuple[float, float, float]:
    r, g, b = rgb[:3]
    return (r + (1 - r) * white, g + (1 - g) * white, b + (1 - b) * white)


def _dark(rgb: tuple[float, ...]) -> tuple[float, float, float]:
    r, g, b = rgb[:3]
    return (r * (1 - DARKEN), g * (1 - DARKEN), b * (1 - DARKEN))


def _text_colour(rgb: tuple[float, ...]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "#1a1a1a" if luminance > 0.55 else "white"


def _palette(n: int) -> list[tuple[float, ...]]:
    """Distinct colours, without tab10's grey (kept for transfers and the legend)."""
    from matplotlib import colormaps

    if n <= 9:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)[:n]]
    cmap = colormaps["tab20"]
    colours = [cmap(i) for i in range(cmap.N) if i not in (14, 15)]
    return [colours[i % len(colours)] for i in range(n)]


def _label_size(label: str, box_width_pt: float) -> float | None:
    """The font size at which `label` fits inside a box this wide, or None."""
    for size in (FONT_PT, SMALL_FONT_PT):
        if box_width_pt >= len(label) * 0.62 * size + 2:
            return size
    return None


def draw_timeline(timeline: Timeline, path: str, *, width_in: float = 14.0, dpi: int = 130) -> None:
    """Write `timeline` at `path` in the format its suffix names, PNG without one (atomically:
    a temporary file, then a rename)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    p = timeline.num_ranks
    bottom_in, top_in = 0.85, 0.6  # x label and legend below, two-line title above
    height_in = bottom_in + top_in + 0.5 * p
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.07, bottom_in / height_in, 0.91, 1 - (bottom_in + top_in) / height_in))
    origin = min(b.start for b in timeline.boxes)
    span = timeline.makespan
    axes_width_pt = width_in * 0.91 * 72
    palette = _palette(timeline.num_microbatches)

    for rank in range(p):
        ax.axhspan(rank - 0.5, rank + 0.5, color="#f6f6f6" if rank % 2 else "white", zorder=0)
    for box in timeline.boxes:
        x, w = box.start - origin, box.duration
        if box.kind == "comm":
            y = box.rank + ROW_HEIGHT / 2 - COMM_HEIGHT
            ax.add_patch(Rectangle((x, y), w, COMM_HEIGHT, color="#9a9a9a", lw=0, zorder=2))
            continue
        base = palette[box.microbatch % len(palette)]
        face = {"F": _mix(base, LIGHTEN), "W": _dark(base)}.get(box.kind, base[:3])
        ax.add_patch(
            Rectangle(
                (x, box.rank - ROW_HEIGHT / 2),
                w,
                ROW_HEIGHT - COMM_HEIGHT,
                facecolor=face,
                edgecolor="white",
                lw=0.6,
                zorder=3,
            )
        )
        label = box.label(timeline.num_chunks)
        size = _label_size(label, w / span * axes_width_pt)
        if size:
            ax.text(
                x + w / 2,
                box.rank - COMM_HEIGHT / 2,
                label,
                ha="center",
                va="center",
                fontsize=size,
                color=_text_colour(face),
                zorder=4,
            )

    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    unit = timeline.time_unit
    ax.set_xlabel(
        f"time ({unit})" if unit else "simulated time (one micro-batch's forward on one rank = 1)"
    )
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(timeline.title, fontsize=10, loc="left")
    grey = (0.45, 0.45, 0.45)
    handles = [
        Patch(facecolor=_mix(grey, LIGHTEN), label="forward (light)"),
        Patch(facecolor=grey, label="backward (dark)"),
        Patch(facecolor="white", edgecolor="#bbbbbb", label="empty: bubble / waiting"),
    ]
    if any(b.kind == "W" for b in timeline.boxes):
        handles[1] = Patch(facecolor=grey, label="B: input gradient (full)")
        handles.insert(2, Patch(facecolor=_dark(grey), label="W: weight gradient (dark)"))
    if any(b.kind == "comm" for b in timeline.boxes):
        handles.append(Patch(facecolor="#9a9a9a", label="communication (incl. waiting on a peer)"))
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=len(handles),
        fontsize=FONT_PT,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    _save_png(fig, path)


def image_format(path: str) -> str:
    """The image format `path`'s suffix names (png without one); ConfigError for a suffix
    matplotlib cannot write, before anything is drawn."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = os.path.splitext(path)[1][1:].lower()
    if not suffix:
        return "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if suffix not in known:
        raise ConfigError(
            f"--output {path}: matplotlib writes no .{suffix} files; use one of "
            f"{', '.join('.' + name for name in sorted(known))}"
        )
    return suffix


def _save_png(fig, path: str) -> None:
    """Write the figure in the format the suffix names (PNG without one)."""
    fmt = image_format(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as temp, open(temp, "wb") as f:
        fig.savefig(f, format=fmt)
