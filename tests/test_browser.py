"""The served page (``captioning serve``) in a real browser: Debian's headless Chromium driven through its
chromedriver by Selenium, against the real server on a localhost port with the soft-attention fixture model.

What it checks, on the page's DOM contract (captioning/inference/serve.py's docstring): two JPEGs picked in ``#images`` give two ``.result``
cards named after the files, each with the best caption and its score exactly as ``POST /caption`` gives them for
the same file and the same options, ``decode.top_k`` alternatives, and one loaded attention picture per word; a
changed option control and ``#caption`` re-caption with the new option; a file that is not an image shows
``.error`` and the page goes on captioning; no JavaScript error in the console and no request leaves 127.0.0.1.

The screenshot of the page with its two captioned images is a test artifact: written to pytest's temporary
folder (``/tmp/pytest-of-USER/pytest-N/[popen-gwK/]test_browser_screenshot0/browser.png``; pytest keeps the
last 3 runs' folders) and, when the environment variable ``TEST_ARTIFACTS`` names a folder, copied there as
``test_browser.png`` (``TEST_ARTIFACTS=runs/artifacts make test PYTEST_ARGS=tests/test_browser.py``).

Without ``chromium`` and ``chromedriver`` on PATH (or without Selenium) the tests skip with a one-line reason,
except under ``CI=true``, where that is a failure: .ci/run installs both, so CI always runs them. Selenium is given
the system chromedriver's path, so Selenium Manager never runs and nothing is downloaded (``SE_OFFLINE=true`` too).
One browser and one server for the whole file (module fixtures); the browser is always quit.
"""

import json
import os
import re
import shutil
import struct
import urllib.request
import uuid

import pytest

pytestmark = pytest.mark.slow  # about 20 s on a busy machine, most of it the fixture model and the first trace

WAIT_S = 120  # the first caption traces the model; a busy shared machine is slow, but never this slow
INSTALL = "apt-get install chromium chromium-driver"


def _require(reason: str):
    """Skip with ``reason``, or fail under CI=true, where the browser tests must run (.ci/run installs it)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: the browser tests must run; .ci/run installs chromium)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """One headless Chromium for the file, quit at the end whatever happened."""
    missing = [name for name in ("chromium", "chromedriver") if not shutil.which(name)]
    if missing:
        _require(f"no {' or '.join(missing)} on PATH: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _require("selenium is not installed: .venv/bin/pip install -e '.[test]'")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, were it ever asked, must not download a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}", "--window-size=1280,1100",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = Service(executable_path=shutil.which("chromedriver"))  # given: Selenium Manager is skipped
    browser = webdriver.Chrome(service=service, options=options)
    try:
        browser.set_page_load_timeout(60)
        browser.set_script_timeout(30)
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def server(driver, trained_attention_dir):
    """The real server (:func:`captioning.inference.serve.start`, in a thread of this process, on a free port of
    127.0.0.1) over the soft-attention fixture, returning the top 3 captions: its base URL, without the last /."""
    from captioning import inference
    from captioning.inference.serve import start

    trained = inference.load(trained_attention_dir)
    running = start(inference.Captioner(trained, trained.config.decode.override(top_k=3)), port=0)
    try:
        yield running.url.rstrip("/")
    finally:
        running.stop()


@pytest.fixture(scope="module")
def images(shapes_dir):
    """Two real JPEGs of the shapes fixture."""
    folder = os.path.join(shapes_dir, "images")
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))[-2:]]


def post_caption(url: str, paths: list[str], options: dict) -> list[dict]:
    """``POST /caption``: the files as multipart fields ``image``, ``options`` as form fields (as curl -F sends)."""
    boundary = uuid.uuid4().hex
    parts = []
    for key, value in options.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode())
    for path in paths:
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
                f'filename="{os.path.basename(path)}"\r\nContent-Type: image/jpeg\r\n\r\n')
        parts.append(head.encode() + open(path, "rb").read() + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(url + "/caption", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        return json.loads(response.read())


def option(driver, name: str) -> str:
    """The current value of the option control ``name`` (a ``decode.*`` key)."""
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'#options [name="{name}"]').get_attribute("value")


WATCH = """
    window.__states = [];
    const status = document.getElementById('status');
    new MutationObserver(() => window.__states.push(status.dataset.state))
      .observe(status, {attributes: true, attributeFilter: ['data-state']});"""


def run_and_wait(driver, action) -> str:
    """Runs ``action`` (an upload or a click) and waits until ``#status`` went busy and then done or error: the
    final state. A status already ``done`` from before does not count (a MutationObserver sees the changes)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script(WATCH)
    action()

    def finished(d):
        states = d.execute_script("return window.__states")
        return "busy" in states and states[-1] in ("done", "error") and states[-1]

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(finished, "#status never went busy then done")


