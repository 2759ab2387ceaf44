#!/usr/bin/env python3
"""safetensors' own PyTorch tests, run against gpufeed's drop-in ``safe_open``.

    python run_suite.py SDIST [--no-patch] [--keep] [--workdir DIR] [PYTEST ARGS...]

SDIST is safetensors' source distribution, unpacked (a directory) or not (``.tar.gz``), e.g.
from ``pip download --no-binary :all: --no-deps safetensors==0.9.0rc1``. Its tests
``bindings/python/tests/{test_pt_comparison,test_pread_backend,test_pt_model,test_simple}.py``
and ``tests/data`` are copied into a temporary directory laid out as upstream runs them
(``./tests/...`` from ``bindings/python``), next to a ``conftest.py`` that calls
``gpufeed.patch_safetensors()`` before pytest imports the test modules, so their
``from safetensors import safe_open`` (and ``safetensors.torch.load_file``) are gpufeed's.
pytest then runs there with the remaining arguments passed through (``-k EXPR``, ``-x``, ``-q``,
...; ``--`` ends this script's own options). A summary follows: how many passed, failed, errored
and were skipped, and the ids of the failing tests.

``--no-patch`` runs the same tests against safetensors itself: the baseline (tests that fail
there are not gpufeed's doing). ``--keep`` leaves the directory (its path is printed);
``--workdir DIR`` uses DIR (created, must be empty) instead of a temporary directory.

The exit code is pytest's. The interpreter is this one (``sys.executable``): run the script
with the Python that has torch, safetensors, pytest and (unless ``--no-patch``) gpufeed.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "conftest_template.py")
TEST_FILES = ("test_pt_comparison.py", "test_pread_backend.py", "test_pt_model.py",
              "test_simple.py")
TESTS_IN_SDIST = os.path.join("bindings", "python", "tests")
# safetensors' bindings/python/setup.cfg [tool:pytest], the settings upstream runs with.
PYTEST_INI = """[pytest]
doctest_optionflags = NUMBER NORMALIZE_WHITESPACE ELLIPSIS
filterwarnings =
    error::pytest.PytestUnhandledThreadExceptionWarning
"""

USAGE = __doc__.split("\n\n")[1]


def fail(message, code=2):
    print(f"run_suite.py: {message}", file=sys.stderr)
    sys.exit(code)


def parse(argv):
    """(sdist, patch, keep, workdir, pytest_args): this script's options anywhere before a
    ``--``; the first other argument that is not an option is the sdist; everything else is
    pytest's, in order."""
    sdist, patch, keep, workdir, rest = None, True, False, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i + 1:])
            break
        if arg in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if arg == "--no-patch":
            patch = False
        elif arg == "--keep":
            keep = True
        elif arg == "--workdir":
            if i + 1 >= len(argv):
                fail("--workdir needs a directory")
            workdir = argv[i + 1]
            i += 1
        elif arg.startswith("--workdir="):
            workdir = arg.split("=", 1)[1]
        elif sdist is None and not arg.startswith("-"):
            sdist = arg
        else:
            rest.append(arg)
        i += 1
    if sdist is None:
        fail(f"no sdist given\nusage: {USAGE.strip()}\n(pip download --no-binary :all: "
             "--no-deps safetensors==0.9.0rc1 gives safetensors-0.9.0rc1.tar.gz)")
    return sdist, patch, keep, workdir, rest


def find_tests(root):
    """The sdist's ``bindings/python/tests`` under ``root`` (the sdist itself, or a directory
    holding it, as a tarball unpacks)."""
    candidates = [root] + [os.path.join(root, d) for d in sorted(os.listdir(root))
                           if os.path.isdir(os.path.join(root, d))]
    for base in candidates:
        tests = os.path.join(base, TESTS_IN_SDIST)
        if os.path.isdir(tests):
            return tests
    fail(f"{root} holds no {TESTS_IN_SDIST}: is it safetensors' sdist?")


