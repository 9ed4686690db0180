"""Ranks as threads of one process on one GPU are refused at creation with an error that names
the cause and the fix (they would share one CUDA context, whose synchronising calls deadlock
against a peer's waiting kernel: on one H200 such ranks timed out in the init self-test and then
faulted the context). Part of the GPU suite (conftest.py: skipped, with
the reason, where torch or a GPU is missing).
"""

import os
import secrets
import tempfile
import threading


def test_two_threads_on_one_gpu_are_refused_naming_the_fix():
    import tpar

    directory, job, outcome = tempfile.mkdtemp(), secrets.token_hex(8), {}

    def rank_main(rank):
        try:
            comm = tpar.Communicator(
                rank, 2, device=0, rendezvous=os.path.join(directory, "rdv"), token=job, timeout=20
            )
            comm.close()
            outcome[rank] = "created"
        except tpar.TparError as e:
            outcome[rank] = str(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "creation did not return within 60 s"
    for rank in range(2):
        assert (
            "threads of one process" in outcome[rank] and "one process per rank" in outcome[rank]
        ), outcome