def pick(driver, paths: list[str]):
    """Picks ``paths`` in ``#images`` as the file chooser does: the new files replace the old ones (chromedriver's
    ``send_keys`` adds to a ``multiple`` input's files, so the input is emptied first, which fires no event)."""
    from selenium.webdriver.common.by import By

    upload = driver.find_element(By.ID, "images")
    driver.execute_script("arguments[0].value = ''", upload)
    upload.send_keys("\n".join(paths))


def card(driver, name):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f'#results .result[data-name="{name}"]')
    assert len(found) == 1, f"{len(found)} result cards named {name}"
    return found[0]


def check_card(driver, element, record: dict, top_k: int):
    """A result card against the ``POST /caption`` record of the same file and options."""
    from selenium.webdriver.common.by import By

    best = record["captions"][0]
    caption = element.find_element(By.CSS_SELECTOR, ".caption")
    own_text = driver.execute_script(  # the caption's own words, without the score the page may put inside it
        "return [...arguments[0].childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('')", caption)
    assert own_text.strip() == best["caption"] != ""
    score = element.find_elements(By.CSS_SELECTOR, ".score")[0].text.strip()  # the first: the best caption's
    decimals = len(score.partition(".")[2])
    assert abs(float(score) - best["log_prob"]) <= 0.5 * 10 ** -decimals + 1e-6, (score, best["log_prob"])
    alternatives = element.find_elements(By.CSS_SELECTOR, ".alternatives li")
    assert len(alternatives) == len(record["captions"]) == top_k
    for item, alternative in zip(alternatives, record["captions"]):
        assert alternative["caption"] in item.text
    thumb = element.find_element(By.CSS_SELECTOR, "img.thumb")
    assert driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", thumb) > 0
    words = best["caption"].split()
    pictures = element.find_elements(By.CSS_SELECTOR, ".attention img.word-attention")
    assert [p.get_attribute("alt") for p in pictures] == [f"attention for {w}" for w in words]
    widths = driver.execute_script("return arguments[0].map(i => i.complete ? i.naturalWidth : 0)", pictures)
    assert len(widths) == len(words) and all(w > 0 for w in widths), widths


def check_clean(driver, url):
    """No JavaScript error in the console since the last check, and no request outside ``url`` (the page's
    own server) except inline data: and blob: URLs."""
    errors = [e for e in driver.get_log("browser")
              if e["level"] == "SEVERE" and e.get("source") in ("javascript", "console-api")]
    assert errors == []
    requested = set()
    for entry in driver.get_log("performance"):  # the page's requests (not the browser's own start page's)
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent" and \
                message["params"].get("documentURL", "").startswith(url + "/"):
            requested.add(message["params"]["request"]["url"])
    outside = sorted(u for u in requested if not u.startswith((url + "/", "data:", "blob:", "about:")))
    assert outside == []
    links = driver.execute_script(
        "return [...document.querySelectorAll('[src],[href]')].map(e => e.getAttribute('src') || e.getAttribute('href'))")
    outside = [link for link in links if re.match(r"^([a-z][a-z0-9+.-]*:)?//", link, re.I)
               and not link.startswith(url + "/")]
    assert outside == []


