"""worker.openmp: a thread's OpenMP team ends when released (its worker threads exit)."""

import os
import threading

import pytest
import torch

from worker.openmp import release_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_release_team_ends_a_threads_team():
    counts: dict[str, int | bool] = {}

    def work() -> None:
        torch.set_num_threads(2)
        counts["before"] = _threads()
        x = torch.ones(2048, 2048)
        (x @ x).sum()  # a parallel op: this thread's team of 2 starts
        counts["with team"] = _threads()
        counts["released"] = release_team()
        counts["after"] = _threads()
        (x @ x).sum()  # and a new one starts when needed
        counts["again"] = _threads()

    before = torch.get_num_threads()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.set_num_threads(before)
    assert counts["released"] is True
    assert counts["with team"] > counts["before"]
    assert counts["after"] == counts["before"]
    assert counts["again"] == counts["with team"]
