"""`python -m msjax.hf export RUN_DIR[/checkpoints/STEP] OUT_DIR [--dtype bfloat16]`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from msjax.cli import ArgumentParser, user_error
from msjax.errors import MsjaxError


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m msjax.hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint as a Hugging Face Llama directory")
    export.add_argument("source", help="RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/STEP")
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    try:
        args = parser.parse_args(argv)
        from msjax.hf.export import export_checkpoint

        written = export_checkpoint(args.source, args.out_dir, args.dtype)
    except MsjaxError as error:
        return user_error("msjax.hf", error)
    print(f"msjax.hf: wrote {args.out_dir} ({', '.join(written)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