def set_option(driver, name: str, value: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    control = driver.find_element(By.CSS_SELECTOR, f'#options [name="{name}"]')
    if control.tag_name == "select":
        Select(control).select_by_value(value)
    else:
        driver.execute_script("arguments[0].value = arguments[1];"
                              "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));"
                              "arguments[0].dispatchEvent(new Event('change', {bubbles: true}));", control, value)


def test_two_images_captioned_in_the_browser_as_the_api_captions_them(driver, server, images, tmp_path_factory):
    from selenium.webdriver.common.by import By

    driver.get(server + "/")
    assert driver.find_element(By.ID, "images").get_attribute("multiple") is not None
    assert driver.find_element(By.ID, "drop").is_displayed()
    assert option(driver, "decode.top_k") == "3" and option(driver, "decode.beam_size") == "3"  # the server's
    assert run_and_wait(driver, lambda: pick(driver, images)) == "done"
    names = [os.path.basename(p) for p in images]
    cards = driver.find_elements(By.CSS_SELECTOR, "#results .result")
    assert sorted(c.get_attribute("data-name") for c in cards) == sorted(names)
    records = post_caption(server, images, {})
    assert [r["image"] for r in records] == names
    for name, record in zip(names, records):
        check_card(driver, card(driver, name), record, 3)
    check_clean(driver, server)

    shot = tmp_path_factory.mktemp("test_browser_screenshot") / "browser.png"
    assert driver.save_screenshot(str(shot))
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == tuple(driver.execute_script(
        "return [window.innerWidth * devicePixelRatio, window.innerHeight * devicePixelRatio]"))
    if os.environ.get("TEST_ARTIFACTS"):
        os.makedirs(os.environ["TEST_ARTIFACTS"], exist_ok=True)
        shutil.copyfile(shot, os.path.join(os.environ["TEST_ARTIFACTS"], "test_browser.png"))


def test_a_changed_option_recaptions_with_it(driver, server, images):
    from selenium.webdriver.common.by import By

    if driver.current_url != server + "/":
        driver.get(server + "/")
    assert run_and_wait(driver, lambda: pick(driver, images)) == "done"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#results .alternatives li")) == 2 * 3
    set_option(driver, "decode.top_k", "2")
    assert run_and_wait(driver, driver.find_element(By.ID, "caption").click) == "done"
    records = post_caption(server, images, {"decode.top_k": "2"})
    for path, record in zip(images, records):
        check_card(driver, card(driver, os.path.basename(path)), record, 2)
    check_clean(driver, server)


def test_a_file_that_is_not_an_image_shows_an_error_and_the_page_goes_on(driver, server, images, tmp_path):
    from selenium.webdriver.common.by import By

    if driver.current_url != server + "/":
        driver.get(server + "/")
    bad = tmp_path / "notes.jpg"
    bad.write_text("not an image, whatever its name says\n")
    assert run_and_wait(driver, lambda: pick(driver, [str(bad)])) in ("done", "error")
    error = card(driver, "notes.jpg").find_element(By.CSS_SELECTOR, ".error")
    assert error.is_displayed() and error.text.strip() == "not an image (unrecognised format)"
    assert card(driver, "notes.jpg").find_elements(By.CSS_SELECTOR, "img") == []  # the reason, no broken picture
    assert driver.find_elements(By.CSS_SELECTOR, "#results .caption") == []  # no caption for a non-image
    top_k = int(option(driver, "decode.top_k"))
    assert run_and_wait(driver, lambda: pick(driver, images[:1])) == "done"
    changed = {} if top_k == 3 else {"decode.top_k": str(top_k)}  # as the test before left the control
    record = post_caption(server, images[:1], changed)[0]
    check_card(driver, card(driver, os.path.basename(images[0])), record, top_k)
    check_clean(driver, server)


def test_the_page_refuses_a_temperature_the_server_refuses(driver, server, images):
    """``decode.temperature`` must be more than 0: the control's ``min`` is the first float above it, so the page
    says "check the options" for 0 instead of sending what the server answers with 400."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if driver.current_url != server + "/":
        driver.get(server + "/")
    assert run_and_wait(driver, lambda: pick(driver, images[:1])) == "done"
    control = driver.find_element(By.CSS_SELECTOR, '#options [name="decode.temperature"]')
    valid = "return [arguments[0].checkValidity(), arguments[0].validity.rangeUnderflow]"
    for value, expected in (("0", [False, True]), ("0.0", [False, True]), ("0.01", [True, False])):
        set_option(driver, "decode.temperature", value)
        assert driver.execute_script(valid, control) == expected, value
    set_option(driver, "decode.temperature", "0")
    driver.find_element(By.ID, "caption").click()
    status = driver.find_element(By.ID, "status")
    WebDriverWait(driver, WAIT_S).until(lambda d: status.get_attribute("data-state") == "error")
    assert status.text == "check the options"
    set_option(driver, "decode.temperature", "1")
    assert driver.execute_script(valid, control) == [True, False]
    check_clean(driver, server)
