"""The pure parts of a worker over several GPUs (worker/rank_pool.py, worker/main.py, the CLI): how back-fills are dealt
to the ranks, a rank's share of a pack, the worker's devices and id, and `--gpus` parsing. The ranks themselves run
in tests/engine/test_distributed.py and tests/e2e/test_multi_gpu_worker.py."""

from __future__ import annotations

import socket

import pytest
import torch

from loraplane.cli import build_parser
from worker.main import default_worker_id, pick_devices
from worker.rank_pool import deal_admissions


def test_back_fills_go_to_the_ranks_with_the_most_free_slots() -> None:
    assert deal_admissions(["a", "b", "c"], [1, 2]) == [["b"], ["a", "c"]]
    assert deal_admissions(["a", "b"], [2, 2]) == [["a"], ["b"]]  # ties: the lower rank first, then in turn
    assert deal_admissions(["a", "b", "c"], [0, 1]) == [[], ["a"]]  # no more than the free slots
    assert deal_admissions([], [3, 3]) == [[], []]
    assert deal_admissions(["a"], [0, 0]) == [[], []]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of a machine without CUDA")
def test_without_cuda_each_gpu_asked_for_is_a_rank_on_the_cpu() -> None:
    assert pick_devices(None) == [torch.device("cpu")]
    assert pick_devices([0]) == [torch.device("cpu")]
    assert pick_devices([0, 1]) == [torch.device("cpu")] * 2


def test_a_worker_over_several_gpus_is_named_after_them() -> None:
    host = socket.gethostname()
    assert default_worker_id([0, 1], torch.device("cuda:0")) == f"{host}-gpu0-1"
    assert default_worker_id([3], torch.device("cuda:3")) == f"{host}-gpu3"
    assert default_worker_id(None, torch.device("cpu")) == f"{host}-cpu"


def test_gpus_is_a_list_of_distinct_indices_and_excludes_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["worker", "--gpus", "0,1"]).gpus == [0, 1]
    assert parser.parse_args(["worker", "--gpu", "2"]).gpu == 2
    for bad, why in (("0,x", "not a comma-separated list"), ("1,1", "distinct"), ("-1,0", "not negative")):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["worker", f"--gpus={bad}"])  # "=": argparse reads "-1,0" alone as an option
        assert exited.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--gpu", "0", "--gpus", "0,1"])
    assert "not allowed with argument" in capsys.readouterr().err
