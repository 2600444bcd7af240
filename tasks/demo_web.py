"""A small web of real photographs on 127.0.0.1, with the ways real web hosts fail, for demos and tests.

The photographs are crops of scikit-image's bundled sample photographs (astronaut, coffee, chelsea,
rocket, ...), rescaled; photo ``i`` is the same image on every machine. Beside them the server has
endpoints for each bad case ingestion must survive::

    /photos/photo-00042.jpg     a photograph (made on first request, then cached under the root)
    /noai/photo-00042.jpg       the same, with ``X-Robots-Tag: noai``
    /redirect/photo-00042.jpg   a 302 to the photograph
    /resized/photo-00042.jpg    the photograph at 85% size, JPEG quality 60 (a near duplicate)
    /slow/photo-00042.jpg       the photograph after ``slow_s`` seconds, or at once after ``release``
    /loop.jpg                   a redirect to itself
    /status/404.jpg             that HTTP status (any code)
    /cut/photo-00042.jpg        the first 60% of the photograph (a truncated image)
    /hangup/photo-00042.jpg     promises the whole photograph, sends half, closes (truncated body)
    /corrupt.jpg  /page.jpg  /empty.jpg  /tiny.png  /wide.jpg  /bomb.png
                                random bytes; an HTML page; an empty body; 8x8 px; 6:1; a PNG of
                                20,000 x 20,000 px (a decompression bomb, 50 kB on the wire)

Run ``python -m tasks.demo_web --output DIR`` for the ``make ingest`` demo: it serves this web, writes a
url list for it and ingests it.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import struct
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vip_core.data.dedup import NearDuplicateIndex, perceptual_hash

SOURCE_PHOTOGRAPHS = (
    "astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "camera", "coins", "moon",
)
# Sample photographs are kept only if no earlier one lies within this Hamming distance of their phash.
DISTINCT_DISTANCE = 12
BAD_PATHS = (
    "/status/404.jpg", "/status/500.jpg", "/loop.jpg", "/corrupt.jpg", "/page.jpg", "/empty.jpg",
    "/tiny.png", "/wide.jpg", "/bomb.png",
)


@functools.lru_cache(maxsize=None)
def _source(name: str) -> np.ndarray:
    from skimage import data

    pixels = getattr(data, name)()  # pixels: [H, W] or [H, W, 3]
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)  # pixels: [H, W, 3]
    return np.ascontiguousarray(pixels[..., :3])


def sample_photo(index: int, max_side: int = 160) -> Image.Image:
    """Photograph ``index``: a random crop of one of the sample photographs, rescaled, maybe mirrored."""
    rng = np.random.default_rng(index)
    pixels = _source(SOURCE_PHOTOGRAPHS[index % len(SOURCE_PHOTOGRAPHS)])  # pixels: [H, W, 3]
    height, width = pixels.shape[:2]
    side = int(min(height, width) * rng.uniform(0.35, 0.8))
    crop_h = min(height, int(side * rng.uniform(0.75, 1.33)))
    top = int(rng.integers(0, height - crop_h + 1))
    left = int(rng.integers(0, width - side + 1))
    image = Image.fromarray(pixels[top : top + crop_h, left : left + side])
    scale = rng.integers(max_side // 2, max_side + 1) / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    image = image.resize(size, Image.LANCZOS, reducing_gap=2.0)
    return image.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else image


def photo_bytes(index: int, max_side: int = 160) -> bytes:
    """Photograph ``index`` as JPEG bytes."""
    buffer = io.BytesIO()
    sample_photo(index, max_side).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def near_duplicate_bytes(jpeg: bytes) -> bytes:
    """The image scaled to 85% and saved again at JPEG quality 60: a near duplicate, not an exact one."""
    with Image.open(io.BytesIO(jpeg)) as image:
        smaller = image.resize((round(image.width * 0.85), round(image.height * 0.85)), Image.BICUBIC)
    buffer = io.BytesIO()
    smaller.save(buffer, format="JPEG", quality=60)
    return buffer.getvalue()


def distinct_photo_indices(count: int, max_side: int = 160) -> list[int]:
    """The first ``count`` photograph indices whose phashes are all more than DISTINCT_DISTANCE apart."""
    index = NearDuplicateIndex(DISTINCT_DISTANCE)
    chosen: list[int] = []
    candidate = 0
    while len(chosen) < count:
        value = perceptual_hash(sample_photo(candidate, max_side))
        if index.find(value) is None:
            index.add(value, str(candidate))
            chosen.append(candidate)
        candidate += 1
    return chosen


def photo_path(index: int) -> str:
    return f"/photos/photo-{index:05d}.jpg"


@functools.lru_cache(maxsize=1)
def _bomb_png(side: int = 20_000) -> bytes:
    """A valid black 1-bit PNG of ``side`` x ``side`` pixels, compressed row by row (about 50 kB)."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte, then the packed bits
    data = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _tiny_png() -> bytes:
    buffer = io.BytesIO()
    sample_photo(0).resize((8, 8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _wide_jpg() -> bytes:
    buffer = io.BytesIO()
    sample_photo(1).resize((300, 50)).save(buffer, format="JPEG")
    return buffer.getvalue()


PAGE = b"<!DOCTYPE html><html><head><title>Not found</title></head><body>Nothing here.</body></html>"


class SampleWeb:
    """The web server. Use :func:`serve_sample_web` for just a URL and a stop function.

    Attributes:
        url: the base URL, ``http://127.0.0.1:PORT``.
        requests: how many times each path was requested.
        slow_s: how long ``/slow/...`` waits before answering.
        release: set it to answer ``/slow/...`` at once.
    """

    def __init__(self, root: str | Path, slow_s: float = 3.0, max_side: int = 160, port: int = 0) -> None:
        self.root = Path(root)
        (self.root / "photos").mkdir(parents=True, exist_ok=True)
        self.slow_s = slow_s
        self.max_side = max_side
        self.release = threading.Event()
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        _bomb_png()  # made before serving, so that it is not a time-out on a loaded machine
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_class(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops serving and frees the port."""
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def count(self, path: str) -> None:
        with self._lock:
            self.requests[path] += 1

    def photo(self, name: str) -> bytes | None:
        """The bytes of ``photo-NNNNN.jpg``, made once and cached under the root."""
        if not (name.startswith("photo-") and name.endswith(".jpg") and name[6:-4].isdigit()):
            return None
        path = self.root / "photos" / name
        if not path.exists():
            partial = path.with_name(f"{name}.{threading.get_ident()}.partial")
            partial.write_bytes(photo_bytes(int(name[6:-4]), self.max_side))
            partial.replace(path)
        return path.read_bytes()


def _handler_class(web: SampleWeb) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            """Quiet."""

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            web.count(self.path)
            try:
                self._route(self.path)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _route(self, path: str) -> None:
            first, _, rest = path.lstrip("/").partition("/")
            fixed: dict[str, Callable[[], None]] = {
                "loop.jpg": lambda: self._redirect(path),
                "corrupt.jpg": lambda: self._send(np.random.default_rng(7).bytes(4000), "image/jpeg"),
                "page.jpg": lambda: self._send(PAGE, "text/html"),
                "empty.jpg": lambda: self._send(b"", "image/jpeg"),
                "tiny.png": lambda: self._send(_tiny_png(), "image/png"),
                "wide.jpg": lambda: self._send(_wide_jpg(), "image/jpeg"),
                "bomb.png": lambda: self._send(_bomb_png(), "image/png"),
            }
            if first in fixed:
                return fixed[first]()
            if first == "status" and rest[:3].isdigit():
                return self.send_error(int(rest[:3]))
            photo = web.photo(rest)
            if photo is None:
                return self.send_error(404)
            if first == "photos":
                return self._send(photo, "image/jpeg")
            if first == "noai":
                return self._send(photo, "image/jpeg", {"X-Robots-Tag": "noai"})
            if first == "redirect":
                return self._redirect(photo_path(int(rest[6:-4])))
            if first == "slow":
                web.release.wait(web.slow_s)
                return self._send(photo, "image/jpeg")
            if first == "resized":
                return self._send(near_duplicate_bytes(photo), "image/jpeg")
            if first == "cut":
                return self._send(photo[: len(photo) * 6 // 10], "image/jpeg")
            if first == "hangup":
                self._send(photo[: len(photo) // 2], "image/jpeg", {"Content-Length": str(len(photo))})
                self.close_connection = True
                return None
            return self.send_error(404)

        def _send(self, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
            headers = {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}
            self.send_response(200)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _redirect(self, location: str) -> None:
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def serve_sample_web(root: str | Path, port: int = 0) -> tuple[str, Callable[[], None]]:
    """Serves the sample web from a thread on ``port`` (0: a free one); returns its base URL and the
    function that stops it."""
    web = SampleWeb(root, port=port)
    return web.url, web.stop


def laion_row(url: str | None, caption: str, *, nsfw: str = "UNLIKELY", similarity: float = 0.32) -> dict:
    """A url-list row with LAION's columns (WIDTH and HEIGHT unknown here)."""
    return {
        "URL": url, "TEXT": caption, "WIDTH": None, "HEIGHT": None,
        "similarity": similarity, "NSFW": nsfw, "LICENSE": "?",
    }


def write_url_list(path: str | Path, rows: list[dict]) -> Path:
    """Writes LAION-style rows as parquet (or csv / jsonl, by the suffix of ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("URL", pa.string()), ("TEXT", pa.string()), ("WIDTH", pa.int64()), ("HEIGHT", pa.int64()),
        ("similarity", pa.float64()), ("NSFW", pa.string()), ("LICENSE", pa.string()),
    ]))
    if path.suffix == ".csv":
        import pyarrow.csv as pa_csv

        pa_csv.write_csv(table, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    else:
        pq.write_table(table, path)
    return path


def write_sample_url_list(path: str | Path, base_url: str, n: int, with_bad_rows: bool = True) -> Path:
    """A LAION-style url list of ``n`` distinct photographs on ``base_url``, and, with ``with_bad_rows``,
    one row per bad case, an exact duplicate, an NSFW-tagged photograph and a row with no URL."""
    indices = distinct_photo_indices(n)
    rows = [laion_row(base_url + photo_path(i), f"sample photograph {i}") for i in indices]
    if with_bad_rows:
        rows += [laion_row(base_url + bad, f"bad case {bad}") for bad in BAD_PATHS]
        rows += [
            laion_row(base_url + photo_path(indices[0]).replace("/photos/", "/noai/"), "noai"),
            laion_row(base_url + photo_path(indices[0]), "an exact duplicate"),
            laion_row(base_url + photo_path(10_000 + indices[-1]), "tagged nsfw", nsfw="NSFW"),
            laion_row(None, "no url"),
        ]
    return write_url_list(path, rows)


def main(argv: list[str] | None = None) -> int:
    """``make ingest`` without a url list: ingest the sample web into ``--output``; prints the stats."""
    from tasks.cli import print_json
    from tasks.ingest import run_ingest
    from vip_core.config import get_preset
    from vip_core.env import configure_environment

    parser = argparse.ArgumentParser(description="Ingest the sample web of photographs (a demo).")
    parser.add_argument("--output", required=True, help="the folder for the clean shards")
    parser.add_argument("--images", type=int, default=48, help="good photographs in the url list")
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args(argv)
    configure_environment()
    output = Path(args.output)
    web = SampleWeb(output.parent / f"{output.name}-web", slow_s=1.0)
    try:
        url_list = write_sample_url_list(output.parent / f"{output.name}-urls.parquet", web.url, args.images)
        started = time.perf_counter()
        stats = run_ingest(get_preset(args.preset), url_list, output)
        stats["seconds"] = round(time.perf_counter() - started, 2)
    finally:
        web.stop()
    print_json(stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