def unpack(tarball, into):
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers()
                   if f"/{TESTS_IN_SDIST}/" in f"/{m.name}"]
        if not members:
            fail(f"{tarball} holds no {TESTS_IN_SDIST}: is it safetensors' sdist?")
        for m in members:
            if m.name.startswith("/") or ".." in m.name.split("/"):
                fail(f"{tarball}: refusing the member {m.name!r}")
        if sys.version_info >= (3, 12):
            tar.extractall(into, members=members, filter="data")
        else:
            tar.extractall(into, members=members)
    return into


def conftest_text(patch):
    with open(TEMPLATE) as f:
        text = f.read()
    line = "PATCH = False  # run_suite.py rewrites this line"
    if line not in text:
        fail(f"{TEMPLATE} lacks the line {line!r}")
    return text.replace(line, f"PATCH = {patch}  # written by run_suite.py", 1)


def prepare(tests_src, work, patch):
    tests = os.path.join(work, "tests")
    os.makedirs(tests)
    copied = []
    for name in TEST_FILES:
        src = os.path.join(tests_src, name)
        if os.path.isfile(src):
            shutil.copy2(src, tests)
            copied.append(name)
        else:
            print(f"run_suite.py: warning: the sdist has no {name}", file=sys.stderr)
    if not copied:
        fail(f"none of {', '.join(TEST_FILES)} in {tests_src}")
    data = os.path.join(tests_src, "data")
    if os.path.isdir(data):
        shutil.copytree(data, os.path.join(tests, "data"))
    else:
        os.makedirs(os.path.join(tests, "data"))  # the tests write their files there
    with open(os.path.join(work, "conftest.py"), "w") as f:
        f.write(conftest_text(patch))
    with open(os.path.join(work, "pytest.ini"), "w") as f:
        f.write(PYTEST_INI)
    return copied


def summarize(report_path, patch, code):
    what = "gpufeed (patched in)" if patch else "safetensors itself (--no-patch baseline)"
    try:
        with open(report_path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"\n== run_suite: {what}: no report from pytest ({e}); pytest exit code {code}")
        return
    outcomes = report["tests"]
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    shown = ", ".join(f"{counts.get(k, 0)} {k}" for k in order
                      if counts.get(k, 0) or k in ("passed", "failed", "skipped"))
    print(f"\n== run_suite: {what}: {shown} (pytest exit code {code})")
    failing = sorted(n for n, o in outcomes.items() if o in ("failed", "error"))
    if failing:
        print(f"== failing ({len(failing)}):")
        for n in failing:
            print(f"   {n}" + ("  [error]" if outcomes[n] == "error" else ""))


def main(argv):
    sdist, patch, keep, workdir, pytest_args = parse(argv)
    sdist = os.path.abspath(sdist)
    scratch = []
    try:
        if os.path.isdir(sdist):
            tests_src = find_tests(sdist)
        elif os.path.isfile(sdist) and tarfile.is_tarfile(sdist):
            unpacked = tempfile.mkdtemp(prefix="safetensors-sdist-")
            scratch.append(unpacked)
            tests_src = find_tests(unpack(sdist, unpacked))
        else:
            fail(f"{sdist} is neither a directory nor a tarball")
        if workdir:
            work = os.path.abspath(workdir)
            os.makedirs(work, exist_ok=True)
            if os.listdir(work):
                fail(f"--workdir {work} is not empty")
        else:
            work = tempfile.mkdtemp(prefix="gpufeed-safetensors-suite-")
            if not keep:
                scratch.append(work)
        copied = prepare(tests_src, work, patch)
        report_path = os.path.join(work, ".suite-report.json")
        env = dict(os.environ, GPUFEED_SUITE_REPORT=report_path)
        # The patch is the conftest's to make (or, for the baseline, not to make).
        env.pop("GPUFEED_PATCH_SAFETENSORS", None)
        # Test ids given (tests/test_simple.py::...) select; otherwise the copied files run.
        chosen = any(a.startswith("tests") for a in pytest_args)
        files = [] if chosen else [os.path.join("tests", n) for n in copied]
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", work,
               *files, *pytest_args]
        print(f"== run_suite: in {work}: {' '.join(cmd)}", flush=True)
        code = subprocess.call(cmd, cwd=work, env=env)
        summarize(report_path, patch, code)
        if keep or workdir:
            print(f"== kept {work}")
        return code
    finally:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
