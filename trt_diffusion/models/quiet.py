"""Keep library progress bars and advisory warnings out of our own progress output."""

import os
import warnings

_done = False


def quiet_libraries() -> None:
    global _done
    if _done:
        return
    _done = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub implicitly
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
