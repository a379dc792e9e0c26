"""The tile explorer as a learner meets it: the learner's JupyterLab serving the released notebook 01, in
headless Chromium.

JupyterLab runs as `make lab` runs it (with the environment that command sets: nbgrader's instructor
tools off), on a free localhost port with a random token, on a temporary copy of
notebooks/01_online_softmax. Playwright drives Debian's /usr/bin/chromium (`bash .ci/browser-setup.sh`
installs both). The test checks that no nbgrader menu or formgrader is served, runs the set-up cell and
the worked-example explorer, moves the tile slider with the keyboard, checks the numbers and values the
panel shows, picks a bug in the menu, and runs the explorer of the learner's tile_update before and
after the cell that defines it. Screenshots go to test-artifacts/.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_online_softmax" / "01_online_softmax.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
START_S = 90          # JupyterLab to answer, and the first cell (a kernel importing torch) to finish
STEP_S = 30           # each widget update

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    sync_playwright = None

MISSING = " and ".join(([] if sync_playwright else ["Playwright's Python package"])
                      + ([] if CHROMIUM.exists() else [str(CHROMIUM)]))
# Skipped on a machine without them; in CI, where .ci/browser-setup.sh installs them, missing them fails.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                                 reason=f"needs {MISSING}: bash .ci/browser-setup.sh installs them")]


def _learner_lab_environment() -> dict[str, str]:
    """The variables `make lab` sets for JupyterLab (read from `make -n lab`, so the two cannot drift)."""
    dry_run = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    settings = {}
    for word in next(line for line in dry_run.splitlines() if "jupyter lab" in line).split():
        name, equals, value = word.partition("=")
        if not (equals and name.isidentifier()):
            break                                   # the command itself, after its leading NAME=value words
        settings[name] = value
    assert settings, f"`make lab` should configure the learner's JupyterLab: {dry_run}"
    return settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(path: Path) -> None:
    """User settings for a quiet, predictable JupyterLab: every cell in the DOM, no news, no update check."""
    for name, values in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        file = path / f"{name}.jupyterlab-settings"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(values))


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on the released notebook 01; yields its base URL and token; always stopped."""
    if MISSING:
        pytest.fail(f"the browser test needs {MISSING}: run `bash .ci/browser-setup.sh` first")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    _settings(tmp_path / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "IPYTHONDIR": str(tmp_path / "ipython"), "PYTHONPATH": str(ROOT), **_learner_lab_environment()}
    log = (tmp_path / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer in {START_S} s:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, token
    finally:
        # Ask the server to shut its kernels and itself down, then make sure its whole process group is gone.
        try:
            request = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=10).close()
            server.wait(timeout=20)
        except (urllib.error.URLError, ConnectionError, TimeoutError, subprocess.TimeoutExpired):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if server.poll() is None:
                os.killpg(server.pid, sig)
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    continue
        log.close()


