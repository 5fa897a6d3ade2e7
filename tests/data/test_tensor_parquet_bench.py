"""``benchmarks/tensor_parquet.py --quick`` runs end to end (tiny rows) and cleans up after itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_benchmark(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tensor_parquet.py"), "--quick",
                           "--workdir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for key in ("reference/whole row group", "reference/ff two-level", "ff/ff", "memcpy", "ff/loader1", "ff/loader2",
                "ff/loader1/hand_off", "ff/loader2/hand_off", "ff/dataflow0", "ff/dataflow2/hand_off"):
        assert results[key]["rows_s"] > 0, key
    assert "| ff | ff |" in done.stdout
    assert list(tmp_path.iterdir()) == []  # the generated shards are gone
