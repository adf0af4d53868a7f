"""Which errors are the user's to fix: a wrong config, dataset, run directory or resume.

Code that reads the user's input marks the errors it raises (:func:`user_errors`); the command
line reports a marked error in one line (exit status 2) and lets every other error, a bug or a
failure during training, propagate with its traceback."""
from __future__ import annotations

import contextlib

_MARK = "hacpo_user_error"
# what reading a config, a dataset, a run directory or a checkpoint raises
SETUP_ERRORS = (ValueError, KeyError, OSError, RuntimeError)


@contextlib.contextmanager
def user_errors(*types: type[BaseException]):
    """Mark an error of ``types`` (default :data:`SETUP_ERRORS`) raised inside as the user's."""
    try:
        yield
    except types or SETUP_ERRORS as e:
        setattr(e, _MARK, True)
        raise


def is_user_error(e: BaseException) -> bool:
    return bool(getattr(e, _MARK, False))
