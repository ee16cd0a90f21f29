"""A PNG timeline of a simulated schedule, written with the standard library only.

One row per pipeline rank, time to the right; forwards blue, backwards green (an input-gradient
``I`` too), weight-gradient ``W``'s orange (darker for later chunks), idle time light grey; each box carries its microbatch number in a tiny bitmap font.
"""

from __future__ import annotations

import struct
import zlib

# 3 x 5 digit glyphs, one string of five 3-pixel rows per digit.
DIGITS = ["111101101101111", "010110010010111", "111001111100111", "111001111001111",
          "101101111001001", "111100111001111", "111100111101111", "111001001001001",
          "111101111101111", "111101111001111"]
FORWARD = [(66, 133, 244), (25, 80, 190), (10, 45, 120), (5, 25, 80)]
BACKWARD = [(52, 168, 83), (20, 115, 50), (10, 75, 30), (5, 45, 15)]
WEIGHT = [(244, 160, 0), (200, 120, 0), (150, 85, 0), (100, 55, 0)]
IDLE, BACKGROUND, INK = (225, 225, 225), (255, 255, 255), (255, 255, 255)
ROW, GAP, MARGIN = 22, 4, 24


def _text(pixels, x: int, y: int, number: int, scale: int, color) -> None:
    for i, ch in enumerate(str(number)):
        glyph = DIGITS[int(ch)]
        for gy in range(5):
            for gx in range(3):
                if glyph[gy * 3 + gx] == "1":
                    for dy in range(scale):
                        for dx in range(scale):
                            px, py = x + (i * 4 + gx) * scale + dx, y + gy * scale + dy
                            if 0 <= py < len(pixels) and 0 <= px < len(pixels[0]):
                                pixels[py][px] = color


def _png(pixels) -> bytes:
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def timeline_png(slots, path: str) -> None:
    """``slots``: per rank, the ``schedule_plan.Slot`` list that ``simulate`` returns."""
    makespan = max((s.end for rank in slots for s in rank), default=1.0)
    unit = max(4, min(24, int(1600 / makespan)))
    width = MARGIN + int(makespan * unit) + GAP
    height = len(slots) * (ROW + GAP) + GAP
    pixels = [[BACKGROUND] * width for _ in range(height)]
    for rank, rank_slots in enumerate(slots):
        top = GAP + rank * (ROW + GAP)
        _text(pixels, 6, top + 6, rank, 2, (0, 0, 0))
        for y in range(top, top + ROW):
            pixels[y][MARGIN:width - GAP] = [IDLE] * (width - GAP - MARGIN)
        for slot in rank_slots:
            palette = {"F": FORWARD, "W": WEIGHT}.get(slot.action.kind, BACKWARD)
            color = palette[min(slot.action.chunk, len(palette) - 1)]
            x0, x1 = MARGIN + int(slot.start * unit), MARGIN + int(slot.end * unit) - 1
            for y in range(top, top + ROW):
                pixels[y][x0:x1] = [color] * (x1 - x0)
            digits = len(str(slot.action.microbatch))
            scale = 2 if (x1 - x0) >= digits * 8 + 2 else 1
            if (x1 - x0) >= digits * 4 * scale:
                _text(pixels, x0 + 1, top + (ROW - 5 * scale) // 2, slot.action.microbatch,
                      scale, INK)
    with open(path, "wb") as f:
        f.write(_png(pixels))
