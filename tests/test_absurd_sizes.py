"""Absurd sizes fail fast and small: each case below is refused (or, for the largest models the
limits allow, answered) in under a second of CPU time (and ten of wall-clock time, so a case that
blocks fails too), and the process running all of them never holds more than 200 MB. Measured in
a child process: its own clocks around each command (CPU time: the wall clock of a machine other
work shares says more about the machine than the case), and its peak resident memory (VmHWM,
else ``resource.getrusage``) at the end, imports included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource")  # POSIX only

TINY = """\
architecture: decoder-only
vocab_size: 256
d_model: 64
max_seq_len: 64
decoder:
  n_layers: 2
  attention: {n_heads: 4}
"""
SECONDS = 1.0
#: wall-clock seconds a case may take (one that waits instead of working shows here)
WALL_SECONDS = 10.0
MEGABYTES = 200

CHILD = textwrap.dedent("""
    import contextlib, io, json, resource, sys, time
    from yamlformer.builder.cli import main

    def peak_mb():
        # VmHWM: this process's own peak (ru_maxrss after fork and exec can report the parent's)
        try:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
        except (OSError, StopIteration):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cases = json.loads(sys.argv[1])
    main(["validate", cases[0][1][-1]])  # imports (pydantic, the registry) before the clock starts
    out = []
    for name, argv, expected in cases:
        buffer = io.StringIO()
        start, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                status = main(argv)
            except SystemExit as exc:
                status = exc.code
        out.append([name, status, [time.process_time() - cpu, time.perf_counter() - start],
                    buffer.getvalue()[-400:], peak_mb()])
    print(json.dumps({"cases": out, "peak_mb": peak_mb()}))
""")


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_absurd_sizes_fail_in_under_a_second_and_200_mb(tmp_path):
    ok = _write(tmp_path / "ok.yaml", TINY)
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:  # 50 MB of real YAML
        line = "key: value\n"
        f.write("name: big\n" + line * (50_000_000 // len(line)))
    nested = _write(tmp_path / "nested.yaml", "name: deep\nx: " + "[" * 100_000 + "]" * 100_000 + "\n")
    lol = ["name: lol", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lol += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    laughs = _write(tmp_path / "lol.yaml", "\n".join(lol) + "\n")
    many = _write(tmp_path / "many.yaml", "name: many\nx: [" + ", ".join(["1"] * 300_000) + "]\n")  # ~0.9 MiB
    _write(tmp_path / "c0.yaml", TINY)
    for i in range(1, 2000):
        _write(tmp_path / f"c{i}.yaml", f"extends: c{i - 1}.yaml\n")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    layers = _write(tmp_path / "layers.yaml", TINY.replace("n_layers: 2", "n_layers: 1000000000"))
    width = _write(tmp_path / "width.yaml", TINY.replace("d_model: 64", f"d_model: {10**30}"))
    deepest = _write(
        tmp_path / "deepest.yaml",
        TINY.replace(
            "n_layers: 2",
            "n_layers: 10000\n  overrides: [{layers: '0::2', attention: {n_heads: 4, sliding_window: 8}}]",
        ),
    )
    cases = [
        ("50 MB YAML", ["validate", str(big)], 1),
        ("100,000 deep", ["validate", nested], 1),
        ("billion laughs", ["validate", laughs], 1),
        ("300,000 nodes", ["validate", many], 1),
        ("2,000-file extends chain", ["validate", str(tmp_path / "c1999.yaml")], 1),
        ("FIFO without a writer", ["validate", str(fifo)], 1),
        ("n_layers: 1000000000", ["describe", layers], 1),
        ("d_model: 10**30", ["compare", width], 1),
        ("--seq-len 10**18", ["describe", ok, "--seq-len", str(10**18)], 2),
        ("--batch 10**18", ["describe", ok, "--batch", str(10**18)], 2),
        ("--global-batch 2**30", ["plan", ok, "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", str(2**30)], 0),
        ("describe 10,000 layers", ["describe", deepest, "--json"], 0),
        ("compare 10,000 layers", ["compare", deepest], 1),
    ]
    if os.path.exists("/dev/zero"):
        cases.append(("/dev/zero", ["validate", "/dev/zero"], 1))
    cases.insert(0, ("warm-up", ["validate", ok], 0))
    env = dict(os.environ)
    run = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    expected = {name: status for name, _, status in cases}
    slow = [
        (name, round(cpu, 2), round(wall, 2))
        for name, _, (cpu, wall), _, _ in report["cases"]
        if cpu > SECONDS or wall > WALL_SECONDS
    ]
    wrong = [(name, status, text) for name, status, _, text, _ in report["cases"] if status != expected[name]]
    assert not wrong, wrong
    assert not slow, slow
    for name, _, _, text, _ in report["cases"]:
        assert "Traceback" not in text and "internal error" not in text, (name, text)
    peaks = [(name, round(mb)) for name, _, _, _, mb in report["cases"]]  # the peak so far, after each case
    assert report["peak_mb"] < MEGABYTES, peaks