def _wait_for_kernel(url: str, token: str, notebook: str) -> None:
    """Until the notebook's kernel is started, connected to the page and idle (the page's own indicator
    says idle before the kernel exists, and a cell run then is lost)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=5) as answer:
            kernels = [s["kernel"] for s in json.load(answer) if s.get("path") == notebook and s.get("kernel")]
        if any(k["execution_state"] == "idle" and k["connections"] > 0 for k in kernels):
            return
        time.sleep(0.5)
    pytest.fail(f"the notebook's kernel was not idle within {START_S} s")


def _run_cell(page, text: str):
    """Run the code cell whose source contains `text` (Shift+Enter in its editor) and return the cell."""
    cell = page.locator(".jp-CodeCell").filter(has_text=text)
    expect(cell).to_have_count(1)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    return cell


def _state(explorer) -> dict[str, str]:
    names = ("tile", "m", "alpha", "l", "a", "output")
    return {n: explorer.locator(f".fc-panel .fc-{n}").inner_text().strip().replace("−", "-") for n in names}


def test_tile_explorer_in_jupyterlab(lab, tmp_path):
    url, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1400})
        context.set_default_timeout(STEP_S * 1000)
        page = context.new_page()
        try:
            page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.locator(".jp-NotebookPanel").wait_for(timeout=START_S * 1000)
            _wait_for_kernel(url, token, NOTEBOOK.name)
            expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_be_visible()

            # The learner's JupyterLab: nbgrader is installed here, yet neither its menu nor its formgrader is served.
            assert (Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter" / "nbgrader").is_dir()
            menus = page.locator("#jp-MainMenu .lm-MenuBar-itemLabel")
            expect(menus.filter(has_text="File")).to_have_count(1)
            labels = [x.strip().lower() for x in menus.all_inner_texts()]
            assert "nbgrader" not in labels, f"the learner's JupyterLab shows nbgrader's menu: {labels}"
            try:
                urllib.request.urlopen(f"{url}/formgrader?token={token}", timeout=10).close()
                pytest.fail("the learner's JupyterLab serves nbgrader's formgrader")
            except urllib.error.HTTPError as error:
                assert error.code == 404
            page.screenshot(path=ARTIFACTS / "learner-lab-menus.png", clip={"x": 0, "y": 0, "width": 1280, "height": 120})

            setup = _run_cell(page, "runtime.setup()")
            expect(setup.locator(".jp-OutputArea-output")).to_contain_text("flashcourse:", timeout=START_S * 1000)

            cell = _run_cell(page, "widgets.tile_explorer()")
            explorer = cell.locator(".fc-explorer")
            expect(explorer.locator(".fc-panel .fc-l")).to_have_text("1.3679", timeout=START_S * 1000)
            assert _state(explorer) == {"tile": "1", "m": "1", "alpha": "0", "l": "1.3679", "a": "4.7358",
                                        "output": "3.4621"}
            image = explorer.locator(".widget-image img, img.widget-image").first
            assert image.evaluate("img => img.complete && img.naturalWidth") > 800
            explorer.screenshot(path=ARTIFACTS / "tile-explorer-1-after-tile-1.png")
            page.screenshot(path=ARTIFACTS / "tile-explorer-0-jupyterlab.png")

            # Move the "after tile" slider one step with the keyboard, as a learner could.
            slider = explorer.locator(".widget-slider").filter(has_text="after tile")
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowRight")
            expect(explorer.locator(".fc-panel .fc-tile")).to_have_text("2")
            expect(explorer.locator(".fc-panel .fc-l")).to_have_text("1.5530")
            assert _state(explorer) == {"tile": "2", "m": "2", "alpha": "0.3679", "l": "1.5530", "a": "2.8915",
                                        "output": "1.8619"}
            assert explorer.locator(".fc-panel .fc-true").inner_text() == "1.8619"
            # The values beside the scores: a's tile part 1.1494 = 1 * 1 + 0.0498 * 3.
            assert explorer.locator(".fc-panel .fc-values").inner_text() == "[1, 3]"
            assert explorer.locator(".fc-panel .fc-pv").inner_text() == "[1, 0.1494]"
            explorer.screenshot(path=ARTIFACTS / "tile-explorer-2-after-tile-2.png")

            # Inject a classic bug: l is no longer rescaled, and the panel marks the wrong numbers.
            menu = explorer.locator(".widget-dropdown select")
            labels = menu.locator("option").evaluate_all("options => options.map(o => o.textContent)")
            # ipywidgets writes the spaces of option labels as non-breaking spaces.
            menu.select_option(label=next(x for x in labels if x.replace("\xa0", " ").startswith("bug: l not rescaled")))
            expect(explorer.locator(".fc-panel .fc-l")).to_have_text("2.4177")
            expect(explorer.locator(".fc-panel .fc-want-l")).to_have_text("1.5530")
            expect(explorer.locator(".fc-panel .fc-output.fc-wrong")).to_have_text("1.1960")
            # The × α column shows what the buggy code did: l kept as it was.
            expect(explorer.locator(".fc-panel .fc-l-rescaled")).to_have_text("1.3679")
            explorer.screenshot(path=ARTIFACTS / "tile-explorer-3-bug-l-not-rescaled.png")

            # The explorer of the learner's tile_update, run before the cell that defines it: it says so.
            yours = _run_cell(page, 'widgets.tile_explorer(update="tile_update")').locator(".fc-explorer")
            expect(yours.locator(".fc-panel .fc-note")).to_contain_text("tile_update is not defined yet", timeout=START_S * 1000)
            expect(yours.locator(".fc-panel .fc-l")).to_have_text("1.3679")          # the correct recurrence meanwhile
            yours.screenshot(path=ARTIFACTS / "tile-explorer-4-yours-not-defined.png")
            # Its cell run (still the stub): a move of the slider finds it, and the explorer says it is not written.
            _run_cell(page, "def tile_update(m, l, a, scores, values):")
            slider = yours.locator(".widget-slider").filter(has_text="after tile")
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowRight")
            expect(yours.locator(".fc-panel .fc-note")).to_contain_text("your tile_update is not written yet")
            yours.screenshot(path=ARTIFACTS / "tile-explorer-5-yours-not-written.png")
        except Exception:
            page.screenshot(path=ARTIFACTS / "tile-explorer-failure.png", full_page=True)
            raise
        finally:
            context.close()
    print(f"browser test: {time.monotonic() - started:.1f} s from opening the page")
