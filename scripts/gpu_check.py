#!/usr/bin/env python3
"""``make gpu-check``: everything kvmesh knows how to prove on one CUDA GPU, in one run, as one JSON.

On a machine with CUDA: the ``gpu``-marked tests (``pytest -m gpu tests/gpu/test_gpu_*.py``, each
outcome), the GPU benchmarks of ``kvmesh.loadgen.gpu_bench`` (figures and ratios against their
references in the same run), the device name, torch / triton / transformers versions, and a
SoftRoCE attempt (``modprobe rdma_rxe``; ``rdma link add rxe0 type rxe netdev <first non-lo
interface>``; if both work, ``pytest -m rdma``, otherwise the exact error). Prints one JSON object
on stdout (progress goes to stderr).

Without CUDA it says so in one line and exits 0.

``--device cpu`` is the dry run: the same benchmark code on the CPU at tiny sizes with Triton under
``TRITON_INTERPRET=1`` (and the gpu tests, which then skip), so the script's paths are exercised
by the normal test suite (tests/gpu/test_gpu_check.py). Its figures are labelled as a dry run and
claim no goal. docs/gpu.md says what has and has not run on real hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = "tests/gpu/test_gpu_*.py"
TESTS_TIMEOUT_S = 420
RDMA_TIMEOUT_S = 180

Runner = Callable[[list[str], float], subprocess.CompletedProcess]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command, capturing text output; a missing binary or a timeout is a result too."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
        )
    except FileNotFoundError as exc:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: {exc}")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(argv, 124, out, f"timed out after {timeout} s")


def _log(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


# --- pytest outcomes -------------------------------------------------------------------------


def parse_junit(xml_text: str) -> dict[str, Any]:
    """Each test's outcome from pytest's JUnit XML: passed / failed / error / skipped, with the
    skip reason or the failure's first lines; and the counts."""
    root = ET.fromstring(xml_text)
    tests = []
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome, detail = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                text = node.get("message") or node.text or ""
                detail = "\n".join(text.strip().splitlines()[:12])[:2000]
                break
        counts[outcome] += 1
        row = {
            "test": f"{case.get('classname', '')}::{case.get('name', '')}",
            "outcome": outcome,
            "seconds": round(float(case.get("time", 0.0)), 2),
        }
        if detail:
            row["detail"] = detail
        tests.append(row)
    return {"counts": counts, "tests": tests}


