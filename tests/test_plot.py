"""PNG line plots without a plotting library: the file is a valid PNG that shows what was drawn."""

from __future__ import annotations

import struct
import zlib

import pytest

from diloco.plot import BLACK, COLORS, WHITE, Canvas, Series, line_plot, nice_ticks, render

pytestmark = pytest.mark.unit


def _read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB PNG whose rows use filter 0 (what write_png writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (3 * w + 1):(y + 1) * (3 * w + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_a_plot_is_a_valid_png_with_every_series_drawn(tmp_path):
    path = tmp_path / "p.png"
    line_plot(path, [Series("A", [1, 2, 3], [3.0, 2.0, 1.0]), Series("B", [1, 3], [1.0, 3.0])],
              x_label="TOKENS", y_label="LOSS")
    w, h, rows = _read_png(path.read_bytes())
    assert (w, h) == (720, 440)
    pixels = {bytes(r[i:i + 3]) for r in rows for i in range(0, len(r), 3)}
    assert {bytes(COLORS[0]), bytes(COLORS[1]), bytes(BLACK), bytes(WHITE)} <= pixels


def test_points_land_where_the_axes_say():
    c = render([Series("A", [0, 10], [0.0, 10.0])], width=300, height=200)
    # the first point is drawn at the lower left of the plot area, the last at the upper right
    def color(x: int, y: int) -> tuple[int, ...]:
        i = 3 * (y * c.width + x)
        return tuple(c.pixels[i:i + 3])
    lit = [(x, y) for y in range(c.height) for x in range(c.width) if color(x, y) == COLORS[0]]
    xs, ys = [x for x, _ in lit if x > 60], [y for x, y in lit if x > 60]  # skip the legend swatch
    assert min(xs) <= 72 and max(xs) >= 278  # spans the plot area (left edge 70, right 280)
    assert min(ys) <= 35  # reaches the top (with 5% padding)


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(1.6, 2.6) == pytest.approx([1.6, 1.8, 2.0, 2.2, 2.4, 2.6])
    assert nice_ticks(3, 3) == [3]


def test_text_uses_the_built_in_font():
    c = Canvas(40, 20)
    c.text(0, 0, "1", scale=1)
    lit = {(x, y) for y in range(5) for x in range(3) if c.pixels[3 * (y * 40 + x)] == 0}
    assert lit == {(1, 0), (0, 1), (1, 1), (1, 2), (1, 3), (0, 4), (1, 4), (2, 4)}  # the glyph "1"


def test_nothing_to_plot_is_an_error():
    with pytest.raises(ValueError, match="nothing to plot"):
        render([Series("A", [], [])])
