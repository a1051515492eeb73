"""Drives the built-in dashboard in headless Chromium (Debian's chromium + chromedriver, Selenium)
and compares what each page shows with the JSON API.

Usage: dashboard_browser.py --admin http://HOST:PORT --token TOKEN --until UNIX_S --out DIR
       --trace-url TEMPLATE

Prints one JSON object (the checks made and their numbers) on stdout; exits 1 with the reasons
on the first failed check. Started by crates/tokenscope-cli/tests/dashboard.rs.

Checks, for each page (overview, performance, cost) at a fixed window end (`until`):
  * the page renders: every chart has a canvas and at least one data point;
  * every number shown (elements with data-key) equals the API's value at that JSON path, and
    its text is that value formatted (within the rounding of the shown digits);
  * changing the range and a filter through the page's own controls changes the numbers, and
    they equal the API's for the new range/filter;
  * the slowest-request table links kept traces to TEMPLATE with the trace id;
  * clicking a slow request (and a chart point) drills down to the performance page, whose
    slow-request table says what each waited behind (per-request blame);
  * the browser console has no errors; a screenshot of each state goes to DIR.
"""

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

report = {"checks": [], "screenshots": []}


def fail(msg):
    report["failure"] = msg
    print(json.dumps(report, indent=1))
    sys.exit(1)


