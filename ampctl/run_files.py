"""The run directory's layout: every name ampctl writes into a run directory, in one place. Code reads these
constants; docstrings and messages may say the names.

    <run_dir>/
      identity.json        the run's identity, written once when it starts (runner/identity.py)
      metrics.jsonl        one row per optimizer step (engine/telemetry.py)
      evals.jsonl          one row per held-out evaluation (runner/eval_records.py)
      ranges.jsonl         telemetry.ranges_every's per-layer value ranges (analysis/ranges.py)
      diffs.jsonl          train.diff.every's per-layer error against fp32 (runner/layer_error_log.py)
      blocks.jsonl         telemetry.blocks_every's block scales per layer and operand (analysis/block_scales.py)
      experts.jsonl        a mixture of experts' load per layer, telemetry.experts_every (analysis/expert_load.py)
      escalations.jsonl    guard.on_trip=escalate's escalations: layers raised, from which step
                           (runner/guarding/escalation.py)
      summary.json         what ran, and its figures, when it ends (runner/run.py)
      diagnosis.json       the layer a guard's stop found (runner/guarding/diagnose.py)
      trackers.json        the tracker runs a resume continues (runner/trackers/)
      checkpoints/         step_NNNNNNNN.pt (or .dcp/) with .sha256 sidecars, best/
                           (runner/checkpointing/checkpoint_files.py)
      train.log            the run's log (compare.log, memory.log, inspect.log, advise.log, diff.log for those)
      error.txt            a failed multirun job's one line (the sweep's table shows it)
      .ampctl.lock         held (flock) by the process recording into the directory; the kernel frees it on kill
      .hydra/              Hydra's record of the composed config

A study's directory (compare, memory, inspect) holds its table as <stem>.csv and <stem>.json, the record that
`ampctl report` renders again, beside report.md and its plots; one training run per mode under compare's.
"""

from __future__ import annotations

IDENTITY = "identity.json"
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
RANGES = "ranges.jsonl"
LAYER_ERRORS = "diffs.jsonl"
BLOCKS = "blocks.jsonl"
EXPERTS = "experts.jsonl"
ESCALATIONS = "escalations.jsonl"
SUMMARY = "summary.json"
DIAGNOSIS = "diagnosis.json"
TRACKER_IDS = "trackers.json"
CHECKPOINTS = "checkpoints"
TRAIN_LOG = "train.log"
ERROR = "error.txt"
LOCK = ".ampctl.lock"
HYDRA = ".hydra"

# appended to step by step; a resume cuts them back to its checkpoint
ROWS = (METRICS, EVALS, RANGES, LAYER_ERRORS, BLOCKS, EXPERTS, ESCALATIONS)
RECORDS = (*ROWS, SUMMARY, DIAGNOSIS)  # what a run recorded: another run never replaces them
# the studies' table stems: comparison.json, memory.json, ranges.json are their records
COMPARISON, MEMORY, INSPECTION, ADVICE, DIFF = "comparison", "memory", "ranges", "advice", "diff"

# What a command that recorded nothing leaves (Hydra's own files, the lock, and its log: <hydra.job.name>.log, the
# command's name, as its .hydra/hydra.yaml says: runner/ownership.is_leftover): a directory holding only these is
# free for a new run, and is removed when a run is refused (commands/train.py)
LEFTOVERS = frozenset({HYDRA, LOCK})
# Every name a run writes at the top of its directory: a tracker's files may be none of these
RUN_OWN_NAMES = frozenset({*RECORDS, *LEFTOVERS, TRAIN_LOG, IDENTITY, CHECKPOINTS, "profile", "wandb"})

