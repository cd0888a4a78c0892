"""The libraries' log lines and warnings that are about their own internals, not the user's run, kept off the
terminal: set once as a command starts."""

from __future__ import annotations

import logging
import warnings


def quiet_library_deprecations() -> None:
    """torchao (imported by precision=fp8 and by transformers) registers enums with torch's pytree, which newer
    torch logs as deprecated at every import: two lines about libraries' internals before every such run."""
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
    # alembic (under Optuna's storages and MLflow) logs "setup plugin ..." at INFO, and Hydra's console handler on
    # the root logger printed a dozen of them before a sweep's first job
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # botocore (s3fs's aiobotocore, under train.checkpoint.mirror=s3://...) logs "Found credentials in environment
    # variables." at INFO: printed through that handler before the run's own first line, in every run with an S3 mirror
    for name in ("botocore.credentials", "aiobotocore.credentials"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # MLflow logs its SQLite store's set-up ("Creating initial MLflow database tables...") at INFO through a console
    # handler of its own, between a run's step lines (logger=mlflow with a sqlite:/// tracking URI)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # inductor (torchao's optimizers compile their update) asks for CUDA_HOME on a CPU-only machine with a CUDA
    # build of torch, and torch logs that it found no CUDA runtime there: a line about torch's install mid-run
    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: "No CUDA runtime is found" not in record.getMessage())
    # and AOTAutograd warns, on that compile, that torchao's optimizer-state tensor subclasses lack a hash for its
    # cache: advice to torchao's authors, two lines in the middle of the user's run
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching", category=UserWarning)


class WordWrappingFormatter(logging.Formatter):
    """Hydra's console lines (conf/hydra/hydra_logging/terminal.yaml) broken at word boundaries on a terminal, as
    ampctl's own are (io.for_the_terminal); off a terminal, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        from ampctl.io import for_the_terminal

        return for_the_terminal(super().format(record))
