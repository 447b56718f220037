"""Two processes joined by `jax.distributed.initialize` over loopback generate together.

Each process has 2 CPU devices (gloo collectives); the (2, 2) mesh puts rows across the
processes and weights within each. Both must return the single-device tokens, from
`generate` and from `stream`. The test
bounds its own time and kills whatever is still running when it ends.
"""

from __future__ import annotations

import subprocess

from ._run import REPO, command, free_port, parse, worker_env

TIMEOUT_S = 300


def test_two_processes_agree_with_single_process():
    port = free_port()
    procs = [
        subprocess.Popen(
            command("multiprocess", pid, port),
            cwd=REPO,
            env=worker_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the two processes ran past {TIMEOUT_S} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for pid, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"process {pid} exited with {rc}:\n{err[-5000:]}"
        results.append(parse(out, err, f"process {pid}"))
    single = results[0]["single"]
    for r in results:
        assert r["sharded"]["token_ids"] == single["token_ids"], r["process"]
        assert r["sharded"]["finish_reason"] == single["finish_reason"]
        assert r["sharded"]["top_ids"] == single["top_ids"]
        assert r["streamed"] == single["token_ids"]
