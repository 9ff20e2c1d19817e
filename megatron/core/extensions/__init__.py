"""Optional accelerator back ends, each imported in exactly one module here."""

import importlib
import logging

logger = logging.getLogger(__name__)


def import_optional(name: str, instead: str):
    """Module `name`, or None when it is not installed. One that is installed but fails to import (built
    against another torch or CUDA fails in many ways) is logged with what runs `instead`, never raised."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
    except Exception as error:
        logger.warning("%s is installed but does not import (%s); %s", name, error, instead)
        return None
