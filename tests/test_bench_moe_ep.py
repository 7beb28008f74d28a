"""bench/moe_ep.py on CPUs: two gloo ranks under torchrun on the tiny DeepSeek-V3 export, the
same steps as on GPUs (the check of every combine form against the whole layer, then the
timings); and its refusal to run without a process group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import moe_ep
import pytest

from nvfp4_group_gemm import expert_parallel

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_two_gloo_ranks_check_and_time_every_combine_form(tmp_path):
    rows_path = tmp_path / "rows.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO_ROOT / "bench" / "moe_ep.py"), "--tiny", "--device", "cpu", "--tokens", "1,4",
               "--repeats", "1", "--check-tokens", "8", "--export", str(tmp_path / "export"), "--json", str(rows_path)]
    environment = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=environment,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = [line for line in done.stdout.splitlines() if line.startswith("check ")]
    assert [line.split()[1:3] for line in checks] == [[form, "ok:"] for form in expert_parallel.COMBINES], checks
    rows = json.loads(rows_path.read_text())
    assert [(row["tokens_per_gpu"], row["form"]) for row in rows] == [
        (tokens, form) for tokens in (1, 4) for form in expert_parallel.COMBINES]
    for row in rows:
        assert row["ranks"] == 2 and row["layer_us"] > 0 and row["collective_us"] > 0, row
        assert row["scaling"] == pytest.approx(row["one_gpu_1_over_n_us"] / row["layer_us"]), row


def test_without_a_process_group_it_says_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert moe_ep.main(["--tiny", "--device", "cpu"]) == 2
    assert "run it under torchrun --nproc-per-node N" in capsys.readouterr().err
