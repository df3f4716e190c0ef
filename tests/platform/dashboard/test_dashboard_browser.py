"""The dashboard in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by selenium)
while traffic runs: the whole platform app (SQLite, local blobs, its lifespan and gateway) on a loopback port, a
real tiny engine with LoRA as its one replica (and so its stats source), real uploads and real inference over
HTTP (adapters, the base model, quota 429s; every fifth round one request the engine client fails with a 500).
Every chart must show non-empty series; resident adapters and recent uploads show tenant and adapter names and
version numbers (never the registry's ids), a click on an adapter opens its version history, and the speculative
decoding view says the engine is not speculating (``test_speculative_browser.py`` has one that does). The screenshot
goes to the test's temp folder, or to the path in ``LORAPLEX_DASHBOARD_SCREENSHOT``
(``LORAPLEX_DASHBOARD_SCREENSHOT=docs/dashboard.png`` refreshes the README's picture), so a test run leaves the
tree as it was. Chromium missing is a failure, never a skip."""
from __future__ import annotations

import io
import os
import shutil
import threading
import time

import httpx
import pytest

from loraplex.platform.engines.errors import EngineError
from loraplex.platform.engines.inprocess import InProcessEngineClient
from tests.platform.conftest import ADMIN_KEY, BASE_NAME, make_settings, read_files
from tests.utils.services import free_port, wait_for_port

SCREENSHOT_ENV = "LORAPLEX_DASHBOARD_SCREENSHOT"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1600,1250")
WORKLOAD_S = 60.0     # the workload stops by itself after this, whatever happens to the test
MIN_POINTS = 6       # complete 2 s bins with traffic before the screenshot
FAULT_TOKENS = 2     # a request with this max_tokens fails in the engine client (a real 500 through the gateway)
CHARTS = ("throughput", "latency", "adapters", "tenants", "errors", "uploads")

READ_CHARTS = """
const s = window.loraplexDashboard;
if (!s) return null;
const out = {updates: s.updates, failures: s.failures, lastError: s.lastError, charts: {}};
for (const [name, chart] of Object.entries(s.charts)) {
  out.charts[name] = chart.data.datasets.map(d => ({label: d.label,
      values: d.data.filter(v => typeof v === "number" && isFinite(v))}));
}
return out;
"""


def _binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("headless Chromium is required for the dashboard test: apt-get update && apt-get install -y "
                    f"chromium chromium-driver (found chromium={chromium}, chromedriver={driver})")
    return chromium, driver


