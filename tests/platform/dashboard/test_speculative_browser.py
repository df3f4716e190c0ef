"""The dashboard's speculative-decoding view in a real headless Chromium (the same driver and sign-in as
``test_dashboard_browser.py``): the whole platform app (SQLite, local blobs, its lifespan and gateway) with the
embedded engine speculating (``LORAPLEX_ENGINE_SPECULATIVE_METHOD=ngram``, k = 3) on the tiny qwen3_moe, a real
upload and real inference over HTTP before the page opens (so nothing waits on traffic). The view shows the method
and k, the overall acceptance length and rate the engine reports, and one row per adapter named by tenant, adapter
and version (the base model as such), never by id. The view of an engine that does not speculate ("Not
speculating") is checked by ``test_dashboard_browser.py``."""
from __future__ import annotations

import io
import re

import httpx
import pytest

from tests.platform.conftest import ADMIN_KEY, make_settings, read_files
from tests.platform.dashboard.test_dashboard_browser import _driver
from tests.platform.gateway.conftest import LiveServer

K = 3


@pytest.fixture
def live(tmp_path, base_model_dir, adapter_dir):
    """The platform app with the embedded engine speculating, on a loopback port, after a tenant's traffic."""
    from loraplex.commands.db import run
    from loraplex.platform.main import create_app

    settings = make_settings(data_dir=str(tmp_path / "data"), base_model_path=base_model_dir, engine_mode="embedded",
                             engine_device="cpu", engine_dtype="float32", engine_max_num_seqs=4,
                             engine_speculative_method="ngram", engine_num_speculative_tokens=K)
    run("upgrade", "head", url=settings.sqlalchemy_url)
    server = LiveServer(create_app(settings))
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as http:   # CPU inference: slower than the default
            _traffic(http, read_files(adapter_dir(seed=21)))
        yield server.url, server.app
    finally:
        server.stop()
        server.app.state.sessionmaker.kw["bind"].dispose()


def _traffic(http: httpx.Client, files: dict[str, bytes]) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = http.post("/admin/tenants", json={"name": "acme"}, headers=admin)
    assert r.status_code == 201, r.text
    r = http.post(f"/admin/tenants/{r.json()['id']}/keys", json={"name": "load"}, headers=admin)
    assert r.status_code == 201, r.text
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    parts = [("files", (n, io.BytesIO(b))) for n, b in files.items()]
    r = http.post("/v1/adapters", data={"name": "support-bot"}, files=parts, headers=auth)
    assert r.status_code == 201, r.text
    base = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
    prompt = list(range(1, 90))          # every token of the tiny vocabulary is in it: n-grams find drafts
    for model in ("support-bot", base, "support-bot"):
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text


def test_speculative_view_in_a_real_browser(live, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, app = live
    driver = _driver(tmp_path)
    try:
        driver.get(f"{url}/admin/dashboard")
        driver.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        WebDriverWait(driver, 20).until(lambda d: d.execute_script("return !!window.loraplexDashboard"))

        def text(element_id: str) -> str:
            return driver.find_element(By.ID, element_id).get_attribute("textContent")

        def shown(d):
            state = d.execute_script("const s = window.loraplexDashboard; "
                                     "return {updates: s.updates, failures: s.failures, lastError: s.lastError, "
                                     "data: s.data};")
            if state["failures"]:
                raise AssertionError(state["lastError"])
            return state["data"] if state["updates"] >= 1 and "support-bot" in text("spec-table") else False

        data = WebDriverWait(driver, 30, poll_frequency=0.2).until(shown)
        spec = data["speculative"]
        assert spec["replicas"] == [{"replica": "embedded", "method": "ngram", "num_speculative_tokens": K}]
        assert spec["proposed"] > 0 and spec["acceptance_length"] >= 1.0

        assert text("spec-method") == f"ngram, k = {K}"
        assert text("spec-length") == f"{spec['acceptance_length']:.2f}"
        assert text("spec-rate") == f"{100 * spec['acceptance_rate']:.1f}%"
        assert "1 replica(s) speculating (embedded)" in text("spec-summary")
        rows = [[td.get_attribute("textContent") for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in driver.find_elements(By.CSS_SELECTOR, "#spec-table tbody tr")]
        by_adapter = {row[1]: row for row in rows}
        assert set(by_adapter) == {"support-bot", "(base model)"}, rows
        bot = by_adapter["support-bot"]
        assert bot[0] == "acme" and bot[2] == "v1" and int(bot[3]) > 0
        [named] = [a for a in spec["adapters"] if a["adapter"] == "support-bot"]
        assert bot[5] == f"{named['acceptance_length']:.2f}" and float(bot[5]) >= 1.0
        table = text("spec-table")
        assert not re.search(r"[0-9a-f]{32}", table), table                   # names, never ids
        assert driver.find_element(By.ID, "spec-tiles").is_displayed()
        assert driver.save_screenshot(str(tmp_path / "speculative.png"))
    finally:
        driver.quit()
