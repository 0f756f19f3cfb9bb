"""Headless Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe): no driver, no websocket
library. Opens a page, collects console messages, errors and failed loads, measures where the chart images are,
and takes a full-page screenshot.

    python -m tests.report.browser PAGE.html SHOT.png [WIDTH]     (how docs/report-screenshot.png was taken)
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-pipe"]
FIGURES_JS = """JSON.stringify({height: document.documentElement.scrollHeight, figures: [...document.querySelectorAll(
  'figure.chart')].map(f => { const img = f.querySelector('img'); const r = img.getBoundingClientRect();
  return {key: f.dataset.chart, x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height,
          natural: img.naturalWidth, complete: img.complete}; })})"""


def find_chromium() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


@dataclass
class Visit:
    png: bytes  # the whole page
    height: int
    figures: list[dict]  # per chart image: key, x, y, w, h (CSS px), natural (decoded width), complete
    console: list[dict] = field(default_factory=list)  # every console message and log entry: level, text
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, failed loads
    pdf: bytes = b""  # the page printed (Letter, the browser's print layout)


class _Pipe:
    def __init__(self, binary: str, profile: str):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire():  # the browser reads commands on fd 3 and writes replies on fd 4
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=wire, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf, self._id, self.events = b"", 0, []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def visit(page: Path, width: int = 1320, binary: str | None = None) -> Visit:
    binary = binary or find_chromium()
    if binary is None:
        raise FileNotFoundError("no Chromium found")
    with tempfile.TemporaryDirectory(prefix="kiln-chromium-") as profile:
        pipe = _Pipe(binary, profile)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                              "mobile": False}, session=session)
            pipe.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            pipe.wait_for("Page.loadEventFired")
            result = pipe.send("Runtime.evaluate", {"expression": FIGURES_JS, "returnByValue": True}, session=session)
            layout = json.loads(result["result"]["value"])
            height = int(layout["height"])
            shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {
                "x": 0, "y": 0, "width": width, "height": height, "scale": 1}}, session=session)
            v = Visit(base64.b64decode(shot["data"]), height, layout["figures"])
            pdf = pipe.send("Page.printToPDF", {"printBackground": True}, session=session)
            v.pdf = base64.b64decode(pdf["data"])
            for e in pipe.events:
                method, params = e.get("method"), e.get("params", {})
                if method == "Runtime.consoleAPICalled":
                    text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                    v.console.append({"level": params.get("type"), "text": text})
                    if params.get("type") in ("error", "assert"):
                        v.errors.append(f"console.{params.get('type')}: {text}")
                elif method == "Log.entryAdded":
                    entry = params.get("entry", {})
                    v.console.append({"level": entry.get("level"), "text": entry.get("text")})
                    if entry.get("level") == "error":
                        v.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")
                elif method == "Runtime.exceptionThrown":
                    v.errors.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
                elif method == "Network.loadingFailed":
                    v.errors.append(f"failed load: {params.get('errorText')}")
                elif method == "Network.requestWillBeSent":
                    url = params.get("request", {}).get("url", "")
                    if not url.startswith(("file:", "data:", "about:")):
                        v.errors.append(f"network request at view time: {url}")
            return v
        finally:
            pipe.close()


if __name__ == "__main__":
    html, out = Path(sys.argv[1]), Path(sys.argv[2])
    result = visit(html, int(sys.argv[3]) if len(sys.argv) > 3 else 1320)
    if result.errors:
        sys.exit("\n".join(result.errors))
    out.write_bytes(result.png)
    print(f"{out}: {len(result.png):,} bytes, page height {result.height} px, {len(result.figures)} charts")
