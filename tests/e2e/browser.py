"""A headless Chromium driven over the DevTools protocol through a pipe (``--remote-debugging-
pipe``: JSON messages ending in NUL on fds 3 and 4, as Playwright and Puppeteer drive it), for
the tests of the server's chat page. ``chromium()`` finds the Debian package's browser, or
installs it (as root, with apt-get) where it is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path


def chromium() -> str | None:
    """The browser's path; installed from Debian's packages if missing and possible."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                       capture_output=True, timeout=900, check=False)
        found = shutil.which("chromium")
    return found


class Browser:
    """One headless browser; ``open`` a page and ``evaluate`` JavaScript in it."""

    def __init__(self, executable: str, profile: Path) -> None:
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()

        def pipes() -> None:  # the browser reads fd 3 and writes fd 4
            os.dup2(commands_r, 3)
            os.dup2(replies_w, 4)

        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pipes,
            close_fds=False)
        os.close(commands_r)
        os.close(replies_w)
        self._buffer, self._next_id, self._session = b"", 0, None

    def call(self, method: str, params: dict | None = None, timeout_s: float = 60) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            assert time.monotonic() < deadline, f"no answer to {method}"
            chunk = os.read(self._replies, 1 << 16)
            assert chunk, "the browser closed its pipe"
            self._buffer += chunk

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        self._session = self.call("Target.attachToTarget",
                                  {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60):
        """``expression``'s value once it is truthy."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"never true: {expression}"
            time.sleep(0.1)
        return value

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._commands)
        os.close(self._replies)
