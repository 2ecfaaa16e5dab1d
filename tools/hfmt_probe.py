"""pytest plugin that tools/hf_modeling_tests.py copies beside its results: one JSON line per test: outcome, first line
of the error, the change in patchkit's counters (attention calls, forwards stepped aside) and its `patchkit:`
warnings. pytest records a test's warnings after its protocol returns (its warnings plugin wraps ours), so a test's
line is written when the next test starts, and the last one's at the session's end."""

import json
import os
import sys

import pytest

_OUT = os.environ.get("HFMT_PROBE_OUT")
_reports = {}
_warnings = {}
_pending = []  # the records of tests whose warnings pytest may still be recording


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


def _flush():
    """Write the pending records, each with the warnings pytest recorded for its test."""
    while _pending:
        record = _pending.pop(0)
        record["warnings"] = sorted(set(_warnings.pop(record["nodeid"], [])))
        if _OUT:
            with open(_OUT, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session, exitstatus):
    _flush()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _flush()  # the previous test's warnings are recorded by now
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
    }
    _pending.append(record)
    return result