def api(admin, token, path):
    req = urllib.request.Request(admin + "/" + path, headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def get_path(obj, path):
    for k in path.split("."):
        if obj is None:
            return None
        obj = obj[int(k)] if isinstance(obj, list) else obj.get(k)
    return obj


DIGITS = {"ms": None, "pct": 2, "rate": 2, "usd": 4, "int": 0, "num": 2}


def check_text(key, unit, value, text):
    if value is None:
        if text != "–":
            fail(f"{key}: null shown as {text!r}")
        return
    m = re.search(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    if not m:
        fail(f"{key}: no number in {text!r} (value {value})")
    shown = float(m.group(0))
    expect = value * 100 if unit == "pct" else value
    digits = DIGITS[unit]
    if digits is None:  # ms: 2 decimals below 10, else 1
        digits = 2 if abs(value) < 10 else 1
    if abs(shown - expect) > 0.5 * 10 ** (-digits) + 1e-9:
        fail(f"{key}: shows {text!r} but the API says {value}")


def wait_ready(driver, page, previous=None):
    def ready(d):
        r = d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") or ""
        return r.startswith(page + ":") and r != previous and r
    try:
        return WebDriverWait(driver, 30).until(ready)
    except Exception:
        status = driver.find_element(By.ID, "status").text
        ready_now = driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready")
        fail(f"page {page} did not render (status: {status!r}, url {driver.current_url}, ready {ready_now!r}, console {driver.get_log('browser')})")


def compare_page(driver, admin, token, label):
    """Every data-key number equals the API's; every chart has data. Returns the API JSON."""
    body = driver.find_element(By.TAG_NAME, "body")
    path = body.get_attribute("data-api")
    data = api(admin, token, path)
    nums = driver.find_elements(By.CSS_SELECTOR, "[data-key]")
    if len(nums) < 5:
        fail(f"{label}: only {len(nums)} numbers on the page")
    for e in nums:
        key = e.get_attribute("data-key")
        shown = json.loads(e.get_attribute("data-value"))
        want = get_path(data, key)
        if shown != want and not (
            isinstance(shown, float) and isinstance(want, float) and math.isclose(shown, want, rel_tol=1e-12)
        ):
            fail(f"{label}: {key} shows {shown} but the API says {want}")
        check_text(key, e.get_attribute("data-unit"), want, e.text.strip())
    charts = driver.find_elements(By.CSS_SELECTOR, ".chart")
    if not charts:
        fail(f"{label}: no charts")
    for c in charts:
        cid = c.get_attribute("id")
        if not c.find_elements(By.TAG_NAME, "canvas"):
            fail(f"{label}: chart {cid} has no canvas")
        if int(c.get_attribute("data-points") or 0) == 0:
            fail(f"{label}: chart {cid} has no data points")
    report["checks"].append({"state": label, "api": path, "numbers": len(nums), "charts": len(charts)})
    return data


def load(driver, url):
    """A full page load (a fragment-only driver.get would be a same-document navigation that
    chromedriver may replay later)."""
    driver.get("about:blank")
    driver.get(url)


def shot(driver, out, name):
    p = f"{out}/{name}.png"
    driver.save_screenshot(p)
    report["screenshots"].append(p)


def console_errors(driver):
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--admin", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--until", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace-url", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    a = ap.parse_args()

    opts = webdriver.ChromeOptions()
    opts.binary_location = a.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1800",
                "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=a.chromedriver), options=opts)
    errors = []
    try:
        base = f"{a.admin}/#token={urllib.parse.quote(a.token)}&range=1h&until={a.until}"
        # --- each page at 1 h -------------------------------------------------------
        pages = {}
        for page in ("overview", "performance", "cost"):
            load(driver, f"{base}&page={page}")
            wait_ready(driver, page)
            if "token=" in driver.current_url:
                fail("the token stayed in the URL")
            pages[page] = compare_page(driver, a.admin, a.token, f"{page} 1h")
            shot(driver, a.out, f"{page}-1h")
            errors += console_errors(driver)

        # --- range change through the select ----------------------------------------
        load(driver, f"{base}&page=overview")
        prev = wait_ready(driver, "overview")
        Select(driver.find_element(By.ID, "range")).select_by_value("24h")
        prev = wait_ready(driver, "overview", prev)
        d24 = compare_page(driver, a.admin, a.token, "overview 24h")
        if d24["range"] != "24h" or d24["summary"]["requests"] == pages["overview"]["summary"]["requests"]:
            fail(f"range 24h did not change the numbers: {d24['summary']['requests']} requests")
        shown = driver.find_element(By.CSS_SELECTOR, '[data-key="summary.requests"]').text
        report["range_change"] = {"1h": pages["overview"]["summary"]["requests"], "24h": d24["summary"]["requests"], "shown": shown}
        shot(driver, a.out, "overview-24h")
        # Range change resets `until` to live; pin it again for the filter check.
        load(driver, f"{base}&page=overview")
        prev = wait_ready(driver, "overview")

        # --- filter change through the select ---------------------------------------
        models = pages["overview"]["options"]["models"]
        if len(models) < 2:
            fail(f"need two models in the window, have {models}")
        Select(driver.find_element(By.ID, "model")).select_by_value(models[0])
        prev = wait_ready(driver, "overview", prev)
        dm = compare_page(driver, a.admin, a.token, f"overview 1h model={models[0]}")
        if dm["filters"]["model"] != models[0] or dm["summary"]["requests"] >= pages["overview"]["summary"]["requests"]:
            fail(f"the model filter did not narrow the numbers: {dm['summary']['requests']}")
        report["filter_change"] = {"all": pages["overview"]["summary"]["requests"], models[0]: dm["summary"]["requests"]}
        shot(driver, a.out, "overview-1h-model")
        lines = pages["cost"]["options"]["business_lines"]
        load(driver, f"{base}&page=cost")
        prev = wait_ready(driver, "cost")
        Select(driver.find_element(By.ID, "business_line")).select_by_value(lines[0])
        prev = wait_ready(driver, "cost", prev)
        dc = compare_page(driver, a.admin, a.token, f"cost 1h business_line={lines[0]}")
        if [r["key"] for r in dc["by_business_line"]] != [lines[0]]:
            fail(f"the business-line filter did not narrow the cost table: {dc['by_business_line']}")
        shot(driver, a.out, "cost-1h-line")

        # --- trace links ------------------------------------------------------------
        load(driver, f"{base}&page=overview")
        prev = wait_ready(driver, "overview")
        links = driver.find_elements(By.CSS_SELECTOR, "#slowest a.trace-link")
        kept = [r for r in pages["overview"]["slowest"] if r["trace_kept"]]
        if not kept or len(links) != len(kept):
            fail(f"{len(links)} trace links for {len(kept)} kept traces")
        for link, r in zip(links, kept):
            want = a.trace_url.replace("{trace_id}", r["trace_id"])
            if link.get_attribute("href") != want:
                fail(f"trace link {link.get_attribute('href')} != {want}")
        report["trace_links"] = len(links)

        # --- drill-down from a slow request -----------------------------------------
        slow = pages["overview"]["slowest"][0]
        row = driver.find_element(By.CSS_SELECTOR, "#slowest tr.drill")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
        report["row_hit"] = driver.execute_script(
            "var r=arguments[0].getBoundingClientRect();"
            "var e=document.elementFromPoint(r.x+r.width/2, r.y+r.height/2);"
            "return e ? e.outerHTML.slice(0, 160) : null", row)
        row.click()
        wait_ready(driver, "performance")
        dp = compare_page(driver, a.admin, a.token, "drill-down from the slowest request")
        if dp["range"] != "5m" or not (dp["since"] <= slow["created_at"] < dp["until"]):
            fail(f"drill-down window {dp['since']}..{dp['until']} misses the request at {slow['created_at']}")
        if not any(r["request_id"] == slow["request_id"] for r in dp["slowest"]):
            fail("the drilled-down performance page does not list the slow request")
        # What each slow request waited behind (per-request blame), as the page's JSON says.
        cells = driver.find_elements(By.CSS_SELECTOR, "#slowest td.blame")
        if len(cells) != len(dp["slowest"]):
            fail(f"{len(cells)} blame cells for {len(dp['slowest'])} slow requests")
        measured = 0
        for cell, r in zip(cells, dp["slowest"]):
            b, text = r.get("blame"), cell.text
            if b is None:
                ok = text == "–"
            elif b["requests"] == 0:
                ok = text == "nobody"
            else:
                measured += 1
                ok = text.startswith(f"{b['requests']} request") and (
                    b["blocker_request_id"] is None
                    or (b["blocker_caller"] or "(unknown)") in text)
            if not ok:
                fail(f"blame cell {text!r} does not say {b!r}")
        report["blame_cells"] = {"rows": len(cells), "behind_someone": measured}
        # The TTFT split (issue 22): the part the engine did not account for is a number of
        # the page (compare_page checks it), and each row says whose engine numbers they are.
        words = {"consistent": "own", "per_step": "per step (shared)",
                 "exceeds_gateway": "above the gateway's", None: "–"}
        timing = driver.find_elements(By.CSS_SELECTOR, "#slowest td.engine-timing")
        unacc = driver.find_elements(By.CSS_SELECTOR, "#slowest td.unaccounted")
        if len(timing) != len(dp["slowest"]) or len(unacc) != len(dp["slowest"]):
            fail(f"{len(timing)} engine-timing / {len(unacc)} unaccounted cells for {len(dp['slowest'])} rows")
        split = 0
        for t, u, r in zip(timing, unacc, dp["slowest"]):
            if t.text != words.get(r.get("engine_timing"), "?"):
                fail(f"engine-timing cell {t.text!r} for {r.get('engine_timing')!r}")
            if r.get("ttft_unaccounted_ms") is not None:
                split += 1
                if u.text in ("", "–"):
                    fail(f"unaccounted cell empty for {r['ttft_unaccounted_ms']}")
        report["split_cells"] = {"rows": len(timing), "with_split": split}
        # The GPU panel: one row per GPU the gateway read (the test's DCGM exporter has two),
        # and latency by GPU utilisation band at arrival.
        gpu_rows = driver.find_elements(By.CSS_SELECTOR, "#gpu-now tr")
        if len(dp["gpu"]["now"]) < 1 or len(gpu_rows) != len(dp["gpu"]["now"]) + 1:
            fail(f"GPU table: {len(gpu_rows) - 1} rows for {len(dp['gpu']['now'])} GPUs")
        if len(driver.find_elements(By.CSS_SELECTOR, "#by-gpu-band tr")) != 5:
            fail("the latency-by-GPU-band table does not list the four bands")
        report["gpus"] = len(dp["gpu"]["now"])
        shot(driver, a.out, "drilldown-request")

        # --- drill-down from a chart point (the TTFT chart) -------------------------
        load(driver, f"{base}&page=overview")
        wait_ready(driver, "overview")
        over = driver.find_element(By.CSS_SELECTOR, "#chart-ttft .u-over")
        t = pages["overview"]["series"]["t"]
        p99 = pages["overview"]["series"]["ttft_p99"]
        idx = max(i for i, v in enumerate(p99) if v is not None)
        w = over.size["width"]
        x = (t[idx] - t[0]) / (t[-1] - t[0]) * w if len(t) > 1 else w / 2
        x = min(max(x, 2), w - 3)  # inside the plot area at the edges
        ActionChains(driver).move_to_element_with_offset(over, int(x - w / 2), 0).pause(0.2).click().perform()
        wait_ready(driver, "performance")
        dq = compare_page(driver, a.admin, a.token, "drill-down from the TTFT chart")
        if dq["requests"] == 0:
            fail("the chart drill-down landed on a window without requests")
        report["chart_drilldown"] = {"point": t[idx], "window": [dq["since"], dq["until"]], "requests": dq["requests"]}
        shot(driver, a.out, "drilldown-chart")
        errors += console_errors(driver)
    finally:
        driver.quit()
    if errors:
        fail(f"console errors: {errors}")
    report["console_errors"] = 0
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
