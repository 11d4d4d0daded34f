"""PNG charts drawn with Pillow (already installed with SGLang; no plotting library needed):
the held-out curves of a run and the bars of `marsrl bench learning`."""
from __future__ import annotations

from pathlib import Path

COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127))
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 900, 520, 70, 230, 40, 50


def _canvas(title: str):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(image)
    draw.text((_LEFT, 12), title, fill="black")
    return image, draw


def _axes(draw, y_max: float) -> None:
    x0, x1, y0, y1 = _LEFT, _W - _RIGHT, _H - _BOTTOM, _TOP
    draw.line([(x0, y1), (x0, y0), (x1, y0)], fill="black")
    for i in range(5):
        value = y_max * i / 4
        y = y0 - (y0 - y1) * i / 4
        draw.line([(x0 - 4, y), (x0, y)], fill="black")
        draw.line([(x0 + 1, y), (x1, y)], fill=(230, 230, 230))
        draw.text((8, y - 6), f"{value:.2f}", fill="black")


def _legend(draw, names: list[str]) -> None:
    for i, name in enumerate(names):
        y = _TOP + 18 * i
        draw.rectangle([(_W - _RIGHT + 15, y + 3), (_W - _RIGHT + 27, y + 13)], fill=COLORS[i % len(COLORS)])
        draw.text((_W - _RIGHT + 33, y + 2), name, fill="black")


def line_chart(series: dict[str, list[tuple[float, float]]], path: str | Path, *, title: str,
               x_label: str = "step", bands: dict[str, list[tuple[float, float, float]]] | None = None) -> Path:
    """One line (with dots) per named series of (x, y) points, y from 0 to at least 1; `bands`
    (x, low, high) per series name are drawn behind its line in a light shade of its colour."""
    from PIL import Image, ImageDraw

    bands = bands or {}
    image, draw = _canvas(title)
    points = [p for pts in series.values() for p in pts]
    x_lo, x_hi = min((x for x, _ in points), default=0.0), max((x for x, _ in points), default=1.0)
    y_max = max([1.0] + [y for _, y in points] + [h for band in bands.values() for _, _, h in band])
    _axes(draw, y_max)

    def at(x: float, y: float) -> tuple[float, float]:
        span = (x_hi - x_lo) or 1.0
        return (_LEFT + (_W - _RIGHT - _LEFT) * (x - x_lo) / span, _H - _BOTTOM - (_H - _BOTTOM - _TOP) * y / y_max)

    overlay = Image.new("RGBA", image.size, (255, 255, 255, 0))
    shade = ImageDraw.Draw(overlay)
    for i, name in enumerate(series):
        band = sorted(bands.get(name, []))
        if band:  # a polygon along the upper ends and back along the lower ones (a bar for one x)
            edge = [at(x, h) for x, _, h in band] + [at(x, lo) for x, lo, _ in reversed(band)]
            if len(band) == 1:
                (x, y_hi), (_, y_lo) = edge
                edge = [(x - 4, y_hi), (x + 4, y_hi), (x + 4, y_lo), (x - 4, y_lo)]
            shade.polygon(edge, fill=(*COLORS[i % len(COLORS)], 50))
    image.paste(overlay, mask=overlay)
    for i, pts in enumerate(series.values()):
        color = COLORS[i % len(COLORS)]
        xy = [at(x, y) for x, y in sorted(pts)]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=2)
        for x, y in xy:
            draw.ellipse([(x - 3, y - 3), (x + 3, y + 3)], fill=color)
    for x in sorted({x for x, _ in points}):
        px, _ = at(x, 0)
        draw.text((px - 8, _H - _BOTTOM + 6), f"{x:g}", fill="black")
    draw.text(((_LEFT + _W - _RIGHT) / 2 - 10, _H - 20), x_label, fill="black")
    _legend(draw, list(series))
    image.save(path)
    return Path(path)


def bar_chart(groups: dict[str, dict[str, tuple[float, float]]], path: str | Path, *, title: str) -> Path:
    """Grouped bars: for each group (a metric) one bar per name (a variant) of height mean,
    with a +-std whisker; `groups[metric][variant] = (mean, std)`."""
    image, draw = _canvas(title)
    names = list(dict.fromkeys(n for bars in groups.values() for n in bars))
    y_max = max([1.0] + [m + s for bars in groups.values() for m, s in bars.values()])
    _axes(draw, y_max)
    width = (_W - _RIGHT - _LEFT) / max(len(groups), 1)
    bar = width * 0.8 / max(len(names), 1)
    for g, (metric, bars) in enumerate(groups.items()):
        left = _LEFT + g * width + width * 0.1
        for i, name in enumerate(names):
            if name not in bars:
                continue
            mean, std = bars[name]
            x = left + i * bar

            def y_of(v: float) -> float:
                return _H - _BOTTOM - (_H - _BOTTOM - _TOP) * max(v, 0.0) / y_max

            draw.rectangle([(x, y_of(mean)), (x + bar - 2, _H - _BOTTOM)], fill=COLORS[i % len(COLORS)])
            mid = x + bar / 2 - 1
            draw.line([(mid, y_of(mean - std)), (mid, y_of(mean + std))], fill="black")
        draw.text((left, _H - _BOTTOM + 6), metric, fill="black")
    _legend(draw, names)
    image.save(path)
    return Path(path)
