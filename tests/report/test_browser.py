"""The page in a real browser: headless Chromium opens a two-run report, takes a screenshot, and every chart
must have rendered where the page puts it, with no console error and no network request.

Skips, saying why, when no Chromium is installed (Debian/Ubuntu: `apt-get install chromium`); `.ci/run` installs it
when it runs as root with apt."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from kiln.config import Config
from kiln.report import write_report
from tests.report.browser import find_chromium, visit
from tests.report.fake import steps_run
from tests.report.test_report import EVERY_EVENT

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (chromium, chromium-browser or "
                                                         "google-chrome); install it: apt-get install chromium")


def test_report_renders_in_headless_chromium(tmp_path):
    b = Config()
    b.optim.lr = 6e-3
    profile = {"step_s": 0.25, "breakdown": {"data": 0.01, "forward": 0.08, "backward": 0.12}, "verdict": "compute-bound",
               "advice": ["raise the micro-batch"]}
    runs = [steps_run(tmp_path, "lr2e-3", numerics=EVERY_EVENT, profile=profile),
            steps_run(tmp_path, "lr6e-3", config=b)]
    out, report = write_report(runs, tmp_path / "report.html")

    v = visit(out)
    (tmp_path / "screenshot.png").write_bytes(v.png)  # kept for a person looking at a failure
    assert v.errors == [], v.errors
    shot = np.asarray(Image.open(io.BytesIO(v.png)).convert("RGB")).astype(np.int16)
    assert shot.shape[0] == v.height and shot.shape[1] == 1320
    expected = [c.key for c in report.charts] + ["memory", "profile"]
    assert [f["key"] for f in v.figures] == expected
    for f in v.figures:
        assert f["complete"] and f["natural"] > 0, f  # the image decoded
        assert f["w"] >= 400 and f["h"] >= 150, f  # and was laid out at a readable size
        x0, y0 = int(f["x"]), int(f["y"])
        region = shot[y0:y0 + int(f["h"]), x0:x0 + int(f["w"])]
        assert region.shape[:2] == (int(f["h"]), int(f["w"])), f  # inside the screenshot
        ink = (np.abs(region - 255).sum(axis=2) > 60).mean()  # share of pixels that are not near-white
        colours = len(np.unique(region.reshape(-1, 3) // 16, axis=0))
        assert ink > 0.02 and colours >= 6, (f["key"], ink, colours)
    # it prints: a PDF of a few pages (each chart is kept whole on a page by the print CSS)
    pages = v.pdf.count(b"/Type /Page") - v.pdf.count(b"/Type /Pages")
    assert v.pdf.startswith(b"%PDF") and 2 <= pages <= 12, pages
    # two charts never overlap: the grid laid them out
    boxes = [(f["x"], f["y"], f["x"] + f["w"], f["y"] + f["h"]) for f in v.figures]
    for i, a in enumerate(boxes):
        for b_ in boxes[i + 1:]:
            assert a[2] <= b_[0] or b_[2] <= a[0] or a[3] <= b_[1] or b_[3] <= a[1], (a, b_)
