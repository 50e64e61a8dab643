"""One training iteration of the tiny Kuhn Poker preset, run as one process of a (possibly multi-process)
run: ``tests/training/test_multiprocess.py`` starts it with ``tests._multiprocess.run_processes``.

Builds the run's parts, trains one iteration (rollout, log-prob recompute, update), logs it (process
0 writes ``metrics.jsonl``) and saves a checkpoint (every process writes its shards), then prints
``RESULT {json}``: the iteration's metrics and, per parameter, the sum and the sum of squares of the
trained values (gathered from every process).
"""

from __future__ import annotations

import json
import sys

from mage_jax.models import sharding as shd

shd.initialize_from_environment()  # before any other JAX call

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments.kuhn_poker import SPEC  # noqa: E402
from mage_jax.evaluation.evaluator import Evaluator  # noqa: E402
from mage_jax.training.assemble import (  # noqa: E402
    build_parts,
    make_best_checkpointer,
    make_checkpointer,
    make_logger,
)
from mage_jax.training.trainer import Trainer  # noqa: E402

OVERRIDES = {
    "rollout.num_tasks": 4, "rollout.group_size": 4, "optim.mini_batch_rows": 16,
    "train.iterations": 1, "train.eval_every": 0, "train.eval_meta_episodes": 8,
    "train.eval_heldout_meta_episodes": 8, "tokenizer.corpus_meta_episodes": 32,
    "rollout.length_buckets": [512], "checkpoint.every": 1, "logging.progress": False, "logging.plots": False,
    "mesh.data": -1, "mesh.fsdp": 1,
}


def main(run_dir: str) -> None:
    cfg = SPEC.config("tiny", {**OVERRIDES, "logging.run_dir": run_dir})
    parts = build_parts(cfg, run_dir)
    trainer = Trainer(parts, Evaluator(parts, SPEC.protocol(cfg), progress=False),
                      logger=make_logger(cfg, run_dir, resume=False),
                      checkpointer=make_checkpointer(cfg, run_dir),
                      best_checkpointer=make_best_checkpointer(cfg, run_dir))
    metrics = trainer.train_iteration(1)
    trainer.logger.log(1, metrics, split="train")
    trainer.logger.close()
    trainer.checkpointer.save(1, trainer.state, {"iteration": 1})  # every process writes its shards
    trainer.checkpointer.close()
    gathered = jax.tree.map(shd.to_host, trainer.state.params)
    sums = {shd.path_to_str(path): [float(np.sum(v, dtype=np.float64)),
                                     float(np.sum(np.square(v, dtype=np.float64)))]
            for path, v in jax.tree_util.tree_flatten_with_path(gathered)[0]}
    print("RESULT " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                                  "devices": jax.device_count(), "params": sums, "metrics": metrics}))


if __name__ == "__main__":
    main(sys.argv[1])
