"""The held-locks admin page in a real browser: headless Chromium driven by Selenium.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them on
CI) and the ``selenium`` package; without them the test is skipped with the reason.
Set ``REDLOCK_SCREENSHOT=docs/images/admin-held-locks.png`` to refresh the README's
screenshot; otherwise it is written to the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from redlock_django import LockLostError, Redlock

LIST_URL = "/admin/redlock_django/heldlock/"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,900",
)


def wait_for_heading(browser: Any, text: str) -> None:
    """Wait until the page's h1 contains ``text`` (the navigation has landed)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    landed = expected_conditions.text_to_be_present_in_element(
        (By.TAG_NAME, "h1"), text
    )

    def check(driver: Any) -> bool:
        try:
            return bool(landed(driver))
        except WebDriverException as exc:
            # Mid-navigation, Chromium 156 may report the old page's h1 this way
            # instead of as a stale element: the page has not landed yet.
            if "does not belong to the document" in str(exc):
                return False
            raise

    WebDriverWait(browser, 10).until(check)


def _browser_or_skip() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    missing = [
        name
        for name, path in (("chromium", chromium), ("chromedriver", chromedriver))
        if path is None
    ]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not found on PATH: install Debian's chromium "
            "and chromium-driver (.ci/run does on CI) to run the browser test"
        )
    assert chromium is not None and chromedriver is not None
    return chromium, chromedriver


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Start headless Chromium with a fresh profile; quit it at teardown."""
    chromium, chromedriver = _browser_or_skip()
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (the test extra)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    service = webdriver.ChromeService(executable_path=chromedriver)
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def _plant_leftover(nodes: NodeSet, resource: str) -> None:
    """Leave a lock on 2 of 5 nodes, as a failed attempt's clean-up could."""
    meta = json.dumps(
        {
            "host": "worker-3",
            "pid": 8812,
            "holder": "Thread-7 (process_batch)",
            "acquired_at": "2026-01-02T03:04:05.000+00:00",
            "ttl": 30.0,
            "label": "POST /inventory/77/",
        }
    )
    for node in nodes[3:]:
        node.client().hset(
            lock_key(resource),
            mapping={"token": "leftover-token", "meta": meta},
        )
        node.client().pexpire(lock_key(resource), 30_000)


@pytest.mark.django_db(transaction=True)
def test_admin_sees_and_force_releases_a_held_lock_in_chromium(
    browser: Any,
    live_server: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    django_user_model: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    """Log in, see the lock this test holds, release it via the confirmation page."""
    from selenium.webdriver.common.by import By

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    django_user_model.objects.create_superuser("ops", "ops@example.com", "ops-pw")
    # Chromium starting up can starve the nodes of CPU on a 2-core box: this test
    # is about the page, not timing, so it allows them more than 50 ms to answer.
    settings.REDLOCK = {**redlock_settings, "TTL": 60.0, "NODE_TIMEOUT": 1.0}
    held = Redlock("checkout:order-1042", fencing=True, label="POST /checkout/1042/")
    other = Redlock("report:nightly", label="manage.py nightly_report")
    assert held.acquire()
    assert other.acquire()
    _plant_leftover(nodes, "inventory:sku-77")
    try:
        browser.get(live_server.url + LIST_URL)
        # Not logged in: the admin's login form, then back to the page.
        browser.find_element(By.ID, "id_username").send_keys("ops")
        browser.find_element(By.ID, "id_password").send_keys("ops-pw")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()

        # Wait for the next page: find_element alone can answer from the old one.
        wait_for_heading(browser, "Held locks")
        rows = {
            row.find_element(By.CSS_SELECTOR, "th.field-resource").text: row
            for row in browser.find_elements(By.CSS_SELECTOR, "tr.held-lock")
        }
        assert set(rows) == {
            "checkout:order-1042",
            "inventory:sku-77",
            "report:nightly",
        }
        assert "5 of 5" in rows["checkout:order-1042"].text
        assert "POST /checkout/1042/" in rows["checkout:order-1042"].text
        assert "below-quorum" in rows["inventory:sku-77"].get_attribute("class")
        assert "Below quorum" in rows["inventory:sku-77"].text
        panel = browser.find_element(By.ID, "redlock-nodes").text
        assert "Nodes: 5 of 5 reachable, quorum 3" in panel

        # The README's picture: sidebar folded, window as tall as the page.
        browser.find_element(By.ID, "toggle-nav-sidebar").click()
        height = browser.execute_script("return document.body.scrollHeight")
        browser.set_window_size(1280, height + 140)
        screenshot = Path(
            os.environ.get("REDLOCK_SCREENSHOT") or tmp_path / "admin-held-locks.png"
        )
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(screenshot))

        rows["checkout:order-1042"].find_element(
            By.CSS_SELECTOR, "button.force-release"
        ).click()
        wait_for_heading(browser, "Force-release a lock?")
        summary = browser.find_element(By.ID, "redlock-lock").text
        assert "checkout:order-1042" in summary
        assert held.fencing_token is not None
        assert str(held.fencing_token) in summary
        browser.find_element(By.ID, "id_reason").send_keys("browser test")
        browser.find_element(By.ID, "redlock-confirm").click()
        wait_for_heading(browser, "Held locks")

        message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li").text
        assert "“checkout:order-1042”" in message
        assert "released on 5 of 5 nodes" in message
        listed = [
            cell.text
            for cell in browser.find_elements(By.CSS_SELECTOR, "th.field-resource")
        ]
        assert listed == ["inventory:sku-77", "report:nightly"]
        for node in nodes:
            assert not node.client().exists(lock_key("checkout:order-1042"))
            assert node.client().exists(lock_key("report:nightly"))
    finally:
        other.release()
        if held.owned():
            # Evicted: its keys are gone, and its release says the lock was lost.
            with pytest.raises(LockLostError):
                held.release()
