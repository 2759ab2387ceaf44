"""conftest.py that run_suite.py writes next to safetensors' own tests (a copy of this file with
the ``PATCH`` line set).

pytest imports a rootdir conftest before it imports any test module, so the patch below is in
place when the test modules run ``from safetensors import safe_open`` and
``from safetensors.torch import load_file``: those names are gpufeed's. With ``PATCH = False``
(``run_suite.py --no-patch``) nothing is patched: the baseline, safetensors against itself.

Every test's outcome is written as JSON to ``$GPUFEED_SUITE_REPORT`` for run_suite.py's
summary."""

import json
import os

PATCH = False  # run_suite.py rewrites this line

import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402

# Kept in a list: a patch that rewrites every module attribute bound to safe_open (as it must,
# for modules that did `from safetensors import safe_open`) would rewrite a module global too.
_ORIGINAL = [safetensors._safetensors_rust.safe_open]

if PATCH:
    import gpufeed

    gpufeed.patch_safetensors()
    if safetensors.safe_open is _ORIGINAL[0]:
        raise RuntimeError(
            "gpufeed.patch_safetensors() left safetensors.safe_open as safetensors' own"
        )
elif safetensors.safe_open is not _ORIGINAL[0]:
    raise RuntimeError(
        "the baseline (--no-patch) found safetensors.safe_open patched "
        f"({safetensors.safe_open!r}); is GPUFEED_PATCH_SAFETENSORS set?"
    )


def pytest_report_header(config):
    where = "gpufeed (patched)" if PATCH else "safetensors' own (baseline)"
    return [
        f"safetensors {safetensors.__version__} from {os.path.dirname(safetensors.__file__)}",
        f"safetensors.safe_open: {where}: {safetensors.safe_open!r}",
        f"safetensors.torch.load_file: {safetensors.torch.load_file!r}",
    ]


_OUTCOMES = {}


def pytest_runtest_logreport(report):
    """One outcome per test: an error in setup or teardown counts as ``error``, a failed call
    as ``failed``; xfail / xpass as pytest reports them."""
    previous = _OUTCOMES.get(report.nodeid)
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    else:
        outcome = previous or "passed"
    if previous in ("failed", "error") and outcome not in ("failed", "error"):
        outcome = previous  # a teardown that passes does not undo a failure
    if previous == "skipped" and report.when == "teardown" and outcome == "passed":
        outcome = previous
    _OUTCOMES[report.nodeid] = outcome


def pytest_collectreport(report):
    if report.failed:
        _OUTCOMES[report.nodeid or "<collection>"] = "error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("GPUFEED_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"patched": PATCH, "exitstatus": int(exitstatus), "tests": _OUTCOMES}, f)
