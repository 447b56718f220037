"""The lm-eval backend with `mesh=` model_args, run in a subprocess with 2 fake CPU devices
(`python -m tests.integrations.lm_eval_mesh_worker FOLDER`; the parent test sets XLA_FLAGS
before jax is imported, `tests.sharding._run.worker_env`): the multiple-choice requests of
`lm_eval_tasks.MC_DOCS` scored on no mesh, the (1, 1) mesh and the (2, 1) mesh, whose two
data shards split the rows and each context's shared prompt pass."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from lm_eval.api.instance import Instance  # noqa: E402

from logitloop.integrations.lm_eval import LogitloopLM  # noqa: E402
from tests.integrations.lm_eval_tasks import MC_DOCS  # noqa: E402


def main(folder: str) -> None:
    requests = [
        Instance("loglikelihood", doc, (doc["question"], choice), i)
        for doc in MC_DOCS
        for i, choice in enumerate(doc["choices"])
    ]
    out = {}
    for mesh in (None, "1x1", "2x1"):
        lm = LogitloopLM(pretrained=folder, dtype="float32", batch_size=4, mesh=mesh)
        out[str(mesh)] = [list(r) for r in lm.loglikelihood(requests, disable_tqdm=True)]
    print("RESULT:" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
