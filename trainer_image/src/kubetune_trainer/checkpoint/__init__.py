"""Checkpoints: where one is written, listed and resumed. Imports nothing (torch-free to import).

  files.py           a checkpoint directory `checkpoint-<step>/` and its manifest.json, written last:
                     sizes and checksums (verify), which directories exist, pruning old ones. Torch-free.
  sharded.py         the trained state inside it (state/, torch.distributed.checkpoint): saved by every
                     process, resharded on load, checked whole before a resume (damage). Torch.
  training_state.py  the run's position, batching and random state beside it (trainer_state.json,
                     scheduler.pt, rng-rank<R>.pt). Torch.
  store.py           where checkpoints are written: each process's share uploaded (s3://) or kept
                     (local), the manifest published last; newest_intact finds the one to resume. Torch-free.
  runs.py            a job's run versions <job>/v<N>/ and run.json: which version a (re)started run
                     writes, which earlier ones `resumeFrom: latest` may resume. Torch-free.
  resume.py          where a run writes and which checkpoint it starts from, decided once by the main
                     process, refused before anything is written when it cannot work. Torch-free to import.
  catalog.py         what `kubetune checkpoints ls/pull`, `trained` and the run report list: runs,
                     their checkpoints and final weights. Torch-free (the CLI imports it).

Dependencies run one way: these modules import kubetune_api, kubetune_trainer.storage (URIs, S3,
trees, the uploader), kubetune_trainer.errors and each other, never the trainer's loop or run, and
kubetune_trainer.storage never imports them (tests/unit/test_checkpoint_package.py).
"""
