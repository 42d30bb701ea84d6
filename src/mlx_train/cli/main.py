"""The ``mlx-train`` command: one dispatcher, one module per subcommand.

Each subcommand module under ``mlx_train.cli`` provides ``add_arguments(parser)``
and ``main(args) -> int``, and imports its heavy work inside ``main``. Only the
chosen subcommand's module is imported (``mlx-train --help`` imports none), so
that the help and the light commands start fast. Errors become one message on
stderr and the error's exit code; ``--debug`` adds the traceback.

Example::

    from mlx_train.cli.main import main
    exit_code = main(["train", "--epochs", "2"])
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
import warnings
from collections.abc import Iterable, Sequence
from typing import NoReturn, TypeVar, overload

from mlx_train import _start
from mlx_train.errors import ConfigError, MLXTrainError, did_you_mean

_N = TypeVar("_N")  # a namespace object given to parse_args

# Subcommand name -> (module under mlx_train.cli, one-line help); add a line here for a new command.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mlx_train.cli.train", "train a model (defaults: mlp on the digits dataset)"),
    "evaluate": ("mlx_train.cli.evaluate", "evaluate a checkpoint on the test (or val/train) split of its dataset"),
    "monitor": ("mlx_train.cli.monitor",
                "watch a training run live (progress, loss curves, throughput, memory, heartbeats)"),
    "plot": ("mlx_train.cli.plot", "draw a run's curves (loss, metrics, learning rate, throughput) into an image"),
    "status": ("mlx_train.cli.status", "show devices and the runs in progress (step, throughput, heartbeat age)"),
    "configure": ("mlx_train.cli.configure",
                  "configure the cluster for distributed training (writes an mlx.launch host file)"),
    "check-network": ("mlx_train.cli.check_network",
                      "check that every host is reachable and time the links between ranks"),
    "reset-distributed": ("mlx_train.cli.reset_distributed",
                          "stop leftover processes of mlx-train runs and clear stale distributed state"),
    "optimize": ("mlx_train.cli.optimize",
                 "print a memory plan (micro-batch, accumulation, checkpointing) that fits the device"),
    "export": ("mlx_train.cli.export", "export a checkpoint's model to ONNX, an MLX function (.mlxfn) or safetensors"),
    "finetune": ("mlx_train.cli.finetune",
                 "fine-tune a language model (LoRA, DoRA or full; mlx_lm.lora's flags and YAML files)"),
    "inspect-data": ("mlx_train.cli.inspect_data",
                     "show what fine-tuning trains: records with their trained tokens marked, and the counts"),
}


class UsageError(ConfigError):
    """A command line that argparse rejected (exit code 2, like argparse's own)."""

    def __init__(self, message: str, prog: str):
        super().__init__(f"{message}\nrun '{prog} --help' to see the flags")
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing and exiting."""

    _subcommands: dict[str, ArgumentParser]  # the top-level parser's: subcommand name -> its parser

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.prog)

    # argparse's three forms: no namespace gives an argparse.Namespace, a given one is filled and returned.
    @overload
    def parse_args(self, args: Iterable[str] | None = None, namespace: None = None) -> argparse.Namespace: ...
    @overload
    def parse_args(self, args: Iterable[str] | None, namespace: _N) -> _N: ...
    @overload
    def parse_args(self, *, namespace: _N) -> _N: ...

    def parse_args(self, args: Iterable[str] | None = None, namespace: object = None) -> object:
        """Like argparse's, but an unknown flag is reported by its subcommand, with the closest flag."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(self, "_subcommands", {}).get(getattr(namespace, "command", None), self)
            flags = [flag for action in parser._actions for flag in action.option_strings]
            unknown = next((e.split("=")[0] for e in extras if e.startswith("-")), "")
            hint = getattr(parser, "unknown_flag_hint", did_you_mean)  # a subcommand may know better
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}{hint(unknown, flags)}", parser.prog)
        return namespace


def build_parser(command: str | None = None) -> ArgumentParser:
    """The ``mlx-train`` parser: every subcommand's flags, or with ``command`` only that one's.

    Example: ``build_parser("monitor").parse_args(["monitor", "runs/a"])`` imports
    ``mlx_train.cli.monitor`` and no other subcommand module.
    """
    import mlx_train

    parser = ArgumentParser(
        prog="mlx-train",
        description="mlx-train: train, evaluate and manage MLX models.",
    )
    parser.add_argument(
        "--version", action="version", version=f"mlx-train {getattr(mlx_train, '__version__', '?')}"
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser._subcommands = commands.choices
    for name, (module_name, summary) in COMMANDS.items():
        if command is not None and name != command:
            commands.add_parser(name, help=summary)  # listed in the help; its flags are not needed now
            continue
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name, help=summary, description=(module.__doc__ or "").split("Example::")[0].strip(),
            epilog=getattr(module, "EPILOG", None), formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        # SUPPRESS: an absent sub-flag must not reset a `mlx-train --debug train` given before it.
        sub.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS,
            help="show the full traceback on errors",
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.main)
    return parser


def chosen_command(argv: Sequence[str]) -> str:
    """The subcommand named in ``argv`` ("" when there is none): the first word that is not a flag."""
    for word in argv:
        if word == "--":
            break
        if not word.startswith("-"):
            return word
    return ""


def _wants_debug(argv: Sequence[str]) -> bool:
    # Scanned before parsing so that errors raised while parsing also honour it.
    flags = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    return "--debug" in flags


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    # One readable line; --debug keeps Python's default (with the source location).
    return f"mlx-train: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mlx-train`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _wants_debug(argv)
    default_format = warnings.formatwarning
    if not debug:
        warnings.formatwarning = _format_warning
    try:
        _start.release()  # Ctrl-C is a KeyboardInterrupt from here on, caught below
        args = build_parser(chosen_command(argv)).parse_args(argv)
        return int(args.handler(args) or 0)
    except SystemExit as exit_request:  # --help and --version
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("mlx-train: interrupted", file=sys.stderr)
        _start.end(130)  # the command's process: 130 itself, not the death by SIGINT Python may choose
        return 130
    except MLXTrainError as error:
        if debug and not isinstance(error, UsageError):  # a usage error's traceback is argparse's
            traceback.print_exc()
        print(f"{getattr(error, 'prog', 'mlx-train')}: error: {error}", file=sys.stderr)
        return error.exit_code
    except Exception as error:  # noqa: BLE001 - the last line of defence: one line, no traceback
        if debug:
            traceback.print_exc()
            return 1
        print(
            f"mlx-train: unexpected error: {type(error).__name__}: {error}\n"
            "run with --debug for the traceback",
            file=sys.stderr,
        )
        return 1
    finally:
        warnings.formatwarning = default_format


_start.hold("imports")  # test hook: the last moment before main() can catch Ctrl-C

if __name__ == "__main__":
    sys.exit(main())