def _driver(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = _binaries()
    os.environ.setdefault("SE_AVOID_STATS", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


class FaultyEngineClient(InProcessEngineClient):
    """The real in-process engine client, except that a request with ``max_tokens == FAULT_TOKENS`` fails inside
    it (an engine fault that is not an outage: the gateway answers 500 and the replica stays up)."""

    async def generate(self, request):
        if request.sampling.get("max_tokens") == FAULT_TOKENS:
            raise EngineError("simulated engine fault")
        async for chunk in super().generate(request):
            yield chunk


class Workload:
    """Tenants, uploads and inference against the live app, in one thread, until ``stop`` or WORKLOAD_S."""

    def __init__(self, url: str, vocab_size: int, files: dict) -> None:
        self.url, self.vocab_size, self.files = url, vocab_size, files
        self.stop = threading.Event()
        self.rounds = 0
        self.statuses: dict[int, int] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="dashboard-workload", daemon=True)

    def _setup(self, http: httpx.Client) -> dict:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        keys = {}
        # acme's quotas are out of reach within WORKLOAD_S, so its fault request always reaches the engine (a 500,
        # never a 429 however fast the rounds go); globex's one request a minute gives the 429s
        for name, quotas in (("acme", {"tokens_per_minute": 10**7, "requests_per_minute": 10**6}),
                             ("globex", {"tokens_per_minute": 1500, "requests_per_minute": 1})):
            r = http.post("/admin/tenants", json={"name": name, "quotas": quotas}, headers=admin)
            assert r.status_code == 201, r.text
            r = http.post(f"/admin/tenants/{r.json()['id']}/keys", json={"name": "load"}, headers=admin)
            assert r.status_code == 201, r.text
            keys[name] = {"Authorization": f"Bearer {r.json()['key']}"}
        return keys

    def _upload(self, http: httpx.Client, auth: dict, name: str, files: dict[str, bytes]) -> int:
        parts = [("files", (n, io.BytesIO(b))) for n, b in files.items()]
        return http.post("/v1/adapters", data={"name": name}, files=parts, headers=auth).status_code

    def _complete(self, http: httpx.Client, auth: dict, model: str, prompt: list[int], max_tokens: int,
                  stream: bool = False) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": stream}
        r = http.post("/v1/completions", json=body, headers=auth)
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        if r.status_code not in (200, 429, 500):
            raise AssertionError(f"unexpected {r.status_code}: {r.text}")
        return r.status_code

    def _infer(self, http: httpx.Client, keys: dict, base: str) -> None:
        plan = [("acme", "support-bot"), ("acme", base), ("globex", "sql-writer"), ("acme", "support-bot")]
        for i, (tenant, model) in enumerate(plan):
            prompt = [(7 * i + j + self.rounds) % (self.vocab_size - 1) + 1 for j in range(8 + i)]
            self._complete(http, keys[tenant], model, prompt, 6 + self.rounds % 5, stream=i == 3)
        if self.rounds % 5 == 0:
            assert self._complete(http, keys["acme"], "support-bot", [5, 6, 7], FAULT_TOKENS) == 500

    def _run(self) -> None:
        deadline = time.monotonic() + WORKLOAD_S
        try:
            with httpx.Client(base_url=self.url, timeout=30.0) as http:
                keys = self._setup(http)
                assert self._upload(http, keys["acme"], "support-bot", self.files["good"]) == 201
                assert self._upload(http, keys["acme"], "support-bot", self.files["good3"]) == 201    # v2
                r = http.post("/v1/adapters/support-bot/rollback", json={"version": 1}, headers=keys["acme"])
                assert r.status_code == 200, r.text
                assert self._upload(http, keys["globex"], "sql-writer", self.files["good2"]) == 201
                assert self._upload(http, keys["globex"], "too-big-rank", self.files["bad_rank"]) == 422
                assert self._upload(http, keys["acme"], "junk", {"adapter_model.safetensors": b"junk"}) == 422
                base = http.get("/v1/models", headers=keys["acme"]).json()["data"][0]["id"]
                while not self.stop.is_set() and time.monotonic() < deadline:
                    self._infer(http, keys, base)
                    self.rounds += 1
                    time.sleep(0.05)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.error = e


@pytest.fixture
def live(tmp_path, base_model_dir, adapter_dir):
    """The platform app (lifespan on: gateway, metrics poller) on a loopback port with a tiny LoRA engine as its
    replica, and the workload running."""
    import uvicorn

    from loraplex.commands.db import run
    from loraplex.engine import LLMEngine
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.server.service import EngineService
    from loraplex.platform.main import create_app
    from loraplex.platform.routing import Replica

    engine = LLMEngine.from_pretrained(base_model_dir, device="cpu", dtype="float32", enable_lora=True,
                                       max_loras=2, max_cpu_loras=4, max_lora_rank=8, max_num_seqs=8,
                                       block_size=4, num_kv_blocks=128, progress=False,
                                       adapter_cache_dir=str(tmp_path / "adapter-cache"))
    client = FaultyEngineClient(EngineService(AsyncEngine(engine), model_name=BASE_NAME))
    files = {"good": read_files(adapter_dir(seed=11)), "good2": read_files(adapter_dir(seed=12)),
             "good3": read_files(adapter_dir(seed=13)),
             "bad_rank": read_files(adapter_dir(r=32))}

    settings = make_settings(data_dir=str(tmp_path / "data"), base_model_path=base_model_dir, residency_poll_s=0.5)
    run("upgrade", "head", url=settings.sqlalchemy_url)
    app = create_app(settings, replicas=[Replica("engine-0", client)])   # metrics and dashboard included
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="dashboard-uvicorn", daemon=True)
    thread.start()
    wait_for_port(port)
    url = f"http://127.0.0.1:{port}"
    workload = Workload(url, engine.model_config.vocab_size, files)
    workload.thread.start()
    yield url, workload
    workload.stop.set()
    workload.thread.join(timeout=30)
    server.should_exit = True
    thread.join(timeout=30)     # the lifespan closes the engine client, which shuts the engine down
    app.state.sessionmaker.kw["bind"].dispose()


