"""tests/matrix.py's newest-release leg: which version it runs, and that it runs it as a tested one."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import matrix  # noqa: E402
import matrix_plan as plan  # noqa: E402


@pytest.fixture
def ran(monkeypatch, tmp_path):
    """The versions the matrix would install and test, and the environment each test run gets (nothing runs)."""
    seen: dict[str, dict] = {}
    monkeypatch.setattr(matrix, "install", lambda version, cache, python: (tmp_path / version, ""))

    def run_version(version, target, args, logs):
        seen[version] = matrix.environment(target, version if args.newest == version else None)
        return matrix.Result(version, passed=1)

    monkeypatch.setattr(matrix, "run_version", run_version)
    monkeypatch.setattr(matrix, "current_transformers", lambda: "5.24.0")
    return seen


def test_the_newest_release_is_run_as_a_tested_version(ran, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(matrix, "newest_release", lambda python: ("5.26.0", ""))
    assert matrix.main(["--versions", "newest", "--cache-dir", str(tmp_path)]) == 0
    assert list(ran) == ["5.26.0"] and ran["5.26.0"][matrix.TESTED_ENV] == "5.26.0"
    out = capsys.readouterr().out
    assert "newest transformers is 5.26.0" in out and "transformers 5.26.0: passed; move the Makefile's pin" in out


def test_a_newest_release_that_is_the_pinned_one_runs_nothing_more(ran, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(matrix, "newest_release", lambda python: ("5.24.0", ""))
    assert matrix.main(["--versions", "newest", "--cache-dir", str(tmp_path)]) == 0
    assert ran == {} and "5.24.0 is the pinned version" in capsys.readouterr().out


def test_an_index_that_cannot_be_asked_fails_the_leg(ran, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(matrix, "newest_release", lambda python: (None, "no network"))
    assert matrix.main(["--versions", "newest", "--cache-dir", str(tmp_path)]) == 1
    assert ran == {} and "newest: FAILED" in capsys.readouterr().out


def test_matrix_versions_get_no_tested_version(ran, monkeypatch, tmp_path):
    monkeypatch.delenv(matrix.TESTED_ENV, raising=False)
    assert matrix.main(["--versions", "5.0.0", "--cache-dir", str(tmp_path)]) == 0
    assert matrix.TESTED_ENV not in ran["5.0.0"]


def test_each_era_runs_its_tier():
    legacy = plan.tests_for("4.36.2", plan.DEFAULT_TESTS)
    assert legacy[: len(plan.LEGACY_TESTS)] == plan.LEGACY_TESTS and plan.FASTCHAT_TEST in legacy
    assert plan.tests_for("4.31.0", plan.DEFAULT_TESTS) == plan.LEGACY_TESTS  # the FastChat script runs there
    assert plan.tests_for("4.56.2", plan.DEFAULT_TESTS) == plan.CORE_TESTS + plan.CORE_DESELECTED
    assert plan.tests_for("4.48.3", plan.DEFAULT_TESTS) == (
        plan.CORE_TESTS + ["tests/test_checkpointing.py"] + plan.CORE_DESELECTED)
    assert plan.tests_for("4.57.6", plan.DEFAULT_TESTS) == plan.ERA_TESTS + plan.CORE_DESELECTED
    assert set(plan.ERA_VERSIONS) | set(plan.EXTRA_TESTS) | set(plan.FASTCHAT_VERSIONS) <= set(
        plan.DEFAULT_VERSIONS)
    assert plan.tests_for("4.56.2", ["tests/test_compile.py"]) == ["tests/test_compile.py"]  # --tests: as given
    assert plan.workers_for("4.36.2", plan.DEFAULT_TESTS) == ["-n", "0"]  # the era tests alone: one process
    assert plan.workers_for("4.48.3", plan.DEFAULT_TESTS) == plan.workers_for("4.36.2", ["tests/x.py"]) == []
    files = {t.split("::")[0] for t in plan.DEFAULT_TESTS + plan.LEGACY_TESTS + [plan.FASTCHAT_TEST,
                                                                                    plan.CORE_DESELECTED[1]]}
    assert all((matrix.REPO / f).is_file() for f in files), files


def test_each_era_draws_fewer_property_cases_than_the_pinned_run(monkeypatch):
    monkeypatch.delenv(matrix.HYPOTHESIS_ENV, raising=False)
    assert matrix.environment(None)[matrix.HYPOTHESIS_ENV] == matrix.ERA_EXAMPLES
    monkeypatch.setenv(matrix.HYPOTHESIS_ENV, "1000")  # a caller's own count wins
    assert matrix.environment(None)[matrix.HYPOTHESIS_ENV] == "1000"


def test_the_default_versions_reach_every_era_and_every_boundary_a_pitfall_names():
    """The matrix is what runs the era tests: dropping a version from DEFAULT_VERSIONS must not leave an era, or a
    release where transformers changed what patchkit reads, untested (4.34's padding_mask, 4.35's removed helper,
    4.36's sdpa default and Cache objects, 4.38's mask and RoPE layout, 4.48's attention interface, 4.53's masking
    utils, 5.x). The pinned version runs in `make test`."""
    from packaging.version import Version

    from patchkit.eras import ERAS

    versions = [*plan.DEFAULT_VERSIONS, importlib.metadata.version("transformers")]
    for era in ERAS:
        assert any(v in era for v in versions), f"no version of era {era.name} in the matrix"
    for boundary in ("4.34", "4.35", "4.36", "4.38", "4.48", "4.53"):
        low = Version(boundary)
        assert any(low <= Version(v) < Version(f"4.{low.minor + 1}") for v in versions), f"no {boundary}.x"
    assert any(Version(v) >= Version("5.0") for v in plan.DEFAULT_VERSIONS), "no 5.x besides the pinned one"


def test_rotating_runs_every_minor_of_the_pool_beside_the_versions_named(ran, tmp_path):
    """`--versions rotating` runs each minor CI takes one a day of (before landing a test: a minor the change
    breaks fails CI only on its day), beside any version named with it."""
    assert matrix.main(["--versions", "rotating,5.0.0", "--cache-dir", str(tmp_path)]) == 0
    assert list(ran) == [*plan.ROTATING, "5.0.0"]


def test_each_run_adds_one_minor_between_the_boundaries_and_the_pool_comes_round(ran, monkeypatch, tmp_path, capsys):
    """A run of `make matrix` adds the date's minor from ROTATING, in version order among the boundaries; as many
    days as the pool holds run every one of its minors once; each lies inside patchkit's eras, between two
    boundaries, and is none of them."""
    import datetime

    from packaging.version import Version

    from patchkit.eras import ERAS

    days = [datetime.date(2026, 12, 2) + datetime.timedelta(days=n) for n in range(len(plan.ROTATING))]
    assert sorted(plan.rotating_minor(d) for d in days) == sorted(plan.ROTATING)
    assert plan.rotating_minor(days[0]) != plan.rotating_minor(days[1])
    for day in days[:2]:
        versions = plan.default_versions(day)
        assert sorted(set(versions) - set(plan.DEFAULT_VERSIONS)) == [plan.rotating_minor(day)]
        assert versions == sorted(versions, key=Version)
    low, high = (Version(f(plan.DEFAULT_VERSIONS, key=Version)) for f in (min, max))
    for minor in plan.ROTATING:
        assert minor not in plan.DEFAULT_VERSIONS and low < Version(minor) < high
        assert any(minor in era for era in ERAS), minor
    assert matrix.main(["--cache-dir", str(tmp_path)]) == 0
    assert set(ran) == set(plan.default_versions())
    assert f"today's minor between the boundaries: {plan.rotating_minor()}" in capsys.readouterr().out


def test_a_dependency_the_index_lacks_is_named_for_an_install_without_it(tmp_path):
    """transformers 5.25 requires `kernels` >=0.19.1, which this machine's package index lacks: the newest leg then
    installs the release alone (--no-deps) and says so, where pip's failure failed the leg before any test ran."""
    log = tmp_path / "install.log"
    log.write_text("ERROR: Could not find a version that satisfies the requirement kernels<0.20,>=0.19.1 (from "
                   "transformers) (from versions: 0.17.2)\nERROR: No matching distribution found for kernels<0.20,"
                   ">=0.19.1\nERROR: No matching distribution found for kernels<0.20,>=0.19.1\n")
    assert matrix.unavailable(log) == ["kernels"]
    log.write_text("ERROR: No matching distribution found for transformers==9.9.9\n")
    assert matrix.unavailable(log) == ["transformers"]  # the release itself: no install without it
