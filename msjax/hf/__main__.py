"""`python -m msjax.hf export RUN_DIR[/checkpoints/STEP] OUT_DIR [--dtype bfloat16]`.

Exit codes: 0 written; 2 a user mistake (one line); 74 OUT_DIR could not be written (disk full,
I/O error; nothing is left there: free space and rerun).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from msjax.cli import ArgumentParser, user_error
from msjax.errors import MsjaxError
from msjax.resilience import exit_codes


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m msjax.hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="a checkpoint as a Hugging Face Llama (Mixtral), or with model.qk_norm Qwen3 "
        "(Qwen3-MoE), directory",
    )
    export.add_argument("source", help="RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/STEP")
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    try:
        args = parser.parse_args(argv)
        from msjax.hf.export import ExportWriteFailed, export_checkpoint

        try:
            written = export_checkpoint(args.source, args.out_dir, args.dtype)
        except ExportWriteFailed as error:
            print(f"msjax.hf: error: {error}", file=sys.stderr)
            return exit_codes.WRITE_FAILED
    except MsjaxError as error:
        return user_error("msjax.hf", error)
    print(f"msjax.hf: wrote {args.out_dir} ({', '.join(written)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