def test_dashboard_charts_fill_in_a_real_browser(live, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, workload = live
    driver = _driver(tmp_path)
    try:
        driver.get(f"{url}/admin/dashboard")
        assert "Admin key" in driver.page_source                     # no session yet: the login form
        driver.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        WebDriverWait(driver, 20).until(lambda d: d.execute_script("return !!window.loraplexDashboard"))
        assert driver.current_url == f"{url}/admin/dashboard"
        assert "loraplex_dashboard" not in driver.execute_script("return document.cookie")   # HttpOnly
        driver.get(f"{url}/admin/dashboard#bin=2&span=120")          # 2 s bins: more points for the screenshot
        WebDriverWait(driver, 20).until(lambda d: d.execute_script("return !!window.loraplexDashboard"))

        def filled(d):
            if workload.error is not None:
                raise workload.error
            state = d.execute_script(READ_CHARTS)
            if not state or state["updates"] < 2:
                return False
            charts = state["charts"]
            ok = all(any(v > 0 for ds in charts.get(name, []) for v in ds["values"]) for name in CHARTS)
            ok = ok and workload.rounds >= 3 and sum(v > 0 for v in charts["throughput"][0]["values"]) >= MIN_POINTS
            ok = ok and all(sum(ds["values"]) > 0 for ds in charts["errors"])   # 4xx (429s) and 5xx (faults)
            return state if ok else False

        try:
            state = WebDriverWait(driver, 45, poll_frequency=0.5).until(filled)
        except Exception:
            final = driver.execute_script(READ_CHARTS)
            driver.save_screenshot(str(tmp_path / "failed.png"))
            raise AssertionError(f"charts did not fill: {final}; workload rounds={workload.rounds}, "
                                 f"error={workload.error!r}")
        assert state["failures"] == 0, state["lastError"]
        charts = state["charts"]
        assert set(charts) == set(CHARTS)
        for name in CHARTS:
            assert any(len(ds["values"]) > 0 for ds in charts[name]), name
        labels = {ds["label"] for ds in charts["latency"]}
        assert {"e2e p50", "e2e p99", "TTFT p50"} <= labels
        assert sum(charts["errors"][0]["values"]) > 0 and sum(charts["errors"][1]["values"]) > 0   # 4xx, 5xx
        gpu, cpu, disk, _ = charts["adapters"][0]["values"]
        assert gpu >= 1 and cpu >= 1 and disk >= 1
        upload_labels = driver.execute_script("return window.loraplexDashboard.charts.uploads.data.labels")
        assert "ready: ok" in upload_labels and any(lbl.startswith("rejected: ") for lbl in upload_labels)
        tenants = driver.execute_script("return window.loraplexDashboard.charts.tenants.data.labels")
        assert {"acme", "globex"} <= set(tenants)
        assert driver.find_element(By.ID, "tile-engines").text == "1 / 1"
        rows = driver.find_elements(By.CSS_SELECTOR, "#error-table tbody tr")
        table = driver.find_element(By.ID, "error-table").get_attribute("textContent")
        assert rows and "rate_limit_exceeded" in table
        assert workload.statuses.get(200, 0) > 0 and workload.statuses.get(429, 0) > 0 and workload.statuses[500] > 0
        _check_names_and_history(driver)
        time.sleep(2.5)  # one more poll so the screenshot shows a settled page
        screenshot = os.path.abspath(os.environ.get(SCREENSHOT_ENV) or str(tmp_path / "dashboard.png"))
        os.makedirs(os.path.dirname(screenshot), exist_ok=True)
        assert driver.save_screenshot(screenshot) and os.path.getsize(screenshot) > 20_000
    finally:
        driver.quit()


def _check_names_and_history(driver) -> None:
    """Names, not ids, in the resident list and the uploads; the adapters view and one adapter's history."""
    import re

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def text(element_id: str) -> str:
        return driver.find_element(By.ID, element_id).get_attribute("textContent")

    assert text("spec-summary") == "Not speculating: no engine replica runs speculative decoding."
    assert not driver.find_element(By.ID, "spec-table").is_displayed()
    resident = text("adapter-table")
    assert "acme" in resident and "support-bot" in resident and re.search(r"v[12]", resident), resident
    assert not re.search(r"[0-9a-f]{32}", resident), resident            # no tenant or version ids
    uploads = text("upload-progress")
    assert "globex / sql-writer v1: ready (ok)" in uploads and "acme / support-bot v2: ready (ok)" in uploads, uploads
    assert not re.search(r"[0-9a-f]{12}:", uploads), uploads
    WebDriverWait(driver, 20).until(lambda d: "support-bot" in text("registry-table"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#registry-table tbody tr")
    row = next(r for r in rows if "support-bot" in r.get_attribute("textContent"))
    assert "latest→1" in row.get_attribute("textContent")               # the rollback
    row.click()
    WebDriverWait(driver, 20).until(lambda d: "acme / support-bot" in text("history-title"))
    history = [[td.get_attribute("textContent") for td in tr.find_elements(By.TAG_NAME, "td")]
               for tr in driver.find_elements(By.CSS_SELECTOR, "#history-table tbody tr")]
    assert [h[0] for h in history] == ["2", "1"], history
    assert [h[1] for h in history] == ["ready", "ready"] and history[1][6] == "latest" and history[0][6] == "–"
    assert all(re.fullmatch(r"[0-9a-f]{12}", h[2]) for h in history), history
    assert all(h[5].startswith("load (") for h in history), history       # the API key's name and prefix
    state = driver.execute_script("return window.loraplexDashboard.history")
    assert state["adapter"] == "support-bot" and state["tenant"] == "acme"