def run_pytest(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``pytest`` with ``args``, outcomes parsed from its JUnit XML; the tail of its output when
    it produced no report (collection error, timeout)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        argv += [f"--junitxml={report}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
                env=env,
                check=False,
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 124, f"pytest timed out after {timeout} s: {exc.stdout!r}"[-4000:]
        result: dict[str, Any] = {"argv": argv[3:-1], "returncode": rc}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if report.exists():
            result.update(parse_junit(report.read_text()))
        if rc not in (0, 5) or not report.exists():  # 5: nothing collected
            result["output_tail"] = output[-4000:]
        return result


# --- SoftRoCE --------------------------------------------------------------------------------


def first_netdev(sys_class_net: Path = Path("/sys/class/net")) -> str | None:
    """The first network interface other than lo, by name."""
    with contextlib.suppress(OSError):
        names = sorted(p.name for p in sys_class_net.iterdir() if p.name != "lo")
        return names[0] if names else None
    return None


def softroce_attempt(
    run: Runner = _run,
    netdev: str | None = None,
    rdma_tests: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``modprobe rdma_rxe``, then ``rdma link add rxe0 type rxe netdev <netdev>``; if both work
    (or rxe0 exists already), the rdma tests. Every step's command, exit status and output."""
    netdev = netdev or first_netdev()
    steps = []
    result: dict[str, Any] = {"netdev": netdev, "steps": steps, "working": False}

    def step(argv: list[str]) -> bool:
        proc = run(argv, 60)
        steps.append(
            {
                "cmd": " ".join(argv),
                "returncode": proc.returncode,
                "output": ((proc.stdout or "") + (proc.stderr or "")).strip()[-1000:],
            }
        )
        return proc.returncode == 0

    if netdev is None:
        result["error"] = "no network interface other than lo"
        return result
    if not step(["modprobe", "rdma_rxe"]):
        result["error"] = f"modprobe rdma_rxe failed: {steps[-1]['output']}"
        return result
    if not step(["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", netdev]):
        output = steps[-1]["output"]
        if "exists" not in output.lower() and "file exists" not in output.lower():
            result["error"] = f"rdma link add failed: {output}"
            return result
    step(["rdma", "link", "show"])
    result["working"] = True
    if rdma_tests is not None:
        result["rdma_tests"] = rdma_tests()
    return result


# --- the run ---------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError as exc:
            out[name] = f"not importable: {exc}"
    out["cuda_runtime"] = str(torch.version.cuda)
    return out


def gpu_test_files() -> list[str]:
    """tests/gpu/test_gpu_*.py but this script's own CPU test (which has no gpu tests)."""
    paths = (os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / GPU_TESTS)))
    return sorted(p for p in paths if not p.endswith("test_gpu_check.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the dry run (tiny sizes, Triton interpreted; code-path check, not GPU figures)",
    )
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest runs")
    parser.add_argument("--no-softroce", action="store_true", help="skip the SoftRoCE attempt")
    parser.add_argument("--json-out", type=Path, help="also write the summary to this file")
    parser.add_argument(
        "-k", dest="pytest_k", help="only the gpu tests matching this pytest -k expression (reruns)"
    )
    parser.add_argument(
        "--bench",
        action="append",
        choices=("kv_pack", "paged_decode_attention", "engine_decode"),
        help="only this benchmark (repeatable; default all)",
    )
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    if dry:  # before triton is imported: @triton.jit reads it when the kernels are defined
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if not dry and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing run")
        return 0
    from kvmesh.loadgen import gpu_bench, gpu_sizes, realistic_model

    device = torch.device(args.device)
    summary: dict[str, Any] = {
        "mode": "cpu-dry-run" if dry else "gpu",
        "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(device),
        "versions": versions(),
    }
    if dry:
        summary["note"] = (
            "CPU dry run at tiny sizes, Triton under TRITON_INTERPRET=1: checks the script's code "
            "paths only; none of these figures is a GPU's"
        )
    else:
        props = torch.cuda.get_device_properties(device)
        summary["device_memory_gib"] = round(props.total_memory / 2**30, 1)
    # the seeded 1.1 B-parameter checkpoint is drawn once (about a minute on the CPU) and shared
    # by the engine tests and the engine benchmark
    cache = tempfile.TemporaryDirectory(prefix="kvmesh-gpu-check-")
    os.environ[realistic_model.SEEDED_CACHE_ENV] = cache.name
    env = dict(os.environ)
    if not args.no_tests:
        _log(f"pytest -m gpu {' '.join(gpu_test_files())}")
        selection = ["-k", args.pytest_k] if args.pytest_k else []
        summary["gpu_tests"] = run_pytest(
            ["-m", "gpu", *selection, *gpu_test_files()], env, TESTS_TIMEOUT_S
        )
    _log("benchmarks")
    sizes = gpu_sizes.DRY_SIZES if dry else gpu_sizes.GPU_SIZES
    summary["benchmarks"] = gpu_bench.run_all(sizes, device, dry_run=dry, only=args.bench)
    if dry or args.no_softroce:
        summary["softroce"] = "not attempted (dry run or --no-softroce)"
    else:
        _log("SoftRoCE")
        summary["softroce"] = softroce_attempt(
            rdma_tests=None
            if args.no_tests
            else lambda: run_pytest(["-m", "rdma", "tests"], env, RDMA_TIMEOUT_S)
        )
    cache.cleanup()
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
