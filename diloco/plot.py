"""Line plots as PNG files with the standard library only (zlib + struct): benchmarks draw their curves
without a plotting dependency.

    line_plot("b1.png", [Series("data-parallel", xs, ys), ...], log_x=True, x_label="bytes", y_label="loss")

The image has axes, ticks labelled with a built-in 3×5 pixel font, one colour per series and a legend
(colour swatch and label). Drawing is pure (`render` returns the pixel rows); `write_png` does the I/O.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

RGB = tuple[int, int, int]
COLORS: tuple[RGB, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                           (140, 86, 75), (227, 119, 194), (127, 127, 127))
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (225, 225, 225)

# 3×5 glyphs, rows top to bottom, 3 bits each (4 = left pixel)
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0), "+": (0, 2, 7, 2, 0), " ": (0, 0, 0, 0, 0), "=": (0, 7, 0, 7, 0),
    ",": (0, 0, 0, 2, 4), "%": (5, 1, 2, 4, 5), "/": (1, 1, 2, 4, 4), ":": (0, 2, 0, 2, 0), "(": (2, 4, 4, 4, 2),
    ")": (2, 1, 1, 1, 2), "×": (0, 5, 2, 5, 0), "τ": (0, 7, 2, 2, 1), "α": (0, 5, 6, 6, 5),
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (7, 4, 4, 4, 7), "D": (6, 5, 5, 5, 6), "E": (7, 4, 6, 4, 7),
    "F": (7, 4, 6, 4, 4), "G": (7, 4, 5, 5, 7), "H": (5, 5, 7, 5, 5), "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 7),
    "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7), "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (7, 5, 5, 5, 7),
    "P": (7, 5, 7, 4, 4), "Q": (7, 5, 5, 7, 1), "R": (6, 5, 6, 5, 5), "S": (7, 4, 7, 1, 7), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5), "Y": (5, 5, 2, 2, 2),
    "Z": (7, 1, 2, 4, 7),
}


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB, thick: int = 1) -> None:
        """Bresenham, `thick` pixels wide (a square pen)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for a in range(thick):
                for b in range(thick):
                    self.set(x0 + a - thick // 2, y0 + b - thick // 2, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: RGB = BLACK, scale: int = 2) -> None:
        """Upper-case `s` in the 3×5 font at (x, y) (top left); unknown characters are blanks."""
        for k, ch in enumerate(s.upper()):
            for row, bits in enumerate(_FONT.get(ch, _FONT[" "])):
                for col in range(3):
                    if bits & (4 >> col):
                        for a in range(scale):
                            for b in range(scale):
                                self.set(x + (4 * k + col) * scale + a, y + row * scale + b, color)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return 4 * len(s) * scale


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2 or 5 times a power of ten apart)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-2):
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


def render(series: Sequence[Series], *, width: int = 720, height: int = 440, log_x: bool = False,
           x_label: str = "", y_label: str = "") -> Canvas:
    """Draw the series (each a polyline with its points marked) on labelled axes."""
    pts = [(x, y) for s in series for x, y in zip(s.xs, s.ys) if math.isfinite(y) and (x > 0 or not log_x)]
    if not pts:
        raise ValueError("nothing to plot: every series is empty")
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    xs, ys = [fx(x) for x, _ in pts], [y for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad_y = (y1 - y0) * 0.05 or 0.5
    y0, y1 = y0 - pad_y, y1 + pad_y
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    c = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 20, height - 50 - 14 * ((len(series) + 1) // 2)

    def px(v: float) -> int:
        return round(left + (fx(v) - x0) / (x1 - x0) * (right - left))

    def py(v: float) -> int:
        return round(bottom - (v - y0) / (y1 - y0) * (bottom - top))

    for t in nice_ticks(y0, y1):
        c.line(left, py(t), right, py(t), GREY)
        c.text(left - 6 - Canvas.text_width(_label(t)), py(t) - 5, _label(t))
    xticks = [10.0 ** e for e in range(math.ceil(x0), math.floor(x1) + 1)] if log_x else nice_ticks(x0, x1)
    for t in xticks:
        c.line(px(t), top, px(t), bottom, GREY)
        c.text(px(t) - Canvas.text_width(_label(t)) // 2, bottom + 6, _label(t))
    c.line(left, bottom, right, bottom, BLACK)
    c.line(left, top, left, bottom, BLACK)
    c.text((left + right - Canvas.text_width(x_label)) // 2, bottom + 22, x_label)
    c.text(4, 4, y_label)
    for k, s in enumerate(series):
        color = COLORS[k % len(COLORS)]
        line = [(px(x), py(y)) for x, y in zip(s.xs, s.ys) if math.isfinite(y) and (x > 0 or not log_x)]
        for (a, b), (p, q) in zip(line, line[1:]):
            c.line(a, b, p, q, color, thick=2)
        for a, b in line:
            c.line(a - 2, b, a + 2, b, color, thick=2)
        lx = left + (k % 2) * (right - left) // 2
        ly = bottom + 40 + 14 * (k // 2)
        for d in range(8):
            c.line(lx, ly + d, lx + 14, ly + d, color)
        c.text(lx + 20, ly - 1, s.label)
    return c


def write_png(canvas: Canvas, path: str | Path) -> None:
    """An 8-bit RGB PNG (filter 0 on every row)."""
    raw = b"".join(b"\x00" + bytes(canvas.pixels[3 * canvas.width * y:3 * canvas.width * (y + 1)])
                   for y in range(canvas.height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", canvas.width, canvas.height, 8, 2, 0, 0, 0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                           + chunk(b"IEND", b""))


def line_plot(path: str | Path, series: Sequence[Series], *, log_x: bool = False, x_label: str = "",
              y_label: str = "") -> None:
    write_png(render(series, log_x=log_x, x_label=x_label, y_label=y_label), path)
