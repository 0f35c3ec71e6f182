"""In the notebook display, choosing a Python line (its anchor in the URL, or
the mouse over it) highlights the PTX and SASS it became, with no script.
Checked in headless Chromium (Debian's chromium and chromium-driver,
installed by .ci/run) through Selenium; the screenshot is kept in
$TK_MLIR_ARTIFACTS, else tests/artifacts/ (git-ignored)."""
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.cli import html_page
from tk_mlir.toolchain import find_tool

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

HERE = Path(__file__).resolve()
ARTIFACTS = Path(os.environ.get("TK_MLIR_ARTIFACTS") or HERE.parent / "artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Without the network switches Chromium's background connections fail on a
# closed network; a fresh profile keeps runs apart.
SWITCHES = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--window-size=1400,2000")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Debian's chromium and chromium-driver "
                              "(apt-get install chromium chromium-driver; .ci/run does)"),
    pytest.mark.skipif(find_tool("ptxas") is None or find_tool("nvdisasm") is None,
                       reason="the SASS stage needs ptxas and nvdisasm"),
]


# Small, so that its PTX and SASS are shown whole (a cut listing keeps only
# some of a line's code: softmax_page).
@tk.kernel(num_warps=1)
def exp_rows(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 16))
    e = x.exp2()
    tk.store(Y, e, (tk.block_id(0), 0))


def line_of(text: str) -> int:
    return next(i for i, l in enumerate(HERE.read_text().splitlines(), 1) if l.strip() == text)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    x = tk.spec((64, 16), "f32")
    fragment = exp_rows.compile(x, x)._repr_html_()
    path = tmp_path_factory.mktemp("display") / "exp_rows.html"
    path.write_text(html_page("exp_rows (tk_mlir)", fragment), encoding="utf-8")
    return path, re.search(r'class="tk-mlir-stages" id="(\w+)"', fragment)[1]


@pytest.fixture(scope="module")
def softmax_page(tmp_path_factory):
    """examples/quickstart.py's softmax: its PTX and SASS are cut."""
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    from quickstart import softmax
    x = tk.spec((1000, 512), "f32")
    compiled = softmax.compile(x, x, ROWS=4, N=512)
    path = tmp_path_factory.mktemp("display") / "softmax.html"
    path.write_text(html_page("softmax (tk_mlir)", compiled._repr_html_()), encoding="utf-8")
    line = {c.source.strip(): c.line for c in compiled.source_map.lines()}
    return path, *(next(n for text, n in line.items() if part in text)
                   for part in (".exp()", "tk.load("))


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="tk-mlir-chromium-")
    for switch in SWITCHES + (f"--user-data-dir={profile}",):
        options.add_argument(switch)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def stage_lines(driver, stage: str, pattern: str) -> list:
    """The listing lines of `stage` whose text matches `pattern`."""
    lines = driver.find_elements(By.CSS_SELECTOR, f'details[data-stage="{stage}"] pre > span')
    return [l for l in lines if re.search(pattern, l.get_attribute("textContent"))]


def lit(element) -> bool:
    return element.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)",
                                                                     "transparent")


def settled(driver, lit_now: list, dark_now: list) -> bool:
    """Whether `lit_now` are highlighted and `dark_now` not, once the page
    has drawn the hover (styles follow the mouse a frame later)."""
    def check(_):
        return all(map(lit, lit_now)) and not any(map(lit, dark_now))
    try:
        # 10 s: a loaded 2-core CI machine can be slow to redraw (3 s once
        # timed out while another browser test ran beside it).
        return WebDriverWait(driver, 10, poll_frequency=0.05).until(check)
    except TimeoutException:
        return False


def open_stages(driver):
    """Unfold the python, PTX and SASS stages, as a reader does."""
    for stage in ("python", "ptx", "sass"):
        details = driver.find_element(By.CSS_SELECTOR, f'details[data-stage="{stage}"]')
        if not details.get_attribute("open"):
            details.find_element(By.TAG_NAME, "summary").click()


def test_choosing_a_python_line_highlights_its_ptx_and_sass(page, browser):
    path, page_id = page
    exp, store = line_of("e = x.exp2()"), line_of("tk.store(Y, e, (tk.block_id(0), 0))")
    browser.get(f"{path.as_uri()}#{page_id}-L{exp}")
    open_stages(browser)    # (Chromium unfolds the python stage for the anchor)
    ex2, mufu = stage_lines(browser, "ptx", r"^\s*ex2\.approx"), stage_lines(browser, "sass", "MUFU.EX2")
    stores = stage_lines(browser, "ptx", r"^\s*st\.global") + stage_lines(browser, "sass", r"\bSTG\b")
    assert ex2 and mufu and stores
    assert settled(browser, ex2 + mufu, stores)

    browser.execute_script("location.hash = 'nothing-chosen'")    # (no :target now)
    assert settled(browser, [], ex2 + mufu)
    python_store = browser.find_element(By.ID, f"{page_id}-L{store}")
    ActionChains(browser).move_to_element(python_store).perform()
    assert settled(browser, stores + stage_lines(browser, "python", r"tk\.store\(Y"), ex2 + mufu)

    for shown in (stores[0], stores[-1]):         # the highlighted lines in view
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", shown)
    ActionChains(browser).move_to_element(python_store).perform()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "display_line_highlight.png"))


def test_hovering_softmax_exp_highlights_its_code_in_cut_listings(softmax_page, browser):
    """The cut PTX and SASS keep each Python line's kinds of instruction:
    hovering `.exp()` lights its ex2.approx and MUFU.EX2, past the first lines."""
    path, exp, load = softmax_page
    browser.get(path.as_uri())
    open_stages(browser)
    ex2, mufu = stage_lines(browser, "ptx", r"^\s*ex2\.approx"), stage_lines(browser, "sass", "MUFU.EX2")
    loads = browser.find_elements(By.CSS_SELECTOR, f".t-py{load}")
    assert ex2 and mufu and loads
    assert settled(browser, [], ex2 + mufu)
    python_exp = browser.find_element(By.CSS_SELECTOR, f'details[data-stage="python"] .t-py{exp}')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", python_exp)
    ActionChains(browser).move_to_element(python_exp).perform()
    assert settled(browser, ex2 + mufu, loads)
