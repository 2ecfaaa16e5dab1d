"""pytest plugin that tools/hf_modeling_tests.py copies beside its results: one JSON line per test,
written as it ends: outcome, first line of the error, and the change in patchkit's counters (attention calls,
forwards stepped aside)."""

import json
import os
import sys

import pytest

_OUT = os.environ.get("HFMT_PROBE_OUT")
_reports = {}
_warnings = {}


def _counters():
    api = sys.modules.get("patchkit.api")
    calls, aside = 0, {}
    if api is not None:
        for handle in api.active_patches():
            calls += handle.calls
            for cause, n in handle.stepped_aside.items():
                aside[cause] = aside.get(cause, 0) + n
    return calls, aside


def _first_line(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = str(report.longrepr[2])
    return (text.strip().splitlines() or [""])[0][:300]


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_warning_recorded(warning_message, when, nodeid, location):
    text = str(warning_message.message)
    if text.startswith("patchkit:") and nodeid:
        _warnings.setdefault(nodeid, []).append(text.splitlines()[0][:300])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    calls0, aside0 = _counters()
    result = yield
    calls1, aside1 = _counters()
    reports = _reports.pop(item.nodeid, [])
    failed = [r for r in reports if r.failed]
    skipped = [r for r in reports if r.skipped and r.when in ("setup", "call")]
    outcome = "failed" if failed else "skipped" if skipped and not any(
        r.passed and r.when == "call" for r in reports) else "passed"
    record = {
        "nodeid": item.nodeid,
        "outcome": outcome,
        "message": _first_line(failed[0]) if failed else _first_line(skipped[0]) if outcome == "skipped" else "",
        "duration": round(sum(r.duration for r in reports), 3),
        "patched_calls": calls1 - calls0,
        "stepped_aside": {c: n - aside0.get(c, 0) for c, n in aside1.items() if n - aside0.get(c, 0)},
        "warnings": sorted(set(_warnings.pop(item.nodeid, []))),
    }
    if _OUT:
        with open(_OUT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    return result
