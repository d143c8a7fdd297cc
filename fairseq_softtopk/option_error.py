"""The error of a bad option value, and its one-line report in fairseq's commands.

The option checks (:mod:`.option_checks`, the criteria's and models' configs) raise :class:`OptionError`, a
``ValueError``, when fairseq builds the criterion or the model, before the first update. Uncaught in
``fairseq-train`` (or ``fairseq-generate``), Python would print it at the end of a traceback through fairseq's
start-up, after Hydra's warnings; :func:`install_one_line_report` makes it one line naming the problem and the
command's exit status 1."""

import os
import sys

__all__ = ["OptionError", "install_one_line_report"]


class OptionError(ValueError):
    """A bad option value or combination; the message names the flag as typed (``--train-beam``)."""


def _fairseq_command() -> str:
    """The name of the fairseq command this process runs (``fairseq-train``), or "" outside one."""
    name = os.path.basename(sys.argv[0] if sys.argv else "")
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = getattr(main, "name", "") or ""
    if name.startswith("fairseq-") and not name.startswith("fairseq-softtopk"):
        return name
    if module.startswith("fairseq_cli."):
        return "fairseq-" + module.split(".", 1)[1].replace("_", "-")
    return ""


def install_one_line_report() -> bool:
    """In a fairseq command, an uncaught :class:`OptionError` prints ``COMMAND: error: MESSAGE`` alone (the
    exit status is 1); every other exception keeps its traceback. Returns whether it was installed (once)."""
    command = _fairseq_command()
    previous = sys.excepthook
    if not command or getattr(previous, "reports_option_errors", False):
        return False

    def excepthook(kind, value, traceback):
        if isinstance(value, OptionError):
            sys.stdout.flush()  # fairseq's log lines before it
            sys.stderr.write(f"{command}: error: {value}\n")
            return  # the interpreter then exits with status 1, its data-loading workers ended as usual
        previous(kind, value, traceback)

    excepthook.reports_option_errors = True
    sys.excepthook = excepthook
    return True
