"""Fixtures of the application's tests: Debian's Chromium and PostgreSQL (installed by ``make system-deps``
when missing), the Prefect and MLflow servers on free ports of 127.0.0.1, and a headless Chromium driven
through chromedriver (``browser``) or Playwright (``page``, Debian's Chromium: no browser download)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from flows.app import servers

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000",
)


def _missing_system_programs() -> list[str]:
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        missing.append("postgresql (initdb)")
    return missing


@pytest.fixture(scope="session")
def system_programs() -> None:
    """Chromium, chromedriver and the PostgreSQL server, installed through ``make system-deps`` if missing."""
    if _missing_system_programs():
        result = subprocess.run(["make", "-s", "system-deps"], cwd=ROOT, capture_output=True, text=True)
        still_missing = _missing_system_programs()
        if still_missing:
            pytest.fail(
                f"`make system-deps` could not install {', '.join(still_missing)} (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-500:]}",
                pytrace=False,
            )


@pytest.fixture(scope="module")
def ui_servers() -> Iterator[dict[str, servers.Service]]:
    """The Prefect server and the MLflow server on the test session's stores, as ``make ui`` starts them."""
    prefect = servers.start_prefect_server(port=servers.free_port())
    try:
        mlflow = servers.start_mlflow_server(port=servers.free_port())
    except BaseException:
        servers.stop(prefect)
        raise
    with servers.running(prefect, mlflow):
        yield {"prefect": prefect, "mlflow": mlflow}


@pytest.fixture
def browser(system_programs) -> Iterator:
    """A headless Chromium through chromedriver, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    profile = tempfile.mkdtemp(prefix="vip-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(system_programs) -> Iterator:
    """A Playwright page in a headless Debian Chromium, 1400 x 1000."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=list(CHROMIUM_FLAGS))
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            yield page
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """``test-artifacts/`` (git-ignored): screenshots the browser tests keep."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def wait_for_text(browser) -> Callable[..., str]:
    """``wait_for_text(*texts)``: the page's text once it holds every one of ``texts``; fails naming the missing."""

    def wait(*texts: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        body = ""
        while time.monotonic() < deadline:
            body = browser.find_element("tag name", "body").text
            if all(text in body for text in texts):
                return body
            time.sleep(1.0)
        missing = [text for text in texts if text not in body]
        pytest.fail(f"{browser.current_url} never showed {missing}; it showed: {body[:500]!r}")

    return wait
