"""Key-mismatch policies of a distributed load (`--dist-ckpt-strictness`, Megatron-Core's StrictHandling).

    unexpected keys   asked for by this run but absent from the checkpoint (their tensors keep their values)
    missing keys      in the checkpoint but asked for by no rank (e.g. optimizer state under --no-load-optim)

    assume_ok_unexpected   unexpected keys raise (the default); missing keys are not looked for
    raise_unexpected       the same
    raise_all              unexpected or missing keys raise
    log_unexpected         unexpected keys are logged and skipped
    log_all                unexpected and missing keys are logged; unexpected ones skipped
    return_unexpected      unexpected keys are skipped and returned by `load`
    return_all             unexpected and missing keys are returned by `load`
    ignore_all             mismatches are skipped silently
"""

import logging
from typing import List

logger = logging.getLogger(__name__)

STRICT_HANDLING = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all", "return_unexpected",
    "return_all", "ignore_all",
)


def check_strictness(strict: str) -> None:
    """Refuses names that are not a policy."""
    if strict not in STRICT_HANDLING:
        raise ValueError(f"dist-checkpoint strictness {strict!r} is not one of {', '.join(STRICT_HANDLING)}")


def raises_on_unexpected(strict: str) -> bool:
    return strict in ("assume_ok_unexpected", "raise_unexpected", "raise_all")


def looks_for_missing(strict: str) -> bool:
    return strict in ("log_all", "raise_all", "return_all")


def returns_mismatches(strict: str) -> bool:
    return strict.startswith("return_")


def describe(keys: List[str]) -> str:
    """Up to 8 keys, sorted, and how many more."""
    shown, more = ", ".join(sorted(keys)[:8]), len(keys) - 8
    return shown + (f" and {more} more" if more > 0 else "")


def report_unexpected(strict: str, checkpoint_dir, unexpected: List[str]) -> None:
    """Raises or logs the keys this rank asked for that `checkpoint_dir` lacks, as `strict` says."""
    if not unexpected:
        return
    if raises_on_unexpected(strict):
        raise ValueError(f"distributed checkpoint {checkpoint_dir} does not fit this model: keys missing from the "
                         f"checkpoint: {describe(unexpected)} (--dist-ckpt-strictness {strict})")
    if strict.startswith("log_"):
        logger.warning("%s lacks keys this model has (left as they are): %s", checkpoint_dir, describe(unexpected))


def report_missing(strict: str, checkpoint_dir, missing: List[str]) -> None:
    """Raises or logs the checkpoint keys no rank asked for, as `strict` says."""
    if not missing:
        return
    if strict == "raise_all":
        raise ValueError(f"distributed checkpoint {checkpoint_dir} holds keys this model does not load: "
                         f"{describe(missing)} (--dist-ckpt-strictness raise_all)")
    if strict == "log_all":
        logger.warning("%s holds keys this model does not load: %s", checkpoint_dir, describe(missing))
